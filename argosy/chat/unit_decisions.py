"""UnitDecisions: what FamilyChannelParser decides about one call unit, and its output.

The parser (family_parser.py) is one state machine; its steps live there, and this base class
holds what the steps decide: a unit's region opened and ended, its text taken (held, swallowed
by a call, or sent as content), its name resolved (a call numbered in order, a call past the
first with parallel calls off dropped, an undeclared name content), its arguments sent as they
come or, for a call `auto` mode checks (argosy/chat/call_guard.py), held until its JSON closes
and then released as a call or refused (content, or a ToolCallInvalid for the core's repair),
and the events that end it. The output is runs of events (event_runs.py) with whitespace at
markers tidied (segment.py).
"""

from __future__ import annotations

from collections.abc import Callable

from argosy.chat.call_guard import CallGuard
from argosy.chat.call_unit import Disposition, Mode, Unit
from argosy.chat.event_runs import EventRuns
from argosy.chat.events import INVALID_ARGUMENTS, ChannelEvent, ToolCallEnd, ToolCallStart, ToolParseFailure
from argosy.chat.families import ChatFamily
from argosy.chat.families.json_call import JSON_WHITESPACE, CallObjectReader, final_arguments
from argosy.chat.parser_options import ParserOptions
from argosy.chat.segment import Segment

_WS = JSON_WHITESPACE
EXTRA_CALL = "extra_call"


