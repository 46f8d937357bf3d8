"""Registry of chat families, chosen by name or detected from the chat template and vocab."""

from __future__ import annotations

from collections.abc import Container

from argosy.chat.families import hermes, llama3_json, mistral, qwen3
from argosy.chat.families.base import CallSyntax, ChatFamily

# Detection order: most specific first; hermes matches anything (the ChatML default).
_DETECTION_ORDER: tuple[ChatFamily, ...] = (mistral.FAMILY, llama3_json.FAMILY, qwen3.FAMILY, hermes.FAMILY)

FAMILIES: dict[str, ChatFamily] = {family.name: family for family in _DETECTION_ORDER}


def get_family(name: str) -> ChatFamily:
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown chat family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return family


def detect_family(chat_template: str | None, vocab: Container[str] = ()) -> ChatFamily:
    """The family whose markers the model's chat template (or vocab) mentions; hermes if none."""
    template = chat_template or ""
    for family in _DETECTION_ORDER:
        if family.matches(template, vocab):
            return family
    return hermes.FAMILY


__all__ = ["FAMILIES", "CallSyntax", "ChatFamily", "detect_family", "get_family"]
