"""Qwen3 (and other ChatML reasoners): `<think>…</think>` reasoning first, then text and
Hermes `<tool_call>` blocks. With `enable_thinking` some templates open `<think>` in the
generation prompt; the output then starts inside reasoning (ParserOptions.is_reasoning_open).
"""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families.base import ChatFamily
from argosy.chat.families.hermes import CALL_SYNTAX

THINK_START = "<think>"
THINK_END = "</think>"


def matches(chat_template: str, vocab: Container[str]) -> bool:
    return THINK_START in chat_template or THINK_END in chat_template or THINK_START in vocab


FAMILY = ChatFamily(
    name="qwen3",
    reasoning_markers=(THINK_START, THINK_END),
    call_syntax=CALL_SYNTAX,
    matches=matches,
)
