"""The fixed contract of a chat family: its channel markers and its tool-call syntax.

A family is plain data read by argosy/chat/parsing.py; adding one is a new module in this
package with a `FAMILY` and an entry in the registry (families/__init__.py).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Container
from dataclasses import dataclass

_ALPHANUMERIC = string.ascii_letters + string.digits


def new_openai_call_id() -> str:
    """`call_` + 24 random letters and digits, the shape OpenAI clients expect."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def new_alphanumeric9_call_id() -> str:
    """9 random letters and digits: Mistral's templates refuse any other tool-call id."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a family writes tool calls.

    A call region opens at `open_marker` (or, with `is_bare_json_at_start`, at a `{` that
    begins the output) and holds call objects `{"<name key>": ..., "<args key>": {...}}`:
    one per region when `close_marker` is set (it ends the region), else several joined by
    `separator` or, with `is_array_allowed`, written as one JSON array. With `args_marker`
    a call may also be written `name<args_marker>{...}` right after the open marker.
    `args_key` is the arguments key the family itself writes (a forced call's grammar uses it).
    With `is_bare_json_checked` a call written without markers where the answer starts (bare
    JSON objects, a list of them, or either in a ```json fence) is held until it closes and is
    a call only if it passes the request's check (argosy/chat/bare_call.py, call_check.py).
    """

    open_marker: str | None
    close_marker: str | None = None
    separator: str | None = None
    is_array_allowed: bool = False
    is_bare_json_at_start: bool = False
    is_bare_json_checked: bool = False
    args_marker: str | None = None
    name_keys: tuple[str, ...] = ("name",)
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    args_key: str = "arguments"

    def call_opening(self, name: str, *, is_marked: bool) -> str:
        """A call of `name` written up to its arguments value, as this family writes one
        (`is_marked`: with its opening marker; else the bare object's start)."""
        marker = self.open_marker if is_marked and self.open_marker else ""
        if marker and self.args_marker:
            return f"{marker}{name}{self.args_marker}"
        newline = "\n" if marker and self.close_marker else ""
        return f'{marker}{newline}{{"{self.name_keys[0]}": {json.dumps(name)}, "{self.args_key}": '


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """One model family: reasoning markers (start, end) if it reasons, its call syntax, the
    call ids its templates accept, and `matches(chat_template, vocab)` for detection."""

    name: str
    reasoning_markers: tuple[str, str] | None
    call_syntax: CallSyntax
    matches: Callable[[str, Container[str]], bool]
    new_call_id: Callable[[], str] = new_openai_call_id

    @property
    def marker_strings(self) -> tuple[str, ...]:
        """Every marker the parser reads: the detokenizer must keep these tokens in the text."""
        syntax = self.call_syntax
        markers = (
            *(self.reasoning_markers or ()),
            syntax.open_marker,
            syntax.close_marker,
            syntax.args_marker,
        )
        return tuple(marker for marker in markers if marker)
