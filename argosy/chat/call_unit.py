"""The parser's state as data: its mode, and one call attempt (Unit) with its raw text."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum

from argosy.chat.families.json_call import CallObjectReader


class Mode(IntEnum):  # IntEnum: hashed in C, looked up per step
    TEXT = 0
    REASONING = 1
    REGION = 2  # a call region is open: before a call's body
    OBJECT = 3  # inside a call's JSON
    NAME = 4  # Mistral `name[ARGS]`: reading the name
    AFTER_OBJECT = 5  # a call's JSON closed: separators, closing marker
    JUNK = 6  # text after a complete call, before its closing marker
    FAILED = 7  # a call that broke: its text runs to a marker or the end
    BARE = 8  # markerless JSON at the answer's start, held until judged (bare_call.py)


class Disposition(Enum):
    PENDING = "pending"  # name not known yet: the text is held
    CALL = "call"
    CONTENT = "content"
    DROPPED = "dropped"  # a call past the first with parallel calls off
    INVALID = "invalid"  # its arguments fail the schema: held for the core (a ToolCallInvalid)


@dataclass(slots=True)
class Unit:
    """One call attempt: all its raw text, and what it turned out to be."""

    raw_parts: list[str] = field(default_factory=list)
    is_candidate: bool = False  # a markerless `{` that may turn out to be plain text
    is_after_separator: bool = False
    disposition: Disposition = Disposition.PENDING
    call_index: int | None = None
    reason: str | None = None
    is_unterminated: bool = False
    reader: CallObjectReader | None = None
    name_parts: list[str] = field(default_factory=list)
    junk_parts: list[str] = field(default_factory=list)
    num_args_parts_sent: int = 0
    num_keys_checked: int = 0
    is_end_sent: bool = False
    start: int = 0  # where its raw text begins in the parser's input
    held_name: str | None = None  # a call held until its arguments are checked (not yet sent)
    arguments: str = ""  # INVALID: the arguments its schema refused
