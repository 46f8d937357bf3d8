"""One output channel's text, with the whitespace that touches a marker tidied."""

from __future__ import annotations

from argosy.chat.families.json_call import JSON_WHITESPACE as _WS


class Segment:
    """One channel's text, with whitespace at markers tidied.

    A marker (reasoning start or end, a call) is treated as not there: whitespace before it is
    held, whitespace after it is dropped when whitespace was held before it, and what is held
    is sent only once text follows. So text never starts or ends with whitespace that touches
    a marker, and "Sure. <call> Done." reads "Sure. Done.". Text touching no marker is left
    exactly as generated. Invariant: `_pending` is the held trailing whitespace.
    """

    __slots__ = ("_has_text", "_pending", "_is_at_marker", "_is_dropping_whitespace")

    def __init__(self, *, is_at_marker: bool) -> None:
        self._has_text = False
        self._pending = ""
        self._is_at_marker = is_at_marker  # no text since the last marker
        self._is_dropping_whitespace = is_at_marker  # drop whitespace that follows it

    def push(self, text: str) -> str:
        if self._is_dropping_whitespace:
            text = text.lstrip(_WS)
        if not text:
            return ""
        text = self._pending + text
        body = text.rstrip(_WS)
        self._pending = text[len(body) :]
        if body:
            self._has_text = True
            self._is_at_marker = self._is_dropping_whitespace = False
        return body

    def touch_marker(self) -> None:
        self._is_at_marker = True
        self._is_dropping_whitespace = bool(self._pending) or not self._has_text
        if not self._has_text:
            self._pending = ""

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self._is_at_marker else pending
