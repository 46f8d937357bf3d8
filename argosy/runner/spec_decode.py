"""Speculative decoding: a proposer drafts tokens, the target model verifies them in one pass.

Flow of one step for a decoding sequence with a draft d_1..d_k (the scheduler asks the
proposer, and schedules 1 + k tokens: the last known token, then the draft):

- The model runs the 1 + k tokens as one chunk against the paged cache and yields logits at
  every position; position j gives the target's distribution for the token after d_j.
- `verify_batch` applies the request's own logit processing (penalties counting d_1..d_j as
  output tokens, logit_bias) and accepts a prefix of the draft:
  temperature 0: d_j is accepted while it equals the argmax; the first mismatch emits the
  argmax instead. temperature > 0: rejection sampling with a deterministic draft (draft
  distribution one-hot on d_j): accept d_j with probability p_j(d_j), where p_j is the target
  distribution after temperature / top-k / top-p / min-p; on rejection emit a sample of p_j
  with d_j removed and renormalised. Every emitted token is then distributed exactly as in
  non-speculative decoding. If all k are accepted, the last position gives one more token.
- The engine appends the emitted tokens one by one through its usual stop checks, so EOS,
  stop token ids and max_tokens cut the run where plain decoding would stop. Only the KV of
  the accepted tokens counts as computed; slots written for rejected drafts lie beyond
  `num_computed_tokens`, so their blocks are neither published to the prefix cache nor
  read before the next step overwrites them.

Proposers: `NgramProposer` (prompt lookup). A draft-model proposer would plug in behind
the same `propose(seq, limit)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from argosy.engine.outputs import TokenLogprob
from argosy.engine.sequence import Sequence
from argosy.runner.sampler import TOPK_FAST_LIMIT, Sampler, SamplingRow, make_logprob


def can_speculate(seq: Sequence) -> bool:
    """Requests that never get a draft: grammar-guided ones (the guide's matcher state would
    have to be rolled back past rejected tokens)."""
    return seq.guide is None


# -- proposers ------------------------------------------------------------------------------


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


class NgramProposer:
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

    def room(self, seq: Sequence) -> int:
        """Most draft tokens worth verifying: the emitted tokens must fit max_tokens (one of them
        is the target's own) and every verified position must fit the context."""
        room = min(self.k, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        limit = min(limit, self.room(seq))
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
        stop = start + len(draft) + 1
        block, row = logits[start:stop], rows[start]
        if seq.params.is_greedy:
            token_ids, num_accepted = greedy_verify(block.argmax(dim=-1).tolist(), draft)
        else:
            probs = target_probs(sampler, block, rows[start:stop])
            generator = row.generator if row.generator is not None else sampler.generator
            token_ids, num_accepted = rejection_sample(probs, draft, generator)
        logprobs = None
        if seq.params.logprobs is not None:
            assert raw_logprobs is not None
            num_top = seq.params.logprobs or 0
            logprobs = [make_logprob(raw_logprobs[start + j], t, num_top) for j, t in enumerate(token_ids)]
        results.append(Verified(token_ids, logprobs, num_accepted))
        start = stop
    return results


def greedy_verify(targets: list[int], draft: list[int]) -> tuple[list[int], int]:
    """targets[j]: the argmax after draft[:j]. Accept while the draft agrees, then the target's."""
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return draft[:num_accepted] + [targets[num_accepted]], num_accepted


def rejection_sample(
    probs: torch.Tensor, draft: list[int], generator: torch.Generator
) -> tuple[list[int], int]:
    """probs: [len(draft) + 1, V], each row a normalised target distribution. The draft
    distribution is one-hot, so draft[j] is accepted with probability probs[j, draft[j]];
    a rejection emits a sample of probs[j] without draft[j]."""
    emitted: list[int] = []
    for j, token in enumerate(draft):
        p = float(probs[j, token])
        if float(torch.rand((), generator=generator)) < p:
            emitted.append(token)
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p was 1 up to rounding: nothing else to emit
            emitted.append(token)
            continue
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted, j
    emitted.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return emitted, len(draft)


def target_probs(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution the sampler draws from, per row, over the whole vocabulary: processed
    logits -> top-k -> temperature -> top-p -> min-p, renormalised. Rows share one request's
    parameters."""
    top_k = rows[0].params.top_k
    if 0 < top_k <= TOPK_FAST_LIMIT:
        values, indices = logits.topk(min(top_k, logits.shape[1]), dim=-1)
    else:
        values, indices = logits.sort(dim=-1, descending=True)
        if top_k > 0:
            values[:, top_k:] = float("-inf")
    probs = sampler.truncate(values, rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter_(1, indices, probs)
