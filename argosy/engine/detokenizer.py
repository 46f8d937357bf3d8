"""Incremental, UTF-8 safe detokenization with stop strings; one instance per request.

Text is produced by `tokenizers.decoders.DecodeStream`, which decodes a short window of ids
and answers None while the window's text ends in an incomplete UTF-8 character, so a character
split over several tokens is emitted whole, once its last byte arrives. The stream is primed
with the tail of the prompt, so the first generated token decodes in context (a byte-level
merge, or the leading space a Metaspace decoder strips at the start of a text).

Stop strings are matched on that text with an Aho-Corasick automaton. Its state is the longest
suffix of the text so far that is a proper prefix of a stop string: exactly the text to hold
back, since a later token could complete it. Every token is matched on its own, in order, as
the engine would see them one per step: the first token whose text completes a stop ends the
output, cut before the earliest-starting stop it completed (on a tie, the shortest). Per token
the work is O(len(text of the token) + longest stop string), never O(text so far).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_NUM_CONTEXT_IDS = 6  # prompt / emitted ids kept as decoding context
_MAX_INCOMPLETE_IDS = 3  # a UTF-8 character has at most 3 bytes after its first one
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerStep:
    """What one `feed` produced.

    `text_delta` is safe to emit now. `stop_string` is the stop string that ended the output,
    if one did; then `num_tokens_consumed` counts the fed ids up to and including the one
    that completed it (the rest were not used), else it is the number of ids fed.
    """

    text_delta: str = ""
    stop_string: str | None = None
    num_tokens_consumed: int = 0


class _StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the text chunk by chunk.

    Invariant: `num_held_chars` is the length of the longest suffix of all text scanned so far
    that is a proper prefix of some stop string (no stop string has completed yet).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth: list[int] = [0]
        self._terminal: list[str | None] = [None]
        for stop_string in stop:
            node = 0
            for char in stop_string:
                child = self._goto[node].get(char)
                if child is None:
                    child = len(self._goto)
                    self._goto[node][char] = child
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._terminal.append(None)
                node = child
            self._terminal[node] = stop_string
        self._fail = [0] * len(self._goto)
        # The longest stop string that ends at each node: its own, or one reached by failure links.
        self._match: list[str | None] = list(self._terminal)
        self._build_failure_links()
        self._state = 0

    def _build_failure_links(self) -> None:
        queue = list(self._goto[0].values())
        for node in queue:  # breadth first: a node's failure target is shallower, already done
            for char, child in self._goto[node].items():
                target = self._fail[node]
                while target and char not in self._goto[target]:
                    target = self._fail[target]
                self._fail[child] = self._goto[target].get(char, 0) if node else 0
                if self._match[child] is None:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    @property
    def num_held_chars(self) -> int:
        return self._depth[self._state]

    def scan(self, chunk: str) -> tuple[int, str] | None:
        """Advance over `chunk`; return (start, stop string) of the earliest-starting stop
        completed inside it, `start` relative to the chunk (negative: it began in held text)."""
        goto, fail, depth, match = self._goto, self._fail, self._depth, self._match
        state = self._state
        best: tuple[int, str] | None = None
        for index, char in enumerate(chunk):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            stop_string = match[state]
            if stop_string is not None:
                start = index + 1 - len(stop_string)
                if best is None or start < best[0]:
                    best = (start, stop_string)
            # Any later match starts inside the live suffix; none can start before `best`.
            if best is not None and index + 1 - depth[state] >= best[0]:
                break
        self._state = state
        return best


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, stopping at stop strings.

    Invariants: `_held_text` (a possible stop-string start) and the text of `_unemitted_ids`
    (an incomplete UTF-8 character) are the only output not yet emitted; once finished
    (a stop string matched, or `flush` ran), nothing more is emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop_str_in_output = include_stop_str_in_output
        self._matcher = _StopMatcher(stop) if stop else None
        self._held_text = ""
        self._text_parts: list[str] = []
        self._stop_string: str | None = None
        self._is_finished = False
        # Ids already turned into text (context for re-decoding) and ids still awaiting text.
        self._context_ids: list[int] = []
        self._unemitted_ids: list[int] = []
        self._num_unemitted_generated_ids = 0
        self._stream = self._start_stream(list(prompt_token_ids[-_NUM_CONTEXT_IDS:]))

    @property
    def text(self) -> str:
        """All text emitted so far (deltas and flush)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_string

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def feed(self, token_ids: Sequence[int]) -> DetokenizerStep:
        """Decode newly generated ids; after a stop string (or flush) this returns an empty step."""
        if self._is_finished:
            return DetokenizerStep()
        deltas: list[str] = []
        for index, token_id in enumerate(token_ids):
            piece = self._decode_next(token_id)
            if not piece:
                continue
            delta, stop_string = self._match_stops(piece)
            if delta:
                deltas.append(delta)
            if stop_string is not None:
                self._finish(stop_string)
                return DetokenizerStep(self._emit(deltas), stop_string, index + 1)
        return DetokenizerStep(self._emit(deltas), None, len(token_ids))

    def flush(self) -> str:
        """End of generation: release held-back text, and an incomplete character as
        `tokenizer.decode` renders it (with U+FFFD). A stop string may still match in it."""
        if self._is_finished:
            return ""
        piece = (
            self._decode_after(self._context_ids, self._unemitted_ids)
            if self._num_unemitted_generated_ids
            else ""
        )
        delta, stop_string = self._match_stops(piece)
        if stop_string is None:
            delta += self._held_text
            self._held_text = ""
        self._finish(stop_string)
        return self._emit([delta])

    def _start_stream(self, context_ids: list[int]) -> DecodeStream:
        """A stream primed with `context_ids`. DecodeStream only takes a prefix whose text is
        complete, so trailing ids of an unfinished character are stepped in instead: the
        generated id that completes the character then emits it whole."""
        num_primed = len(context_ids)
        while (
            num_primed > 0
            and len(context_ids) - num_primed < _MAX_INCOMPLETE_IDS
            and self._decode(context_ids[:num_primed]).endswith(_REPLACEMENT_CHAR)
        ):
            num_primed -= 1
        if num_primed and self._decode(context_ids[:num_primed]).endswith(_REPLACEMENT_CHAR):
            num_primed = 0  # the text itself ends in U+FFFD: no prefix can be primed
            context_ids = []
        stream = DecodeStream(ids=context_ids[:num_primed], skip_special_tokens=self._skip_special_tokens)
        incomplete_ids = context_ids[num_primed:]
        if incomplete_ids:
            stream.step(self._tokenizer, incomplete_ids)  # None: its text is incomplete
        self._context_ids = context_ids[:num_primed]
        self._unemitted_ids = incomplete_ids
        return stream

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str | None:
        """Text completed by `token_id`, or None while a character is still incomplete."""
        self._unemitted_ids.append(token_id)
        self._num_unemitted_generated_ids += 1
        try:
            piece = self._stream.step(self._tokenizer, token_id)
        except Exception:  # tokenizers raises a bare Exception when a decoder rewrites its prefix
            return self._restart_stream()
        if piece is None:
            return None
        self._context_ids.extend(self._unemitted_ids)
        if len(self._context_ids) > 2 * _NUM_CONTEXT_IDS:
            del self._context_ids[:-_NUM_CONTEXT_IDS]
        self._unemitted_ids = []
        self._num_unemitted_generated_ids = 0
        return piece

    def _restart_stream(self) -> str:
        """The decoder rewrote text already emitted, which DecodeStream refuses: decode the
        awaiting ids ourselves, as far as their text is complete, and start a new stream there."""
        old_context_ids = self._context_ids
        all_ids = old_context_ids + self._unemitted_ids
        self._stream = self._start_stream(all_ids[-_NUM_CONTEXT_IDS:])
        num_incomplete_ids = len(self._unemitted_ids)
        self._num_unemitted_generated_ids = min(self._num_unemitted_generated_ids, num_incomplete_ids)
        return self._decode_after(
            old_context_ids, all_ids[len(old_context_ids) : len(all_ids) - num_incomplete_ids]
        )

    def _decode_after(self, context_ids: list[int], token_ids: list[int]) -> str:
        """Text of `token_ids` following `context_ids`, by `tokenizer.decode` (so an incomplete
        character comes out as U+FFFD). Cut by length: a decoder that rewrote the context's text
        cannot take back what was emitted."""
        if not token_ids:
            return ""
        num_context_chars = len(self._decode(context_ids))
        return self._decode(context_ids + token_ids)[num_context_chars:]

    def _match_stops(self, piece: str) -> tuple[str, str | None]:
        """Split held text + `piece` into (text safe to emit, stop string if one completed)."""
        if self._matcher is None:
            return piece, None
        if not piece:
            return "", None
        text = self._held_text + piece
        match = self._matcher.scan(piece)
        if match is not None:
            start, stop_string = match
            cut = len(self._held_text) + start
            if self._include_stop_str_in_output:
                cut += len(stop_string)
            self._held_text = ""
            return text[:cut], stop_string
        num_safe_chars = len(text) - self._matcher.num_held_chars
        self._held_text = text[num_safe_chars:]
        return text[:num_safe_chars], None

    def _finish(self, stop_string: str | None) -> None:
        self._is_finished = True
        self._stop_string = stop_string
        self._held_text = ""
        self._unemitted_ids = []

    def _emit(self, deltas: list[str]) -> str:
        delta = "".join(deltas)
        if delta:
            self._text_parts.append(delta)
        return delta
