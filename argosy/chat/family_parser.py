"""FamilyChannelParser: the channel parser of every chat family (the state machine).

The family gives markers and call syntax as data; the behaviour is described in
argosy/chat/parsing.py, the entry point (`make_channel_parser`). The steps live here; what they
decide about a call unit, and the output, is the base class's (unit_decisions.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from argosy.chat.bare_call import STARTS, BareCallReader, BareOutcome
from argosy.chat.call_unit import Disposition, Mode, Unit
from argosy.chat.events import ChannelEvent, ToolCallEnd, ToolCallStart, ToolParseFailure
from argosy.chat.families import ChatFamily
from argosy.chat.families.json_call import CONSUMED, DONE, ERROR, JSON_WHITESPACE, CallObjectReader
from argosy.chat.markers import find_first, partial_marker_length
from argosy.chat.parser_options import ParserOptions
from argosy.chat.unit_decisions import EXTRA_CALL, UnitDecisions

_WS = JSON_WHITESPACE


def _is_name_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-."


class FamilyChannelParser(UnitDecisions):
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
        options = options or ParserOptions()
        super().__init__(family, options, choice_index, new_call_id)
        self._reasoning_markers = family.reasoning_markers if options.has_reasoning else None
        self._is_calling = options.has_tool_calls
        self._is_forced = options.has_tool_calls and options.is_call_forced
        is_bare_checked = self._is_calling and not self._is_forced and self._syntax.is_bare_json_checked
        self._bare_check = options.bare_calls if is_bare_checked else None
        self._bare: BareCallReader | None = None
        self._bare_start = 0
        opener, closer = self._syntax.open_marker, self._syntax.close_marker
        self._open_markers = (opener,) if opener and self._is_calling else ()
        self._resync_markers = tuple(marker for marker in (closer, opener) if marker)
        self._buf = ""
        self._is_final = False
        self._is_finished = False
        is_reasoning = self._reasoning_markers is not None and options.is_reasoning_open
        self._mode = Mode.REASONING if is_reasoning else Mode.TEXT
        self._has_reasoned = is_reasoning
        self._is_at_text_start = not is_reasoning
        self._steps: dict[Mode, Callable[[], bool]] = {
            Mode.TEXT: self._step_text,
            Mode.REASONING: self._step_reasoning,
            Mode.REGION: self._step_region,
            Mode.OBJECT: self._step_object,
            Mode.NAME: self._step_name,
            Mode.AFTER_OBJECT: self._step_after_object,
            Mode.JUNK: self._step_junk,
            Mode.FAILED: self._step_failed,
            Mode.BARE: self._step_bare,
        }

    def feed(self, delta: str) -> list[ChannelEvent]:
        if self._is_finished:
            raise RuntimeError("ChannelParser.feed after finish")
        self._buf += delta
        self._guard.feed(delta)
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
        return 0 if self._is_final else partial_marker_length(text, markers)

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
                    self._mode = Mode.REASONING
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
            elif self._bare_check is not None and buf[0] in STARTS:
                self._bare = BareCallReader(self._syntax, self._bare_check)
                self._bare_start = self._input_position()
                self._mode = Mode.BARE
            elif self._is_calling and self._syntax.is_bare_json_at_start and buf[0] == "{":
                self._open_region("", is_candidate=True)
            return True
        index, marker = find_first(buf, self._open_markers)
        if marker is not None:
            self._push_text(buf[:index])
            self._buf = buf[index + len(marker) :]
            self._open_region(marker, is_candidate=False)
            return True
        keep = self._hold(buf, self._open_markers)
        self._push_text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_bare(self) -> bool:
        """Markerless JSON at the answer's start (bare_call.py): held until it is decided."""
        assert self._bare is not None
        outcome = self._bare.read(self._buf, is_final=self._is_final)
        self._buf = ""
        if outcome is None:
            return False
        self._bare, self._mode, self._buf = None, Mode.TEXT, outcome.rest
        if outcome.calls is None:
            self._refuse_bare(outcome)
        for bare_call in outcome.calls or ():
            if self._num_calls and not self._options.can_call_in_parallel:
                self._emit(ToolParseFailure(self._choice_index, bare_call.raw, EXTRA_CALL))
                continue
            call_index, self._num_calls = self._num_calls, self._num_calls + 1
            self._emit(ToolCallStart(self._choice_index, call_index, self._new_call_id(), bare_call.name))
            self._emit_delta(call_index, bare_call.arguments)
            self._emit(ToolCallEnd(self._choice_index, call_index))
            self._text.touch_marker()
        return True

    def _refuse_bare(self, outcome: BareOutcome) -> None:
        """A markerless unit that is not calls: its text, or one call failing only its schema
        handed to the core for repair."""
        invalid = outcome.invalid_call
        if invalid is not None and self._guard.can_repair:
            call_index, self._num_calls = self._num_calls, self._num_calls + 1
            event = self._guard.invalid_call(
                call_index,
                invalid.name,
                invalid.arguments,
                text=outcome.text,
                start=self._bare_start,
                is_marked=False,
            )
            self._emit(event)
            self._text.touch_marker()
            return
        self._push_text(outcome.text)
        if outcome.failure is not None:
            self._emit(ToolParseFailure(self._choice_index, outcome.text, outcome.failure))

    def _step_reasoning(self) -> bool:
        assert self._reasoning_markers is not None
        end, buf = self._reasoning_markers[1], self._buf
        index = buf.find(end)
        if index >= 0:
            self._emit_delta("reasoning", self._reasoning.push(buf[:index]))
            self._buf = buf[index + len(end) :]
            self._mode = Mode.TEXT
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
            self._mode = Mode.OBJECT
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
            self._mode = Mode.NAME
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
        if unit.disposition is Disposition.PENDING and not self._resolve_from_reader(unit, reader):
            return True  # abandoned: plain text from here on
        if unit.disposition is Disposition.CALL and reader.args_kind == "object" and unit.held_name is None:
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
        self._mode = Mode.OBJECT
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
            self._unit = Unit(is_after_separator=True, start=self._input_position())
            self._mode = Mode.REGION
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
            elif close.startswith(body) and self._is_final:  # cut short inside the closer: markup
                self._take(body)
                self._buf = ""
            elif not self._is_final and (close.startswith(body) or opener.startswith(body)):
                return False
            elif not (opener and body.startswith(opener)):
                self._mode = Mode.JUNK
                return True
        self._end_unit()
        self._end_region()
        return True

    def _step_junk(self) -> bool:
        unit, buf = self._current_unit(), self._buf
        index, marker = find_first(buf, self._resync_markers)
        end = index if marker is not None else len(buf) - self._hold(buf, self._resync_markers)
        junk = buf[:end]
        if unit.disposition is Disposition.CONTENT:
            self._take(junk)
        else:
            unit.junk_parts.append(junk)
            self._push_text(junk)
        self._buf = buf[end:]
        if marker is None:
            return False
        self._mode = Mode.AFTER_OBJECT
        return True

    def _step_failed(self) -> bool:
        buf = self._buf
        index, marker = find_first(buf, self._resync_markers)
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
        if self._mode is Mode.BARE:  # fed nothing more: decide on what was held
            self._step_bare()
            self._run()
        unit = self._unit
        if unit is not None:
            is_inside_call = self._mode in (Mode.REGION, Mode.OBJECT, Mode.NAME)
            if unit.is_after_separator and self._mode is Mode.REGION:
                self._unit = None
                self._push_text("".join(unit.raw_parts))
            elif unit.is_candidate and unit.disposition is Disposition.PENDING:
                self._abandon_candidate()
            else:
                if is_inside_call:
                    unit.is_unterminated = True
                    unit.reason = unit.reason or "unterminated"
                self._end_unit(is_output_end=True)
        if self._mode is Mode.REASONING:
            self._emit_delta("reasoning", self._reasoning.flush())
        self._emit_delta("text", self._text.flush())

    @property
    def _is_bare_forced_region(self) -> bool:
        return self._is_forced and not self._region_marker
