"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of calls,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

or (newer tokenizers) one call per marker: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`.
Mistral's templates accept only 9-character alphanumeric tool-call ids, so its calls get those.
"""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families.base import CallSyntax, ChatFamily, new_alphanumeric9_call_id

TOOL_CALLS = "[TOOL_CALLS]"

CALL_SYNTAX = CallSyntax(open_marker=TOOL_CALLS, is_array_allowed=True, args_marker="[ARGS]")


def matches(chat_template: str, vocab: Container[str]) -> bool:
    return TOOL_CALLS in chat_template or TOOL_CALLS in vocab


FAMILY = ChatFamily(
    name="mistral",
    reasoning_markers=None,
    call_syntax=CALL_SYNTAX,
    matches=matches,
    new_call_id=new_alphanumeric9_call_id,
)
