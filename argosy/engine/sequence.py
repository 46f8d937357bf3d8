"""Sequence: one request's tokens and its place in the KV cache.

Invariants: `num_computed_tokens <= num_tokens`; the KV of tokens [0, num_computed_tokens)
lives in the blocks of `block_table`, in order; `block_hashes[i]` is the prefix-cache key
of block i once that block is full of computed tokens.

A pooling sequence (`pooling` set, e.g. "mean") is prefill-only: every one of its tokens is
computed (no prefix-cache hit skips one), nothing is sampled, and it finishes with its pooled
hidden state (`embedding`) once its last token is computed.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from argosy.engine.outputs import TokenLogprob
from argosy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from argosy.runner.structured import TokenGuide

QOS_RANK = {"interactive": 0, "background": 1, "inline": 2}  # lower rank = served first

_arrival_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class ImagePlacement:
    """An image's features (a VLM's vision encoder's, projected: [n, hidden] float32) and the
    first of the n prompt positions its image tokens hold; `digest` (of the image's content)
    keys the prefix cache's blocks that hold them: the same tokens with another image differ."""

    start: int
    embeds: torch.Tensor
    digest: bytes

    @property
    def stop(self) -> int:
        return self.start + int(self.embeds.shape[0])


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    qos: str = "interactive"
    guide: TokenGuide | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished "error"
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    # offsets into outputs already reported (the engine emits deltas)
    num_reported_tokens: int = 0
    is_prompt_logprobs_reported: bool = False
    is_first_admission: bool = True
    added_time: float = field(default_factory=time.perf_counter)  # when the engine took it
    queue_s: float | None = None  # added -> first scheduled (vLLM's queue time)
    # speculative decoding: the draft scheduled this step (verified after token num_tokens - 1),
    # the proposer's per-sequence state, and per-request totals
    spec_token_ids: list[int] = field(default_factory=list)
    spec_state: object | None = None
    num_spec_proposed: int = 0  # draft tokens verified
    num_spec_accepted: int = 0  # draft tokens accepted (and kept)
    pooling: str | None = None  # prefill-only: how its hidden states are pooled ("mean")
    embedding: list[float] | None = None  # a pooling sequence's vector, once finished
    lora_slot: int = -1  # the slot of its LoRA adapter (argosy/models/lora.py), -1: the base model
    cache_salt: bytes | None = None  # its prefix-cache keys' root (its adapter's: KV differs)
    images: list[ImagePlacement] = field(default_factory=list)  # a VLM prompt's images, in order

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def qos_rank(self) -> int:
        return QOS_RANK[self.qos]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """Still computing tokens it already has (prompt, or outputs after a preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def first_admitted(self) -> None:
        """Scheduled for the first time: its wait in the queue ends."""
        self.is_first_admission = False
        self.queue_s = time.perf_counter() - self.added_time

    def token_at(self, index: int) -> int:
        """Token `index`; past the known tokens, the draft being verified."""
        n = len(self.prompt_token_ids)
        if index < n:
            return self.prompt_token_ids[index]
        m = len(self.output_token_ids)
        return self.output_token_ids[index - n] if index - n < m else self.spec_token_ids[index - n - m]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
