"""Channel parsers: generated text -> text / reasoning / tool-call events, per model family.

One parser per choice of a request: `feed(delta)` as text is generated, `finish()` once at the
end. Events are the neutral ones of argosy/chat/events.py; a dialect renders them. The
non-streaming result (`parse_text`, or `ChannelCollector` over the streamed events) is the same
events collected, so streaming and non-streaming agree by construction, and the events do not
depend on how the text was cut into deltas (up to merging adjacent deltas of one kind).

Streaming: text is emitted as soon as it cannot be the start of a marker; only a possible
partial marker is held back. A call is held until its name is known; then `ToolCallStart`,
then its arguments as the model writes them (`ToolCallArgsDelta` pieces joining to the model's
own JSON text of the arguments, exactly as in the non-streaming result), then `ToolCallEnd`.
Calls are numbered 0, 1, 2... in order.

Decisions (where SPEC §2 is silent):
- If a call's name is not among `tool_names`, the call's raw text (markers included) comes
  back as content with a ToolParseFailure "unknown_tool"; text that breaks before its name is
  known ("invalid_json", "missing_name") likewise. Once the name is known the call is a call:
  a later failure ("invalid_json", "bad_arguments", "unterminated") keeps the call, with the
  arguments text the model wrote (possibly not valid JSON, as OpenAI's own calls may be), plus
  a ToolParseFailure carrying its `call_index`.
- A call object that is complete is a call even if its closing marker never came. A call that
  breaks mid-JSON runs to its closing marker, the next opening marker, or the end of output.
- The output ending inside a call (before its JSON is complete) is a failure with
  `is_unterminated` set: the caller says finish reason "length".
- `can_call_in_parallel=False`: only the first call is a call; later calls are left out of
  the message, each reported as ToolParseFailure "extra_call".
- Text between a complete call and its closing marker is content ("unexpected_text").
- Whitespace touching a marker is tidied as if the marker were not there: content never
  starts or ends with it, and text on both sides of calls keeps one whitespace run (see
  _Segment). Text that touches no marker is left exactly as generated.
- Reasoning opens only at the start of the output (`<think>` later on is text), once. Tool
  markers inside reasoning are reasoning. A disabled channel is not parsed: its markers and
  text are content (tool_choice "none": calls come back as text).
- Llama's markerless JSON call is recognised only where it opens the output, and only while
  its keys read like a call (name / parameters / arguments / type); otherwise it is plain text.
- `is_call_forced` (tool_choice "required" or named, enforced by a grammar): the output after
  any reasoning is calls, in the family's marker syntax (the grammar's `<tool_call>` shape)
  or bare JSON: call objects one after another, or one array of them.
- Arguments are the model's own JSON text of the arguments object (not re-serialized), so
  streamed fragments and the non-streaming arguments are the same string; a JSON string
  holding an object is unwrapped, and missing or null arguments are "{}".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import NamedTuple, Protocol

from argosy.chat.events import (
    ChannelEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.chat.families import ChatFamily, get_family
from argosy.chat.families.json_call import (
    CONSUMED,
    DONE,
    ERROR,
    JSON_WHITESPACE,
    CallObjectReader,
    final_arguments,
)

_WS = JSON_WHITESPACE
_EXTRA_CALL = "extra_call"


class ChannelParser(Protocol):
    def feed(self, delta: str) -> list[ChannelEvent]: ...

    def finish(self) -> list[ChannelEvent]: ...


@dataclass(frozen=True, slots=True)
class ParserOptions:
    """What one request asks of the parser.

    `has_reasoning` / `has_tool_calls`: parse that channel (tool_choice "none" -> no calls).
    `tool_names`: the declared tools (None accepts any name). `can_call_in_parallel`: the
    request's parallel_tool_calls. `is_reasoning_open`: the prompt already opened the reasoning
    block (see `prompt_opens_reasoning`). `is_call_forced`: a grammar forces calls (tool_choice
    "required" or named), so bare JSON at the start of the output is calls too.
    """

    has_reasoning: bool = True
    has_tool_calls: bool = True
    tool_names: frozenset[str] | None = None
    can_call_in_parallel: bool = True
    is_reasoning_open: bool = False
    is_call_forced: bool = False


class _Mode(IntEnum):  # IntEnum: hashed in C, looked up per step
    TEXT = 0
    REASONING = 1
    REGION = 2  # a call region is open: before a call's body
    OBJECT = 3  # inside a call's JSON
    NAME = 4  # Mistral `name[ARGS]`: reading the name
    AFTER_OBJECT = 5  # a call's JSON closed: separators, closing marker
    JUNK = 6  # text after a complete call, before its closing marker
    FAILED = 7  # a call that broke: its text runs to a marker or the end


class _Disposition(Enum):
    PENDING = "pending"  # name not known yet: the text is held
    CALL = "call"
    CONTENT = "content"
    DROPPED = "dropped"  # a call past the first with parallel calls off


@dataclass(slots=True)
class _Unit:
    """One call attempt: all its raw text, and what it turned out to be."""

    raw_parts: list[str] = field(default_factory=list)
    is_candidate: bool = False  # a markerless `{` that may turn out to be plain text
    is_after_separator: bool = False
    disposition: _Disposition = _Disposition.PENDING
    call_index: int | None = None
    reason: str | None = None
    is_unterminated: bool = False
    reader: CallObjectReader | None = None
    name_parts: list[str] = field(default_factory=list)
    junk_parts: list[str] = field(default_factory=list)
    num_args_parts_sent: int = 0
    num_keys_checked: int = 0
    is_end_sent: bool = False


class _Segment:
    """One channel's text, with whitespace at markers tidied.

    A marker (reasoning start or end, a call) is treated as not there: whitespace before it is
    held, whitespace after it is dropped when whitespace was held before it, and what is held
    is sent only once text follows. So text never starts or ends with whitespace that touches
    a marker, and "Sure. <call> Done." reads "Sure. Done.". Text touching no marker is left
    exactly as generated. Invariant: `_pending` is the held trailing whitespace.
    """

    __slots__ = ("_has_text", "_pending", "_is_at_marker", "_is_dropping_whitespace")

    def __init__(self, *, is_at_marker: bool) -> None:
        self._has_text = False
        self._pending = ""
        self._is_at_marker = is_at_marker  # no text since the last marker
        self._is_dropping_whitespace = is_at_marker  # drop whitespace that follows it

    def push(self, text: str) -> str:
        if self._is_dropping_whitespace:
            text = text.lstrip(_WS)
        if not text:
            return ""
        text = self._pending + text
        body = text.rstrip(_WS)
        self._pending = text[len(body) :]
        if body:
            self._has_text = True
            self._is_at_marker = self._is_dropping_whitespace = False
        return body

    def touch_marker(self) -> None:
        self._is_at_marker = True
        self._is_dropping_whitespace = bool(self._pending) or not self._has_text
        if not self._has_text:
            self._pending = ""

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self._is_at_marker else pending


def _find_first(text: str, markers: Iterable[str]) -> tuple[int, str | None]:
    """The earliest marker in `text` (the longest on a tie) and where it starts."""
    best_index, best = -1, None
    for marker in markers:
        index = text.find(marker)
        if index >= 0 and (best is None or (index, -len(marker)) < (best_index, -len(best))):
            best_index, best = index, marker
    return best_index, best


def _partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """The longest end of `text` that is a proper prefix of a marker (to hold back)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest


