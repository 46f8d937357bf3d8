"""Llama 3.x JSON tool calls: the output is the call (or `<|python_tag|>` then the call),

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several joined by `;`. A bare `{` is a call only where it opens the output and only once its
first keys read like a call (name / parameters / arguments / type); else it is plain text.
"""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families.base import CallSyntax, ChatFamily

PYTHON_TAG = "<|python_tag|>"

CALL_SYNTAX = CallSyntax(
    open_marker=PYTHON_TAG, separator=";", is_bare_json_at_start=True, args_key="parameters"
)


def matches(chat_template: str, vocab: Container[str]) -> bool:
    if PYTHON_TAG in chat_template or PYTHON_TAG in vocab:
        return True
    return "<|start_header_id|>" in chat_template and '"parameters"' in chat_template


FAMILY = ChatFamily(name="llama3_json", reasoning_markers=None, call_syntax=CALL_SYNTAX, matches=matches)
