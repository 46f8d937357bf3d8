"""What one request asks of a channel parser (ParserOptions), and the parser's contract."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from argosy.chat.call_check import BareCallCheck
from argosy.chat.events import ChannelEvent


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
    `bare_calls`: markerless calls at the start of the answer are recognised (for families
    whose syntax says `is_bare_json_checked`) when they pass this check (argosy/chat/
    call_check.py); None: they are text (tool_choice "none", a response_format, a forced call).
    `call_schemas` (`auto` with tools): a marker call of a tool with a schema here is held
    until its JSON closes, then checked: arguments that are a JSON object the schema refuses
    make it no call. Such a call, like a markerless one that fails only its schema, comes back
    as its text with a ToolParseFailure "invalid_arguments"; with `can_repair_calls` it is
    handed to the core instead, as a ToolCallInvalid (argosy/core/tool_repair.py).
    """

    has_reasoning: bool = True
    has_tool_calls: bool = True
    tool_names: frozenset[str] | None = None
    can_call_in_parallel: bool = True
    is_reasoning_open: bool = False
    is_call_forced: bool = False
    bare_calls: BareCallCheck | None = field(default=None, hash=False)
    call_schemas: Mapping[str, dict[str, Any] | None] | None = field(default=None, hash=False)
    can_repair_calls: bool = False