def _is_name_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-."


class FamilyChannelParser:
    """The ChannelParser for every family: the family gives markers and call syntax (data).

    Invariant: `_buf` holds only input not yet decided (a possible partial marker, or text the
    current mode has not reached); every other character has gone to exactly one place: a
    channel segment, or the raw text of a call unit (`_unit`), which is sent as content when
    the unit is not a call.
    """

    def __init__(
        self,
        family: ChatFamily,
        options: ParserOptions | None = None,
        *,
        choice_index: int = 0,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        self._options = options = options or ParserOptions()
        self._choice_index = choice_index
        self._new_call_id = new_call_id or family.new_call_id
        self._syntax = family.call_syntax
        self._reasoning_markers = family.reasoning_markers if options.has_reasoning else None
        self._is_calling = options.has_tool_calls
        self._is_forced = options.has_tool_calls and options.is_call_forced
        opener, closer = self._syntax.open_marker, self._syntax.close_marker
        self._open_markers = (opener,) if opener and self._is_calling else ()
        self._resync_markers = tuple(marker for marker in (closer, opener) if marker)
        self._buf = ""
        self._is_final = False
        self._is_finished = False
        self._out: list[ChannelEvent] = []
        self._run_key: str | int | None = None  # "text", "reasoning" or a call index
        self._run_parts: list[str] = []
        self._num_calls = 0
        self._text = _Segment(is_at_marker=False)
        self._reasoning = _Segment(is_at_marker=True)
        self._unit: _Unit | None = None
        self._region_marker = ""  # the marker that opened the call region ("" if none)
        self._is_array = False
        is_reasoning = self._reasoning_markers is not None and options.is_reasoning_open
        self._mode = _Mode.REASONING if is_reasoning else _Mode.TEXT
        self._has_reasoned = is_reasoning
        self._is_at_text_start = not is_reasoning
        self._steps: dict[_Mode, Callable[[], bool]] = {
            _Mode.TEXT: self._step_text,
            _Mode.REASONING: self._step_reasoning,
            _Mode.REGION: self._step_region,
            _Mode.OBJECT: self._step_object,
            _Mode.NAME: self._step_name,
            _Mode.AFTER_OBJECT: self._step_after_object,
            _Mode.JUNK: self._step_junk,
            _Mode.FAILED: self._step_failed,
        }

    def feed(self, delta: str) -> list[ChannelEvent]:
        if self._is_finished:
            raise RuntimeError("ChannelParser.feed after finish")
        self._buf += delta
        self._run()
        return self._drain()

    def finish(self) -> list[ChannelEvent]:
        """End of output: send what was held; a call the output ended inside is a failure."""
        if self._is_finished:
            return []
        self._is_final = True
        self._run()
        self._finish_mode()
        self._is_finished = True
        return self._drain()

    # ---- the loop: each step consumes input or changes mode; False when it needs more input

    def _run(self) -> None:
        while self._buf and self._steps[self._mode]():
            pass

    def _hold(self, text: str, markers: Iterable[str]) -> int:
        return 0 if self._is_final else _partial_marker_length(text, markers)

    def _step_text(self) -> bool:
        buf = self._buf
        if self._is_at_text_start:
            body = buf.lstrip(_WS)
            if len(body) < len(buf):
                self._push_text(buf[: len(buf) - len(body)])
                self._buf = body
                return True
            if self._reasoning_markers and not self._has_reasoned:
                start = self._reasoning_markers[0]
                if buf.startswith(start):
                    self._buf = buf[len(start) :]
                    self._text.touch_marker()
                    self._has_reasoned = True
                    self._mode = _Mode.REASONING
                    return True
                if start.startswith(buf) and not self._is_final:
                    return False
            self._is_at_text_start = False
            opener = self._syntax.open_marker or ""
            if self._is_forced:  # calls with the family's marker, or bare JSON
                if opener.startswith(buf) and not self._is_final:
                    self._is_at_text_start = True
                    return False
                if not (opener and buf.startswith(opener)):
                    self._open_region("", is_candidate=False)
            elif self._is_calling and self._syntax.is_bare_json_at_start and buf[0] == "{":
                self._open_region("", is_candidate=True)
            return True
        index, marker = _find_first(buf, self._open_markers)
        if marker is not None:
            self._push_text(buf[:index])
            self._buf = buf[index + len(marker) :]
            self._open_region(marker, is_candidate=False)
            return True
        keep = self._hold(buf, self._open_markers)
        self._push_text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_reasoning(self) -> bool:
        assert self._reasoning_markers is not None
        end, buf = self._reasoning_markers[1], self._buf
        index = buf.find(end)
        if index >= 0:
            self._emit_delta("reasoning", self._reasoning.push(buf[:index]))
            self._buf = buf[index + len(end) :]
            self._mode = _Mode.TEXT
            self._text.touch_marker()
            self._is_at_text_start = True
            return True
        keep = self._hold(buf, (end,))
        self._emit_delta("reasoning", self._reasoning.push(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_region(self) -> bool:
        unit = self._current_unit()
        body = self._take_whitespace()
        if not body:
            return False
        ch = body[0]
        if ch == "{":
            unit.reader = CallObjectReader(self._syntax)
            self._mode = _Mode.OBJECT
        elif unit.is_after_separator:  # a separator not followed by a call: the region is over
            self._unit = None
            self._push_text("".join(unit.raw_parts))
            self._end_region()
        elif (
            ch == "["
            and not self._is_array
            and (self._syntax.is_array_allowed or self._is_bare_forced_region)
        ):
            self._take("[")
            self._buf = body[1:]
            self._is_array = True
        elif self._syntax.args_marker and not self._is_array and _is_name_char(ch):
            self._mode = _Mode.NAME
        else:
            self._fail_unit("invalid_json")
        return True

    def _step_object(self) -> bool:
        unit = self._current_unit()
        reader = unit.reader
        assert reader is not None
        consumed, status = reader.read(self._buf)
        self._take(self._buf[:consumed])
        self._buf = self._buf[consumed:]
        if unit.disposition is _Disposition.PENDING and not self._resolve_from_reader(unit, reader):
            return True  # abandoned: plain text from here on
        if unit.disposition is _Disposition.CALL and reader.args_kind == "object":
            self._send_new_args(unit, reader)
        if status == ERROR:
            self._fail_unit("invalid_json")
        elif status == DONE:
            self._complete_object(unit, reader)
        return status != CONSUMED

    def _step_name(self) -> bool:
        unit, buf = self._current_unit(), self._buf
        marker = self._syntax.args_marker
        assert marker is not None
        index = buf.find(marker)
        limit = index if index >= 0 else len(buf) - self._hold(buf, (marker,))
        bad = next((position for position in range(limit) if not _is_name_char(buf[position])), None)
        name_text = buf[: limit if bad is None else bad]
        unit.name_parts.append(name_text)
        self._take(name_text)
        if bad is not None:
            self._buf = buf[bad:]
            self._fail_unit("invalid_json")
            return True
        if index < 0:
            self._buf = buf[limit:]
            return False
        self._take(marker)
        self._buf = buf[index + len(marker) :]
        self._resolve_name(unit, "".join(unit.name_parts))
        unit.reader = CallObjectReader(self._syntax, is_args_only=True)
        self._mode = _Mode.OBJECT
        return True

    def _step_after_object(self) -> bool:
        body = self._take_whitespace()
        if not body:
            return False
        syntax, ch = self._syntax, body[0]
        separator = "," if self._is_array else syntax.separator
        is_separated = bool(separator) and body.startswith(separator or "")
        if is_separated or (ch == "{" and self._is_bare_forced_region and not self._is_array):
            if is_separated:  # the separator belongs to the call before it
                self._take(separator or "")
                self._buf = body[len(separator or "") :]
            self._end_unit()
            self._unit = _Unit(is_after_separator=True)
            self._mode = _Mode.REGION
            return True
        if self._is_array:
            if ch == "]":
                self._take(ch)
                self._buf = body[1:]
        elif syntax.close_marker and self._region_marker:
            close, opener = syntax.close_marker, syntax.open_marker or ""
            if body.startswith(close):
                self._take(close)
                self._buf = body[len(close) :]
            elif not self._is_final and (close.startswith(body) or opener.startswith(body)):
                return False
            elif not (opener and body.startswith(opener)):
                self._mode = _Mode.JUNK
                return True
        self._end_unit()
        self._end_region()
        return True

    def _step_junk(self) -> bool:
        unit, buf = self._current_unit(), self._buf
        index, marker = _find_first(buf, self._resync_markers)
        end = index if marker is not None else len(buf) - self._hold(buf, self._resync_markers)
        junk = buf[:end]
        if unit.disposition is _Disposition.CONTENT:
            self._take(junk)
        else:
            unit.junk_parts.append(junk)
            self._push_text(junk)
        self._buf = buf[end:]
        if marker is None:
            return False
        self._mode = _Mode.AFTER_OBJECT
        return True

    def _step_failed(self) -> bool:
        buf = self._buf
        index, marker = _find_first(buf, self._resync_markers)
        if marker is None:
            keep = self._hold(buf, self._resync_markers)
            self._take(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._take(buf[:index])
        self._buf = buf[index:]
        if marker == self._syntax.close_marker:
            self._take(marker)
            self._buf = buf[index + len(marker) :]
        self._end_unit()
        self._end_region()
        return True

    def _finish_mode(self) -> None:
        unit = self._unit
        if unit is not None:
            is_inside_call = self._mode in (_Mode.REGION, _Mode.OBJECT, _Mode.NAME)
            if unit.is_after_separator and self._mode is _Mode.REGION:
                self._unit = None
                self._push_text("".join(unit.raw_parts))
            elif unit.is_candidate and unit.disposition is _Disposition.PENDING:
                self._abandon_candidate()
            else:
                if is_inside_call:
                    unit.is_unterminated = True
                    unit.reason = unit.reason or "unterminated"
                self._end_unit(is_output_end=True)
        if self._mode is _Mode.REASONING:
            self._emit_delta("reasoning", self._reasoning.flush())
        self._emit_delta("text", self._text.flush())

    # ---- call units

    def _current_unit(self) -> _Unit:
        assert self._unit is not None
        return self._unit

    @property
    def _is_bare_forced_region(self) -> bool:
        return self._is_forced and not self._region_marker

    def _open_region(self, marker: str, *, is_candidate: bool) -> None:
        self._unit = _Unit(raw_parts=[marker] if marker else [], is_candidate=is_candidate)
        self._region_marker = marker
        self._is_array = False
        self._mode = _Mode.REGION

    def _end_region(self) -> None:
        self._unit = None
        self._is_array = False
        self._is_at_text_start = False
        self._mode = _Mode.TEXT

    def _take(self, text: str) -> None:
        """Text of the current unit: held, swallowed by a call, or sent if it is content."""
        unit = self._current_unit()
        unit.raw_parts.append(text)
        if unit.disposition is _Disposition.CONTENT:
            self._push_text(text)

    def _take_whitespace(self) -> str:
        buf = self._buf
        body = buf.lstrip(_WS)
        if len(body) < len(buf):
            self._take(buf[: len(buf) - len(body)])
            self._buf = body
        return body

    def _resolve_from_reader(self, unit: _Unit, reader: CallObjectReader) -> bool:
        """Decide a pending unit once its keys / name allow; False if it was abandoned."""
        if unit.is_candidate:
            call_keys = (*self._syntax.name_keys, *self._syntax.args_keys, "type")
            for key in reader.keys[unit.num_keys_checked :]:
                if key not in call_keys:
                    self._abandon_candidate()
                    return False
            unit.num_keys_checked = len(reader.keys)
        if reader.is_name_seen:
            if reader.name is not None:
                self._resolve_name(unit, reader.name)
            elif unit.is_candidate:
                self._abandon_candidate()
                return False
            else:
                self._make_content(unit, "missing_name")
        return True

    def _resolve_name(self, unit: _Unit, name: str) -> None:
        tool_names = self._options.tool_names
        if not name or (tool_names is not None and name not in tool_names):
            self._make_content(unit, "unknown_tool" if name else "missing_name")
            return
        if self._num_calls and not self._options.can_call_in_parallel:
            unit.disposition, unit.reason = _Disposition.DROPPED, _EXTRA_CALL
        else:
            unit.disposition, unit.call_index = _Disposition.CALL, self._num_calls
            self._num_calls += 1
            self._emit(ToolCallStart(self._choice_index, unit.call_index, self._new_call_id(), name))
        self._text.touch_marker()

    def _make_content(self, unit: _Unit, reason: str) -> None:
        unit.disposition = _Disposition.CONTENT
        unit.reason = unit.reason or reason
        self._push_text("".join(unit.raw_parts))

    def _abandon_candidate(self) -> None:
        """A markerless `{` that is not a call after all: its text is plain text."""
        unit = self._current_unit()
        self._push_text("".join(unit.raw_parts))
        self._end_region()

    def _fail_unit(self, reason: str) -> None:
        unit = self._current_unit()
        if unit.disposition is _Disposition.PENDING:
            if unit.is_candidate:
                self._abandon_candidate()
                return
            self._make_content(unit, reason)
        else:
            unit.reason = unit.reason or reason
        self._mode = _Mode.FAILED

    def _send_new_args(self, unit: _Unit, reader: CallObjectReader) -> None:
        assert unit.call_index is not None
        parts = reader.args_parts
        if len(parts) > unit.num_args_parts_sent:
            self._emit_delta(unit.call_index, "".join(parts[unit.num_args_parts_sent :]))
            unit.num_args_parts_sent = len(parts)

    def _complete_object(self, unit: _Unit, reader: CallObjectReader) -> None:
        is_valid = reader.is_valid()
        if unit.disposition is _Disposition.PENDING:
            if unit.is_candidate:
                self._abandon_candidate()
                return
            self._make_content(unit, "missing_name" if is_valid else "invalid_json")
        elif unit.disposition is _Disposition.CALL:
            assert unit.call_index is not None
            rest, reason = final_arguments(reader)
            self._emit_delta(unit.call_index, rest)
            unit.reason = unit.reason or reason or (None if is_valid else "invalid_json")
            self._emit(ToolCallEnd(self._choice_index, unit.call_index))
            unit.is_end_sent = True
        elif not is_valid:
            unit.reason = unit.reason or "invalid_json"
        self._mode = _Mode.AFTER_OBJECT

    def _end_unit(self, *, is_output_end: bool = False) -> None:
        unit = self._current_unit()
        self._unit = None
        if unit.disposition is _Disposition.PENDING:
            unit.disposition = _Disposition.CONTENT
            unit.reason = unit.reason or "missing_name"
            self._push_text("".join(unit.raw_parts))
        elif unit.disposition is not _Disposition.CONTENT:
            self._text.touch_marker()  # the call spans to its closing marker
        if is_output_end:  # the last text goes before the failure
            self._emit_delta("text", self._text.flush())
        is_call = unit.disposition is _Disposition.CALL
        if is_call and not unit.is_end_sent:
            assert unit.call_index is not None
            self._emit(ToolCallEnd(self._choice_index, unit.call_index))
        if unit.reason is not None:
            self._emit(
                ToolParseFailure(
                    self._choice_index,
                    "".join(unit.raw_parts),
                    unit.reason,
                    unit.call_index if is_call else None,
                    unit.is_unterminated,
                )
            )
        junk = "".join(unit.junk_parts)
        if junk.strip(_WS):
            self._emit(ToolParseFailure(self._choice_index, junk, "unexpected_text"))

    # ---- output: adjacent deltas of one kind go out as one event

    def _push_text(self, text: str) -> None:
        self._emit_delta("text", self._text.push(text))

    def _emit_delta(self, key: str | int, text: str) -> None:
        if not text:
            return
        if key != self._run_key:
            self._close_run()
            self._run_key = key
        self._run_parts.append(text)

    def _close_run(self) -> None:
        key, text = self._run_key, "".join(self._run_parts)
        if key is None:
            return
        if key == "text":
            self._out.append(TextDelta(self._choice_index, text))
        elif key == "reasoning":
            self._out.append(ReasoningDelta(self._choice_index, text))
        else:
            assert isinstance(key, int)
            self._out.append(ToolCallArgsDelta(self._choice_index, key, text))
        self._run_key, self._run_parts = None, []

    def _emit(self, event: ChannelEvent) -> None:
        self._close_run()
        self._out.append(event)

    def _drain(self) -> list[ChannelEvent]:
        self._close_run()
        out, self._out = self._out, []
        return out


def make_channel_parser(
    family: ChatFamily | str,
    options: ParserOptions | None = None,
    *,
    choice_index: int = 0,
    new_call_id: Callable[[], str] | None = None,
) -> ChannelParser:
    """A parser for one choice; `new_call_id` defaults to the family's (`call_` + 24 chars)."""
    if isinstance(family, str):
        family = get_family(family)
    return FamilyChannelParser(family, options, choice_index=choice_index, new_call_id=new_call_id)


def prompt_opens_reasoning(family: ChatFamily, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (Qwen3-style templates
    with enable_thinking put `<think>\\n` in the generation prompt)."""
    markers = family.reasoning_markers
    return markers is not None and prompt_text.rstrip(_WS).endswith(markers[0])


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    call_index: int
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ParsedOutput(NamedTuple):
    """The non-streaming message of one choice."""

    content: str
    reasoning: str
    tool_calls: list[ParsedToolCall]
    parse_failures: list[ToolParseFailure]

    @property
    def is_call_cut_off(self) -> bool:
        """The output ended inside a call: finish reason "length"."""
        return any(failure.is_unterminated for failure in self.parse_failures)


class ChannelCollector:
    """Collects channel events into the non-streaming message."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, tuple[str, str, list[str]]] = {}
        self._failures: list[ToolParseFailure] = []

    def add(self, events: Iterable[ChannelEvent]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                self._content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self._reasoning.append(event.text)
            elif isinstance(event, ToolCallStart):
                self._calls[event.call_index] = (event.call_id, event.name, [])
            elif isinstance(event, ToolCallArgsDelta):
                self._calls[event.call_index][2].append(event.fragment)
            elif isinstance(event, ToolParseFailure):
                self._failures.append(event)

    def result(self) -> ParsedOutput:
        calls = [
            ParsedToolCall(call_index, call_id, name, "".join(fragments))
            for call_index, (call_id, name, fragments) in sorted(self._calls.items())
        ]
        return ParsedOutput("".join(self._content), "".join(self._reasoning), calls, list(self._failures))


def parse_text(parser: ChannelParser, text: str) -> ParsedOutput:
    """Run a whole output through a fresh parser: the non-streaming result."""
    collector = ChannelCollector()
    collector.add(parser.feed(text))
    collector.add(parser.finish())
    return collector.result()
