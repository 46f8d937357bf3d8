"""Message content parts, read once for every OpenAI route (chat messages, Responses input).

A content value is a string or a list of parts. Text parts join; a media part is refused
with a 400 naming the part (the served models are text-only); anything else — a part that is
not an object, a `type` that is not a string, a text part without a string `text` — is a
400 naming the part, never an exception of ours.
"""

from __future__ import annotations

from typing import Any

from argosy.chat.images import IMAGE_SENTINEL, ImagePart, image_from_url
from argosy.chat.modalities import media_refusal
from argosy.errors import InvalidRequestError

# part type -> (what a client sent, in the words of the refusal; its medium: why it is refused)
MEDIA_PARTS = {
    "image_url": ("images", "image"),
    "input_image": ("images", "image"),
    "input_audio": ("audio", "audio"),
    "file": ("files", "file"),
    "input_file": ("files", "file"),
    "video_url": ("video", "video"),
}


def part_type(part: Any) -> str | None:
    """A part's `type` when it is an object with a string type, else None."""
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if isinstance(kind, str) else None


def text_of_parts(
    value: list[Any],
    where: str,
    text_types: frozenset[str] = frozenset({"text"}),
    refusals: bool = False,
    images: list[ImagePart] | None = None,
) -> list[str]:
    """The texts of `value`'s parts, in order; `where` names the content (`messages[2].content`).
    With `images`, an image part (a data: URL) is read into it and stands as IMAGE_SENTINEL in
    the text (the model then says whether it reads images); without, it is refused."""
    texts: list[str] = []
    for position, part in enumerate(value):
        part_where = f"{where}[{position}]"
        kind = part_type(part)
        if kind in text_types and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image") and images is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(image_from_url(url, part_where))
            texts.append(IMAGE_SENTINEL)
        elif refusals and kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in MEDIA_PARTS:
            what, medium = MEDIA_PARTS[kind]
            raise InvalidRequestError(media_refusal(what, part_where, kind, medium), part_where)
        elif kind in text_types:
            raise InvalidRequestError(f"'{part_where}' is a text part without a string 'text'.", part_where)
        elif kind is None:
            raise InvalidRequestError(
                f"'{part_where}' must be an object with a string 'type'.", f"{part_where}.type"
            )
        else:
            raise InvalidRequestError(f"'{part_where}' has unsupported type {kind!r}.", f"{part_where}.type")
    return texts
