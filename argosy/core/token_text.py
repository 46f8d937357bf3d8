"""Token ids -> their exact bytes and display text, for logprobs.

`tokenizer.decode([id])` cannot say what a single token is: a byte-level token holding half
a UTF-8 character decodes to U+FFFD, and a SentencePiece decoder strips the leading space
of a text's first token. So the bytes come from the vocabulary itself, by the decoder's own
rules: GPT-2 byte-level (each vocabulary character stands for one byte), SentencePiece
(`▁` is a space, `<0xNN>` is one byte), anything else through `decode`. Added tokens
(specials included) are their literal content.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: vocabulary character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        kinds: set[str] = set()
        for part in decoder.get("decoders", []):
            kinds |= _decoder_kinds(part)
        return kinds
    kind = decoder.get("type")
    if kind == "Replace" and decoder.get("pattern", {}).get("String") == "▁":
        return {"Metaspace"}
    return {kind} if isinstance(kind, str) else set()


class TokenTexts:
    """Per-tokenizer, cached: `bytes_of(id)` exact bytes, `text_of(id)` their UTF-8 text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # the decoder's own JSON: the whole tokenizer's (to_str) is ~1 s to write and read for
        # Gemma's 262k-token vocabulary, at every model load
        decoder = tokenizer.decoder
        kinds = _decoder_kinds(None if decoder is None else json.loads(decoder.__getstate__()))
        self._is_byte_level = "ByteLevel" in kinds
        self._is_metaspace = "Metaspace" in kinds
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute_bytes(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._is_byte_level:
            table = _byte_level_decoding()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        if self._is_metaspace:
            match = _BYTE_TOKEN.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
