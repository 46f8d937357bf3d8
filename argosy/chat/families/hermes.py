"""ChatML / Hermes tool calls (Qwen2.5, SmolLM2 with our own tool prompt, most ChatML models):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one call per block, blocks in a row for parallel calls. The fallback for any template.
"""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families.base import CallSyntax, ChatFamily

CALL_SYNTAX = CallSyntax(open_marker="<tool_call>", close_marker="</tool_call>")


def matches(chat_template: str, vocab: Container[str]) -> bool:
    return True


FAMILY = ChatFamily(name="hermes", reasoning_markers=None, call_syntax=CALL_SYNTAX, matches=matches)
