"""MeanPooler: a pooling sequence's hidden states, summed chunk by chunk, into one vector.

A pooling request (an embedding from a chat model) is prefilled like any prompt, possibly in
several chunks over several steps, batched with other requests. Each step hands the pooler the
rows of its chunk (the last norm's output, `DecoderForCausalLM.forward`); they are added, in
float32, to the request's running sum. When the chunk that ends the input comes, the vector is
the sum over the token count (the mean over every input token, special tokens included), L2
normalised in float32: what transformers gives as `last_hidden_state.mean(1)` then normalised.

Invariant: a chunk starting at token 0 starts a fresh sum, so a request that was preempted
(its KV freed, recomputed from its first token) is pooled exactly once per token.

The other pooling, `logits:ID,ID,...`, reads the logits of those tokens at the input's last
position (an LLM reranker's "no" and "yes", core/judge_scorer.py): the model runner computes
them from the last chunk's last row; no state is kept between chunks.
"""

from __future__ import annotations

import torch

POOLING_METHODS = ("mean", "logits")
LOGITS_POOLING = "logits"


def pooling_token_ids(pooling: str) -> list[int] | None:
    """The token ids of a `logits:ID,ID,...` pooling (None for another method); ValueError
    when the ids are missing or not integers."""
    method, _, ids = pooling.partition(":")
    if method != LOGITS_POOLING:
        return None
    token_ids = [int(token) for token in ids.split(",")] if ids else []
    if not token_ids:
        raise ValueError("a logits pooling names its token ids: logits:ID,ID,...")
    return token_ids


class MeanPooler:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """`rows` [n, hidden]: the hidden states of the request's tokens [start, start + n)."""
        chunk = rows.float().sum(dim=0)
        running = None if start == 0 else self._sums.get(request_id)
        self._sums[request_id] = chunk if running is None else running + chunk

    def finish(self, request_id: str, num_tokens: int) -> list[float] | None:
        """The request's mean-pooled, L2-normalised vector (None: not finite) and forget it."""
        total = self._sums.pop(request_id)
        mean = (total / num_tokens).cpu()
        if not bool(torch.isfinite(mean).all()):
            return None
        vector: list[float] = torch.nn.functional.normalize(mean, dim=0).tolist()
        return vector

    def release(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sums)
