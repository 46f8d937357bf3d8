"""ChatML / Hermes tool calls (Qwen2.5, SmolLM2 with our own tool prompt, most ChatML models):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one call per block, blocks in a row for parallel calls. The fallback for any template.
Small models (Qwen2.5-Coder-0.5B: all 20 of its calls measured) often leave the markers out and answer
with the bare object, a list of them, or either in a ```json fence; such an answer is a call
when it passes the request's check (declared name, schema-valid and grounded arguments).
"""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families.base import CallSyntax, ChatFamily

CALL_SYNTAX = CallSyntax(open_marker="<tool_call>", close_marker="</tool_call>", is_bare_json_checked=True)


def matches(chat_template: str, vocab: Container[str]) -> bool:
    return True


FAMILY = ChatFamily(name="hermes", reasoning_markers=None, call_syntax=CALL_SYNTAX, matches=matches)
