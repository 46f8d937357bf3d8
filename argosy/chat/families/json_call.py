"""Reads one JSON tool-call object as it is generated, a chunk of text at a time.

`CallObjectReader.read(text)` answers how much of `text` it consumed and why it stopped:
CONSUMED (all of it; more is needed), PAUSE (a key or the name value just ended: look before
reading on), DONE (the object closed) or ERROR (the next character cannot continue it). Only
the top level is parsed (keys, and where each value begins and ends), so the call's name is
known as soon as its string closes and the arguments value's text is handed out as it grows;
nested values are only scanned for nesting, strings (with escapes) and the characters JSON
allows outside strings. A `</tool_call>` inside a string is string text; outside one, its `<`
is an ERROR. The complete text is validated with json.loads (`is_valid`). `ValueScanner`
finds where one JSON value ends (bare_call.py holds markerless calls with it).
"""

from __future__ import annotations

import json
import re
from typing import Literal

from argosy.chat.families.base import CallSyntax

CONSUMED, PAUSE, DONE, ERROR = 0, 1, 2, 3
_ENDED_BEFORE = 4  # a number or literal ended just before this character (not consumed)

JSON_WHITESPACE = " \t\r\n"
_SCALAR_CHARS = "0-9+\\-.eEtrufalsn"
_STRING_STOP = re.compile(r'["\\]')
_SCALAR_STOP = re.compile(f"[^{_SCALAR_CHARS}]")
_CONTAINER_STOP = re.compile(f"[^ \\t\\r\\n,:{_SCALAR_CHARS}]")  # brackets, quotes, anything not JSON
_SCALAR_START = re.compile(f"[{_SCALAR_CHARS}]")

ArgsKind = Literal["object", "string", "other"]

# Reader states.
_EXPECT_OPEN, _EXPECT_KEY_OR_CLOSE, _EXPECT_KEY, _KEY, _EXPECT_COLON = range(5)
_EXPECT_VALUE, _VALUE, _AFTER_VALUE, _CLOSED = range(5, 9)


class ValueScanner:
    """Finds where one JSON value ends: nesting depth, strings and escapes; nothing more."""

    __slots__ = ("_kind", "_depth", "_is_in_string", "_is_escaped")

    def __init__(self) -> None:
        self._kind = ""
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False

    def scan(self, text: str, position: int) -> tuple[int, int]:
        """Scan `text` from `position`: (end, status). CONSUMED: all of it (end == len(text));
        DONE: the value ended with text[end - 1]; _ENDED_BEFORE / ERROR: at text[end]."""
        size = len(text)
        while position < size:
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                    position += 1
                    continue
                match = _STRING_STOP.search(text, position)
                if match is None:
                    return size, CONSUMED
                position = match.start() + 1
                if text[position - 1] == "\\":
                    self._is_escaped = True
                    continue
                self._is_in_string = False
                if self._depth == 0:
                    return position, DONE
                continue
            if not self._kind:
                ch = text[position]
                if ch in "{[":
                    self._kind, self._depth = "container", 1
                elif ch == '"':
                    self._kind, self._is_in_string = "string", True
                elif _SCALAR_START.match(ch):
                    self._kind = "scalar"
                else:
                    return position, ERROR
                position += 1
                continue
            if self._kind == "scalar":
                match = _SCALAR_STOP.search(text, position)
                return (size, CONSUMED) if match is None else (match.start(), _ENDED_BEFORE)
            match = _CONTAINER_STOP.search(text, position)
            if match is None:
                return size, CONSUMED
            position = match.start()
            ch = text[position]
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return position + 1, DONE
            elif ch == '"':
                self._is_in_string = True
            else:
                return position, ERROR
            position += 1
        return size, CONSUMED


