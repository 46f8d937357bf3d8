"""Scheduler: decides which requests run this step and how many tokens each computes.

Each step has a token budget. Decodes (one token each) are placed first so a long prompt
never stalls them; prefill chunks share what is left. Admission and preemption follow
priority: QoS class first (interactive > background > inline), then arrival. When blocks
run out, the lowest-priority, newest running request is preempted: its blocks are freed
and it goes back to the waiting queue to be recomputed later (never failed).

A batch-invariant request runs in steps of its own (alternating with the others' steps),
without prefix-cache hits and is never chosen for preemption while others can go, so its
tokens equal those of a solo run on an idle engine.

Pooling sequences (embeddings) are prefill chunks like any other, batched with generation;
they never take a prefix-cache hit (every token's hidden state is pooled) and never carry a
draft.

Speculative decoding: with a proposer, a decode may carry a draft of k tokens (stored in
`seq.spec_token_ids`) and then computes 1 + k tokens, counted in the token budget; each
decode keeps at least its one token of budget, and a draft is dropped rather than preempt
anyone for its slots, and steps with more than `spec_max_decodes` decodes carry no drafts.
After the step only the last known token counts as computed
(`advance`); the engine adds the accepted draft tokens (`accept_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from argosy.engine.block_manager import BlockManager
from argosy.engine.sequence import Sequence, SequenceStatus


class Proposer(Protocol):
    def propose(self, seq: Sequence, limit: int) -> list[int]: ...


@dataclass(slots=True)
class ScheduledRequest:
    seq: Sequence
    num_new_tokens: int  # draft tokens included
    num_spec_tokens: int = 0  # the draft (seq.spec_token_ids) verified after the known tokens

    @property
    def is_last_chunk(self) -> bool:
        """True when this step computes the sequence's last known token."""
        return (
            self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == self.seq.num_tokens
        )

    @property
    def is_sampling(self) -> bool:
        """True when this step samples the sequence's next token (a pooling one never does)."""
        return self.is_last_chunk and self.seq.pooling is None

    @property
    def is_pooling(self) -> bool:
        """A pooling sequence's chunk: every row's hidden state is read."""
        return self.seq.pooling is not None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # K/V the runner copies before the step: (source block, target block, its first n slots),
    # a prompt's tokens found in part of a cached block (BlockManager.find_partial), in order
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _priority(seq: Sequence) -> tuple[int, int]:
    return (seq.qos_rank, seq.arrival)


def _preemption_order(seq: Sequence) -> tuple[bool, int, int]:
    """max() of this is preempted first: batch-invariant requests last (a recompute could
    change their numerics), then the lowest QoS class, then the newest."""
    return (not seq.params.batch_invariant, seq.qos_rank, seq.arrival)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        proposer: Proposer | None = None,
        spec_max_decodes: int = 4,
    ) -> None:
        self.block_manager = block_manager
        self.proposer = proposer
        self.spec_max_decodes = spec_max_decodes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        alone = self._next_invariant()
        if alone is not None:
            self._schedule_alone(alone, out)
            return out
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _next_invariant(self) -> Sequence | None:
        """The batch-invariant request whose turn it is to run alone, if any."""
        candidates = [s for s in self.running + self.waiting if s.params.batch_invariant]
        if not candidates:
            return None
        has_others = any(not s.params.batch_invariant for s in self.running + self.waiting)
        if has_others and self.num_steps % 2 == 0:
            return None
        return min(candidates, key=_priority)

    def _schedule_alone(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq.status is not SequenceStatus.RUNNING:
            num_new = min(seq.num_tokens, self.max_num_batched_tokens)
            while not self.block_manager.can_allocate(seq, num_new, []):
                others = [s for s in self.running if s.status is SequenceStatus.RUNNING]
                if not others:
                    return  # cannot fit even alone; retried next step
                self._preempt(max(others, key=_preemption_order), out)
            self.block_manager.allocate(seq, num_new, [])
            if seq.is_first_admission:
                seq.first_admitted()
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            num_new = min(seq.num_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)
            draft = self._draft(seq, self.max_num_batched_tokens - num_new)
            if not self._make_room(seq, num_new + len(draft), out):
                return
            self.block_manager.append_slots(seq, num_new + len(draft))
            seq.spec_token_ids = draft
            num_new += len(draft)
            out.scheduled.append(ScheduledRequest(seq, num_new, len(draft)))
            return
        out.scheduled.append(ScheduledRequest(seq, num_new))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=_priority)
        batchable = [s for s in self.running if not s.params.batch_invariant]
        decodes = [s for s in batchable if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in batchable if s.num_tokens - s.num_computed_tokens > 1]
        # beyond one token per decode: what drafts may take (none in a crowded step)
        spare = budget - len(decodes) if len(decodes) <= self.spec_max_decodes else 0
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._draft(seq, spare)
            if not self._make_room(seq, num_new + len(draft), out):
                continue
            self.block_manager.append_slots(seq, num_new + len(draft))
            seq.spec_token_ids = draft
            spare -= len(draft)
            num_new += len(draft)
            out.scheduled.append(ScheduledRequest(seq, num_new, len(draft)))
            budget -= num_new
        return budget

    def _draft(self, seq: Sequence, limit: int) -> list[int]:
        """A draft for a decoding sequence, when a proposer has one and its slots are free."""
        if self.proposer is None or limit <= 0 or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        if seq.pooling is not None:
            return []
        draft = self.proposer.propose(seq, limit)
        if draft and not self.block_manager.can_append(seq, 1 + len(draft)):
            return []  # never preempt anyone for a draft's slots
        return draft

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt running requests in `_preemption_order` (batch-invariant ones only when no
        other is left) until `seq` fits; False if `seq` itself had to go. Terminates: `seq` is
        running, so it is a candidate until it is chosen."""
        while not self.block_manager.can_append(seq, num_new):
            running = (s for s in self.running if s.status is SequenceStatus.RUNNING)
            victim = max(running, key=_preemption_order)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.append(seq)
        # drop it from this step's batch if it was already placed there
        out.scheduled = [r for r in out.scheduled if r.seq is not seq]
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=_priority)
        batchable = [s for s in self.waiting if not s.params.batch_invariant]
        while batchable and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = batchable[0]
            cached = self.block_manager.find_cached_prefix(seq) if seq.pooling is None else []
            partial = self.block_manager.find_partial(seq, len(cached)) if seq.pooling is None else None
            num_partial = partial[1] if partial is not None else 0
            num_cached_tokens = len(cached) * self.block_manager.block_size + num_partial
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_partial + num_new, cached):
                break
            self.block_manager.allocate(seq, num_partial + num_new, cached)
            if partial is not None:
                out.copies.append(self.block_manager.take_partial(seq, partial))
            if seq.is_first_admission:
                seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
                seq.first_admitted()
            batchable.pop(0)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledRequest(seq, num_new))
            budget -= num_new

    # -- after the step ------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed and publish newly full blocks."""
        for req in out.scheduled:
            req.seq.num_computed_tokens += req.num_new_tokens - req.num_spec_tokens
            self.block_manager.cache_full_blocks(req.seq)

    def accept_draft(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the KV of the first `num_accepted` draft tokens (now output
        tokens) is valid; the slots of rejected ones are rewritten later."""
        seq.spec_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
