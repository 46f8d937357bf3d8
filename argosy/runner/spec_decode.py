"""Speculative decoding: a proposer drafts tokens, the target model verifies them in one pass.

Flow of one step for a decoding sequence with a draft d_1..d_k (the scheduler asks the
proposer, and schedules 1 + k tokens: the last known token, then the draft):

- The model runs the 1 + k tokens as 1 + k decode rows of the same sequence (row j attends
  to the context up to itself; every row's K/V is written before attention), so each
  position is computed exactly as plain decoding computes it: measured on SmolLM2 in bf16,
  a prefill-style chunk (SDPA) drifted from plain greedy text after ~30-200 tokens, decode
  rows gave identical text. Logits at every position; position j gives the target's
  distribution for the token after d_j.
- `verify_batch` applies the request's own logit processing (penalties counting d_1..d_j as
  output tokens, logit_bias) and accepts a prefix of the draft:
  temperature 0: d_j is accepted while it equals the argmax; the first mismatch emits the
  argmax instead. temperature > 0: rejection sampling with a deterministic draft (draft
  distribution one-hot on d_j), in its coupled form: draw the target's token t_j from p_j
  (the distribution after temperature / top-k / top-p / min-p) with the sampler's own noise,
  accept d_j iff t_j == d_j (probability p_j(d_j)), else emit t_j (distributed as p_j
  without d_j, renormalised). Every emitted token is distributed exactly as in plain
  decoding, and since one draw is made per emitted token, from the request's own generator,
  a seeded request gives the same tokens with or without speculation.
  If all k are accepted, the last position gives one more token.
- The engine appends the emitted tokens one by one through its usual stop checks, so EOS,
  stop token ids and max_tokens cut the run where plain decoding would stop. Only the KV of
  the accepted tokens counts as computed; slots written for rejected drafts lie beyond
  `num_computed_tokens`, so their blocks are neither published to the prefix cache nor
  read before the next step overwrites them.

Proposers: `NgramProposer` (prompt lookup) and, behind the same `propose(seq, limit)`, a
draft model (argosy/runner/draft_model.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from argosy.engine.outputs import TokenLogprob
from argosy.engine.sequence import Sequence
from argosy.runner.sampler import Sampler, SamplingRow, first_argmax, make_logprob

if TYPE_CHECKING:
    from argosy.engine.scheduler import ScheduledRequest


def can_speculate(seq: Sequence) -> bool:
    """Requests that never get a draft: grammar-guided ones (the guide's matcher state would
    have to be rolled back past rejected tokens)."""
    return seq.guide is None


# -- proposers ------------------------------------------------------------------------------


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """Most draft tokens worth verifying: the emitted tokens must fit max_tokens (one of them is
    the target's own) and every verified position must fit the context."""
    room = min(k, max_model_len - seq.num_tokens)
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
    return room


class _TokenBuffer:
    """A growing int64 copy of prompt + output, extended incrementally each step."""

    __slots__ = ("array", "length")

    def __init__(self, capacity: int) -> None:
        self.array = np.empty(max(64, capacity), dtype=np.int64)
        self.length = 0

    def sync(self, seq: Sequence) -> np.ndarray:
        n = seq.num_tokens
        if n < self.length:  # never expected (tokens only grow); rebuild to be safe
            self.length = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if self.length < n:
            p = seq.num_prompt_tokens
            if self.length < p:
                self.array[self.length : p] = seq.prompt_token_ids[self.length :]
                self.length = p
            self.array[self.length : n] = seq.output_token_ids[self.length - p :]
            self.length = n
        return self.array[:n]


class StatelessProposer:
    """The engine's hooks for a proposer with state of its own (a draft model: draft_model.py),
    which one without any leaves alone: after each step, when a request leaves, at close."""

    def follow(self, scheduled: list[ScheduledRequest]) -> None:
        """The step computed these requests' tokens."""

    def release(self, request_id: str) -> None:
        """The request left the engine."""

    def stop_compiling(self, timeout: float = 0.0) -> None:
        """The engine is closing."""

    def compiling(self) -> bool:
        """Whether graphs of the proposer's own are being compiled now."""
        return False


class NgramProposer(StatelessProposer):
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from ngram_max down to ngram_min) in prompt + output, and draft the tokens that followed
    it. numpy over a per-sequence token buffer: one vectorised compare per n-gram token."""

    def __init__(
        self, num_speculative_tokens: int, ngram_min: int, ngram_max: int, max_model_len: int
    ) -> None:
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_model_len = max_model_len

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        limit = min(limit, draft_room(seq, self.k, self.max_model_len))
        if limit <= 0 or not can_speculate(seq):
            return []
        buffer = seq.spec_state
        if not isinstance(buffer, _TokenBuffer):
            buffer = _TokenBuffer(seq.num_tokens + 256)
            seq.spec_state = buffer
        return find_draft(buffer.sync(seq), self.ngram_min, self.ngram_max, limit)


def find_draft(tokens: np.ndarray, ngram_min: int, ngram_max: int, limit: int) -> list[int]:
    """The up to `limit` tokens after the most recent earlier occurrence of the longest
    suffix n-gram (ngram_max >= n >= ngram_min) of `tokens`; [] when none occurs."""
    length = tokens.shape[0]
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = tokens[length - n :]
        # candidate starts i in [0, length - n - 1]: the occurrence is followed by a token
        starts = np.flatnonzero(tokens[n - 1 : length - 1] == pattern[n - 1])
        for offset in range(n - 1):
            if not starts.size:
                break
            starts = starts[tokens[starts + offset] == pattern[offset]]
        if starts.size:
            begin = int(starts[-1]) + n
            draft: list[int] = tokens[begin : min(begin + limit, length)].tolist()
            return draft
    return []


# -- verification ---------------------------------------------------------------------------


@dataclass(slots=True)
class Verified:
    token_ids: list[int]  # accepted draft tokens, then the target's own token
    logprobs: list[TokenLogprob] | None
    num_accepted: int


def verify_batch(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: list[tuple[Sequence, list[int]]],
    row_for: Callable[[Sequence], SamplingRow],
) -> list[Verified]:
    """logits: [sum(1 + len(draft)), V] float32 on the host, raw, the rows of each request's
    chunk in order (modified in place). Returns one Verified per request."""
    logits = logits[:, : sampler.vocab_size]
    rows: list[SamplingRow] = []
    for seq, draft in requests:
        base = row_for(seq)
        for j in range(len(draft) + 1):
            outputs = base.output_token_ids + draft[:j] if j else base.output_token_ids
            rows.append(replace(base, output_token_ids=outputs))
    want_logprobs = any(seq.params.logprobs is not None for seq, _ in requests)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    sampler.process_logits(logits, rows)
    results: list[Verified] = []
    start = 0
    for seq, draft in requests:
        if seq.params.is_greedy:
            targets: list[int] = first_argmax(logits[start : start + len(draft) + 1]).tolist()
            token_ids, num_accepted = walk_draft(targets.__getitem__, draft)
        else:
            block, block_rows = logits[start:], rows[start:]
            token_ids, num_accepted = walk_draft(
                lambda j, b=block, r=block_rows: sampler.sample_row(b[j], r[j]),  # type: ignore[misc]
                draft,
            )
        logprobs = None
        if seq.params.logprobs is not None:
            assert raw_logprobs is not None
            num_top = seq.params.logprobs or 0
            logprobs = [make_logprob(raw_logprobs[start + j], t, num_top) for j, t in enumerate(token_ids)]
        results.append(Verified(token_ids, logprobs, num_accepted))
        start += len(draft) + 1
    return results


def walk_draft(sample: Callable[[int], int], draft: list[int]) -> tuple[list[int], int]:
    """Emit the target's token at positions 0, 1, ... while it equals the draft token there.

    `sample(j)` is the target's token at position j given draft[:j] (the argmax for greedy,
    a draw from the processed distribution p_j otherwise), called only for positions reached,
    so a seeded request makes one draw per emitted token, exactly as without speculation.
    For a sampled request this is rejection sampling with a one-hot draft: draft[j] is
    accepted with probability p_j(draft[j]), and a rejection emits a token distributed as p_j
    without draft[j], renormalised (the draw, given that it differs from the draft)."""
    emitted: list[int] = []
    for j in range(len(draft) + 1):
        token = sample(j)
        emitted.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return emitted, len(emitted) - 1