class UnitDecisions:
    """The unit and output half of the parser's state (the parser sets `_buf`, `_is_final`,
    `_mode` and `_is_at_text_start` as it steps; see FamilyChannelParser for the invariant)."""

    _buf: str
    _is_final: bool
    _mode: Mode
    _is_at_text_start: bool

    def __init__(
        self,
        family: ChatFamily,
        options: ParserOptions,
        choice_index: int,
        new_call_id: Callable[[], str] | None,
    ) -> None:
        self._options = options
        self._choice_index = choice_index
        self._new_call_id = new_call_id or family.new_call_id
        self._syntax = family.call_syntax
        self._guard = CallGuard(options, self._syntax, choice_index)
        self._runs = EventRuns(choice_index)
        self._num_calls = 0
        self._text = Segment(is_at_marker=False)
        self._reasoning = Segment(is_at_marker=True)
        self._unit: Unit | None = None
        self._region_marker = ""  # the marker that opened the call region ("" if none)
        self._is_array = False

    def _current_unit(self) -> Unit:
        assert self._unit is not None
        return self._unit

    def _input_position(self) -> int:
        """Where the undecided input (`_buf`) begins in everything fed so far."""
        return self._guard.num_fed - len(self._buf)

    def _open_region(self, marker: str, *, is_candidate: bool) -> None:
        start = self._input_position() - len(marker)  # the marker was just taken off `_buf`
        self._unit = Unit(raw_parts=[marker] if marker else [], is_candidate=is_candidate, start=start)
        self._region_marker = marker
        self._is_array = False
        self._mode = Mode.REGION

    def _end_region(self) -> None:
        self._unit = None
        self._is_array = False
        self._is_at_text_start = False
        self._mode = Mode.TEXT

    def _take(self, text: str) -> None:
        """Text of the current unit: held, swallowed by a call, or sent if it is content."""
        unit = self._current_unit()
        unit.raw_parts.append(text)
        if unit.disposition is Disposition.CONTENT:
            self._push_text(text)

    def _take_whitespace(self) -> str:
        buf = self._buf
        body = buf.lstrip(_WS)
        if len(body) < len(buf):
            self._take(buf[: len(buf) - len(body)])
            self._buf = body
        return body

    def _resolve_from_reader(self, unit: Unit, reader: CallObjectReader) -> bool:
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

    def _resolve_name(self, unit: Unit, name: str) -> None:
        tool_names = self._options.tool_names
        if not name or (tool_names is not None and name not in tool_names):
            self._make_content(unit, "unknown_tool" if name else "missing_name")
            return
        if self._num_calls and not self._options.can_call_in_parallel:
            unit.disposition, unit.reason = Disposition.DROPPED, EXTRA_CALL
        else:
            unit.disposition, unit.call_index = Disposition.CALL, self._num_calls
            self._num_calls += 1
            if self._guard.holds(name):  # sent whole once its arguments pass the schema
                unit.held_name = name
            else:
                self._emit(ToolCallStart(self._choice_index, unit.call_index, self._new_call_id(), name))
        self._text.touch_marker()

    def _make_content(self, unit: Unit, reason: str) -> None:
        unit.disposition = Disposition.CONTENT
        unit.reason = unit.reason or reason
        self._push_text("".join(unit.raw_parts))

    def _abandon_candidate(self) -> None:
        """A markerless `{` that is not a call after all: its text is plain text."""
        unit = self._current_unit()
        self._push_text("".join(unit.raw_parts))
        self._end_region()

    def _fail_unit(self, reason: str) -> None:
        unit = self._current_unit()
        if unit.disposition is Disposition.PENDING:
            if unit.is_candidate:
                self._abandon_candidate()
                return
            self._make_content(unit, reason)
        else:
            unit.reason = unit.reason or reason
        self._mode = Mode.FAILED

    def _send_new_args(self, unit: Unit, reader: CallObjectReader) -> None:
        assert unit.call_index is not None
        parts = reader.args_parts
        if len(parts) > unit.num_args_parts_sent:
            self._emit_delta(unit.call_index, "".join(parts[unit.num_args_parts_sent :]))
            unit.num_args_parts_sent = len(parts)

    def _complete_object(self, unit: Unit, reader: CallObjectReader) -> None:
        is_valid = reader.is_valid()
        if unit.disposition is Disposition.PENDING:
            if unit.is_candidate:
                self._abandon_candidate()
                return
            self._make_content(unit, "missing_name" if is_valid else "invalid_json")
        elif unit.disposition is Disposition.CALL:
            assert unit.call_index is not None
            rest, reason = final_arguments(reader)
            if unit.held_name is not None:
                arguments = "".join(reader.args_parts) + rest if reader.args_kind == "object" else rest
                if is_valid and reason is None and self._guard.fails(unit.held_name, arguments):
                    self._refuse_arguments(unit, arguments)
                    self._mode = Mode.AFTER_OBJECT
                    return
                self._release(unit)
            self._emit_delta(unit.call_index, rest)
            unit.reason = unit.reason or reason or (None if is_valid else "invalid_json")
            self._emit(ToolCallEnd(self._choice_index, unit.call_index))
            unit.is_end_sent = True
        elif not is_valid:
            unit.reason = unit.reason or "invalid_json"
        self._mode = Mode.AFTER_OBJECT

    def _release(self, unit: Unit) -> None:
        """A held call stands (its arguments pass, or broke off): its start and the arguments
        read so far go out."""
        assert unit.held_name is not None and unit.call_index is not None
        self._emit(ToolCallStart(self._choice_index, unit.call_index, self._new_call_id(), unit.held_name))
        unit.held_name = None
        if unit.reader is not None and unit.reader.args_kind == "object":
            self._send_new_args(unit, unit.reader)

    def _refuse_arguments(self, unit: Unit, arguments: str) -> None:
        """A held call whose arguments fail its schema is no call: held for the core's repair
        (swallowed like a call until its unit ends), or its text from here on."""
        if self._guard.can_repair:
            unit.disposition, unit.arguments = Disposition.INVALID, arguments
            return
        unit.call_index, unit.held_name = None, None
        self._num_calls -= 1  # the unit was the last to take a number: nothing came after it
        self._make_content(unit, INVALID_ARGUMENTS)

    def _end_unit(self, *, is_output_end: bool = False) -> None:
        unit = self._current_unit()
        self._unit = None
        if unit.held_name is not None and unit.disposition is Disposition.CALL:
            self._release(unit)
        if unit.disposition is Disposition.PENDING:
            unit.disposition = Disposition.CONTENT
            unit.reason = unit.reason or "missing_name"
            self._push_text("".join(unit.raw_parts))
        elif unit.disposition is not Disposition.CONTENT:
            self._text.touch_marker()  # the call spans to its closing marker
        if is_output_end:  # the last text goes before the failure
            self._emit_delta("text", self._text.flush())
        is_call = unit.disposition is Disposition.CALL
        if is_call and not unit.is_end_sent:
            assert unit.call_index is not None
            self._emit(ToolCallEnd(self._choice_index, unit.call_index))
        if unit.disposition is Disposition.INVALID:
            assert unit.call_index is not None and unit.held_name is not None
            text = "".join(unit.raw_parts)
            self._emit(
                self._guard.invalid_call(
                    unit.call_index,
                    unit.held_name,
                    unit.arguments,
                    text=text,
                    start=unit.start,
                    is_marked=True,
                )
            )
        elif unit.reason is not None:
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

    # ---- output

    def _push_text(self, text: str) -> None:
        self._runs.delta("text", self._text.push(text))

    def _emit_delta(self, key: str | int, text: str) -> None:
        self._runs.delta(key, text)

    def _emit(self, event: ChannelEvent) -> None:
        self._runs.event(event)

    def _drain(self) -> list[ChannelEvent]:
        return self._runs.drain()
