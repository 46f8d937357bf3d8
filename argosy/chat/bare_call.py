"""BareCallReader: markerless JSON at the start of an answer, held until it can be judged.

Small ChatML models asked for `<tool_call>` blocks often write the call bare instead
(Qwen2.5-Coder-0.5B with tools declared, greedy: every one of 20 calls measured, about half
of them fenced):

    {"name": "get_weather", "arguments": {"city": "Paris"}}
    [{"name": "get_weather", ...}, {"name": "get_time", ...}]
    ```json
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```

A unit is: an optional opening fence (exactly "```json\\n", "```JSON\\n" or "```\\n"), one
or more JSON values separated by whitespace (each an object or an array of objects), and
the fence's closing "```" if it was opened. Once the unit is complete it is judged as a
whole (argosy/chat/call_check.py): all calls, or all text.

Holdback (streaming): until then nothing of it is sent, since the first character of a call
must not reach the client as text. It is bounded, and short for anything that is not a call:
- a fence is decided within its 8 characters;
- a value whose first key is not a call key (`{"answer": ...}`, `[1, 2]`, `{Hello}`) is let
  go as soon as that key (or the character where one should be) is read;
- a value that reads like a call is held until it closes, but never past MAX_HELD_CHARS:
  beyond that it is text (failure "call_too_long"); one that breaks off (bad JSON, or the
  output ends inside it) is text too (failure "invalid_json"). 32 KiB is ~8k tokens, far beyond the
  calls a model makes of its own accord, so this bounds memory and delay, not real calls;
- after a complete value only whitespace is held (to see whether another value follows).
Only the first MAX_HELD_CHARS characters are ever looked at, so the outcome does not depend
on how the text was cut into deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from argosy.chat.call_check import BareCall, BareCallCheck, is_call_key, judge_calls
from argosy.chat.families.base import CallSyntax
from argosy.chat.families.json_call import CONSUMED, DONE, JSON_WHITESPACE, ValueScanner

FENCE_OPENERS = ("```json\n", "```JSON\n", "```\n")
FENCE_CLOSER = "```"
MAX_HELD_CHARS = 32 * 1024
STARTS = "{[`"  # the characters an answer may start with to be read as a possible bare call

_FENCE, _BEFORE_VALUE, _VALUE, _AFTER_VALUE = range(4)


@dataclass(frozen=True, slots=True)
class BareOutcome:
    """The unit decided: `calls`, or its raw `text` sent as content (with `failure` when it
    was a call that did not pass; `invalid_call` when it is one call that failed only its
    schema); `rest` is the input after it, for the parser to read on."""

    text: str
    calls: list[BareCall] | None
    failure: str | None
    rest: str
    invalid_call: BareCall | None = None


class BareCallReader:
    """Reads one unit from the start of an answer (its first character is one of STARTS).

    Invariant: `_text` is all input fed since the unit began; `_position` is how far it has
    been read; `_unit_end` is where the unit ends if it ended now (after the last complete
    value, or the closing fence); `_values` are the complete values' texts.
    """

    def __init__(self, syntax: CallSyntax, check: BareCallCheck) -> None:
        self._syntax = syntax
        self._check = check
        self._text = ""
        self._position = 0
        self._state = _BEFORE_VALUE
        self._is_fenced = False
        self._values: list[str] = []
        self._unit_end = 0
        self._value_start = 0
        self._scanner = ValueScanner()
        self._is_call_shaped: bool | None = None  # the current value's first key, once read

    def read(self, delta: str, *, is_final: bool) -> BareOutcome | None:
        """Read on; the outcome once the unit is decided, None while more input is needed."""
        self._text += delta
        if not self._values and self._position == 0 and self._text[:1] == "`":
            self._state = _FENCE
        text = self._text if len(self._text) <= MAX_HELD_CHARS else self._text[:MAX_HELD_CHARS]
        while True:
            outcome = self._step(text, is_final or len(text) == MAX_HELD_CHARS)
            if outcome is False:
                continue
            return outcome

    def _step(self, text: str, is_final: bool) -> BareOutcome | Literal[False] | None:
        """One step: False to step again, None for more input, or the outcome."""
        if self._state == _FENCE:
            return self._step_fence(text, is_final)
        if self._state == _VALUE:
            return self._step_value(text, is_final)
        position = self._position
        while position < len(text) and text[position] in JSON_WHITESPACE:
            position += 1
        self._position = position
        if position == len(text):
            if not is_final:
                return None
            return self._decide() if self._values else self._let_go(failure=None)
        rest = text[position:]
        if rest[0] in "{[":
            self._state, self._value_start = _VALUE, position
            self._scanner, self._is_call_shaped = ValueScanner(), None
            return False
        if self._state == _AFTER_VALUE and self._is_fenced:
            if rest.startswith(FENCE_CLOSER):
                self._position = self._unit_end = position + len(FENCE_CLOSER)
                return self._decide()
            if FENCE_CLOSER.startswith(rest) and not is_final:
                return None
        return self._decide() if self._values else self._let_go(failure=None)

    def _step_fence(self, text: str, is_final: bool) -> BareOutcome | Literal[False] | None:
        opener = next((o for o in FENCE_OPENERS if text.startswith(o)), None)
        if opener is not None:
            self._position = len(opener)
            self._state, self._is_fenced = _BEFORE_VALUE, True
            return False
        if not is_final and any(o.startswith(text) for o in FENCE_OPENERS):
            return None
        self._position = max(_common_prefix_length(text, o) for o in FENCE_OPENERS)
        return self._let_go(failure=None)

    def _step_value(self, text: str, is_final: bool) -> BareOutcome | Literal[False] | None:
        end, status = self._scanner.scan(text, self._position)
        self._position = end
        if self._is_call_shaped is None:
            verdict, told_at = _first_key_verdict(text[self._value_start : end], self._syntax)
            self._is_call_shaped = verdict
            if verdict is False:  # let go where that was told, however the text was cut
                self._position = self._value_start + told_at
        if status == DONE and self._is_call_shaped:
            self._values.append(text[self._value_start : end])
            self._state, self._unit_end = _AFTER_VALUE, end
            return False
        if status == CONSUMED and self._is_call_shaped is not False and not is_final:
            return None
        if self._values:  # this value is not a call: the unit is the values before it
            return self._decide()
        if not self._is_call_shaped:
            return self._let_go(failure=None)
        is_cut = status == CONSUMED and len(text) == MAX_HELD_CHARS
        return self._let_go(failure="call_too_long" if is_cut else "invalid_json")

    def _decide(self) -> BareOutcome:
        verdict = judge_calls(self._values, self._syntax, self._check)
        unit, rest = self._text[: self._unit_end], self._text[self._unit_end :]
        failure = verdict.failure if verdict.calls is None else None
        return BareOutcome(unit, verdict.calls, failure, rest, verdict.invalid_call)

    def _let_go(self, *, failure: str | None) -> BareOutcome:
        """Not a unit of calls: what was read is text; the parser reads on from there."""
        held, rest = self._text[: self._position], self._text[self._position :]
        return BareOutcome(held, None, failure, rest)


def _first_key_verdict(value: str, syntax: CallSyntax) -> tuple[bool | None, int]:
    """Whether a value's text so far starts like a call, `{` (or `[{`) then a call key, and
    where that was told (None while it cannot be told yet)."""
    position = 0
    if value[:1] == "[":
        position = _skip_whitespace(value, 1)
        if position == len(value):
            return None, position
        if value[position] != "{":
            return False, position
    position = _skip_whitespace(value, position + 1)
    if position == len(value):
        return None, position
    if value[position] != '"':
        return False, position
    end, status = ValueScanner().scan(value, position)
    if status == CONSUMED:
        return None, end
    try:
        key = json.loads(value[position:end])
    except ValueError:
        return False, end
    return isinstance(key, str) and is_call_key(key, syntax), end


def _common_prefix_length(text: str, other: str) -> int:
    length = 0
    while length < min(len(text), len(other)) and text[length] == other[length]:
        length += 1
    return length


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in JSON_WHITESPACE:
        position += 1
    return position
