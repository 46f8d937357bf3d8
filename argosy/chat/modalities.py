"""What a served model reads besides text, and why it refuses the rest: one table for both.

The chat models served here read text only: none is loaded with a vision or an audio encoder.
A message part of another medium is refused with a 400 naming the part (`messages[2].content[1]`)
in these words (argosy/api/openai/content.py, argosy/api/anthropic/wire.py, Ollama's `images`),
and /v1/models says the same of each model, per modality (`modality_support`).
"""

from __future__ import annotations

# medium -> why a text-only model refuses it
MEDIA_REASONS: dict[str, str] = {
    "image": "no vision encoder",
    "audio": "no audio encoder",
    "video": "no video encoder",
    "file": "no document reader",
}


def media_refusal(what: str, where: str, kind: str, medium: str) -> str:
    """The refusal of a part of `medium` (`what`: the client's words, "images")."""
    return f"This model does not accept {what} ('{where}' is {kind!r}): {MEDIA_REASONS[medium]}."


def modality_support(*media: str) -> dict[str, bool | str]:
    """Per modality: True where the model takes it (text, and `media`), else the reason why not."""
    support: dict[str, bool | str] = {"text": True}
    for medium, reason in MEDIA_REASONS.items():
        support[medium] = True if medium in media else reason
    return support
