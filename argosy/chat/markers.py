"""Finding marker strings in text that arrives in pieces.

`find_first` finds the earliest marker in a text; `partial_marker_length` says how much of a
text's end could still become a marker (and so must be held back until more text comes).
`SpecialTextFilter` removes given strings (special tokens' text) from a stream of deltas,
holding back only what could be the start of one.
"""

from __future__ import annotations

from collections.abc import Iterable


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str | None]:
    """The earliest marker in `text` (the longest on a tie) and where it starts."""
    best_index, best = -1, None
    for marker in markers:
        index = text.find(marker)
        if index >= 0 and (best is None or (index, -len(marker)) < (best_index, -len(best))):
            best_index, best = index, marker
    return best_index, best


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """The longest end of `text` that is a proper prefix of a marker (to hold back)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest


class SpecialTextFilter:
    """Removes every occurrence of `texts` from text fed in deltas.

    Invariant: `_held` is the longest end of the input not yet emitted that is a proper prefix
    of one of `texts`; everything before it has been emitted with the texts removed.
    """

    __slots__ = ("_texts", "_held")

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = tuple(sorted({text for text in texts if text}, key=len, reverse=True))
        self._held = ""

    def feed(self, delta: str) -> str:
        if not self._texts:
            return delta
        text = self._held + delta
        out: list[str] = []
        while True:
            index, found = find_first(text, self._texts)
            if found is None:
                break
            out.append(text[:index])
            text = text[index + len(found) :]
        keep = partial_marker_length(text, self._texts)
        self._held = text[len(text) - keep :] if keep else ""
        out.append(text[: len(text) - keep])
        return "".join(out)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