class CallObjectReader:
    """One call object `{"name": ..., "arguments": {...}}`, or with `is_args_only` just the
    arguments object (Mistral's `name[ARGS]{...}`).

    Public state, updated by `read`: `keys` (top-level keys so far), `is_name_seen` and `name`
    (None when the name value is not a string), `args_kind` and `args_parts` (the text of the
    first arguments value, as far as it has come).
    """

    __slots__ = (
        "_syntax",
        "_is_args_only",
        "_state",
        "_scanner",
        "_key",
        "_piece_parts",
        "_is_capturing_args",
        "raw_parts",
        "keys",
        "name",
        "is_name_seen",
        "args_kind",
        "args_parts",
    )

    def __init__(self, syntax: CallSyntax, *, is_args_only: bool = False) -> None:
        self._syntax = syntax
        self._is_args_only = is_args_only
        self._state = _EXPECT_VALUE if is_args_only else _EXPECT_OPEN
        self._scanner = ValueScanner()
        self._key: str | None = None
        self._piece_parts: list[str] = []  # the key or value being read
        self._is_capturing_args = is_args_only
        self.raw_parts: list[str] = []
        self.keys: list[str] = []
        self.name: str | None = None
        self.is_name_seen = False
        self.args_kind: ArgsKind | None = None
        self.args_parts: list[str] = []

    def is_valid(self) -> bool:
        """The text read so far is one complete JSON object (the arguments, if args only)."""
        text = "".join(self.args_parts if self._is_args_only else self.raw_parts)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return isinstance(value, dict)

    def read(self, text: str) -> tuple[int, int]:
        """Read on from `text`: (number of characters consumed, status)."""
        position, size = 0, len(text)
        while position < size:
            state = self._state
            if state in (_KEY, _VALUE):
                end, status = self._scanner.scan(text, position)
                self._append_piece(text[position:end])
                position = end
                if status == CONSUMED:
                    continue
                if status == ERROR:
                    return position, ERROR
                if state == _KEY:
                    self._end_key()
                    return position, PAUSE
                is_name = self._end_value()
                if self._is_args_only:
                    self._state = _CLOSED
                    return position, DONE
                if is_name:
                    return position, PAUSE
                continue  # DONE, or _ENDED_BEFORE: text[position] comes after the value
            ch = text[position]
            if state == _CLOSED:
                return position, ERROR
            if ch in JSON_WHITESPACE:
                pass
            elif state == _EXPECT_VALUE:
                if self._is_args_only and ch != "{":
                    return position, ERROR
                self._start_value(ch)
                continue
            elif state == _AFTER_VALUE:
                if ch == ",":
                    self._state = _EXPECT_KEY
                elif ch == "}":
                    self._state = _CLOSED
                else:
                    return position, ERROR
            elif state == _EXPECT_OPEN:
                if ch != "{":
                    return position, ERROR
                self._state = _EXPECT_KEY_OR_CLOSE
            elif state == _EXPECT_COLON:
                if ch != ":":
                    return position, ERROR
                self._state = _EXPECT_VALUE
            elif ch == '"':  # _EXPECT_KEY or _EXPECT_KEY_OR_CLOSE
                self._scanner = ValueScanner()
                self._piece_parts = []
                self._state = _KEY
                continue
            elif ch == "}" and state == _EXPECT_KEY_OR_CLOSE:
                self._state = _CLOSED
            else:
                return position, ERROR
            self.raw_parts.append(ch)
            position += 1
            if self._state == _CLOSED:
                return position, DONE
        return size, CONSUMED

    def _start_value(self, ch: str) -> None:
        self._scanner = ValueScanner()
        self._piece_parts = []
        if not self._is_args_only:
            self._is_capturing_args = self._key in self._syntax.args_keys and self.args_kind is None
        if self._is_capturing_args:
            self.args_kind = "object" if ch == "{" else "string" if ch == '"' else "other"
        self._state = _VALUE

    def _append_piece(self, piece: str) -> None:
        if piece:
            self._piece_parts.append(piece)
            self.raw_parts.append(piece)
            if self._state == _VALUE and self._is_capturing_args:
                self.args_parts.append(piece)

    def _end_key(self) -> None:
        raw_key = "".join(self._piece_parts)
        try:
            key = json.loads(raw_key)
        except ValueError:
            key = raw_key[1:-1]
        self._key = key
        self.keys.append(key)
        self._state = _EXPECT_COLON

    def _end_value(self) -> bool:
        """Close the value just read; True if it was the name."""
        self._state = _AFTER_VALUE
        self._is_capturing_args = False
        if self._key not in self._syntax.name_keys or self.is_name_seen:
            return False
        self.is_name_seen = True
        try:
            value = json.loads("".join(self._piece_parts))
        except ValueError:
            value = None
        self.name = value if isinstance(value, str) else None
        return True


def final_arguments(reader: CallObjectReader) -> tuple[str, str | None]:
    """(text still to send as arguments, failure reason) once the call object is complete.

    An object was streamed as it came (nothing left to send). No arguments, or `null`, is
    `{}`. A JSON string holding an object (some models write that) is sent decoded. Anything
    else is sent as written, with reason "bad_arguments".
    """
    raw = "".join(reader.args_parts)
    if reader.args_kind is None or raw == "null":
        return "{}", None
    if reader.args_kind == "object":
        return "", None
    if reader.args_kind == "string":
        try:
            decoded = json.loads(raw)
        except ValueError:
            return raw, "bad_arguments"
        try:
            value = json.loads(decoded)
        except ValueError:
            value = None
        return decoded, (None if isinstance(value, dict) else "bad_arguments")
    return raw, "bad_arguments"
