"""Scheduler with real Sequences and a real BlockManager (no model).

A stand-in for the engine's update step (`run_step`) appends token 7 to every sequence that
sampled and finishes it at max_tokens; the scheduler's decisions are pinned exactly as
(request_id, num_new_tokens) lists per step.
"""

from __future__ import annotations

import time

import pytest

from argosy.engine.block_manager import BlockManager
from argosy.engine.scheduler import Scheduler, SchedulerOutput
from argosy.engine.sequence import Sequence, SequenceStatus
from argosy.sampling_params import SamplingParams

BS = 4


def make_seq(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 8,
    qos: str = "interactive",
    *,
    batch_invariant: bool = False,
) -> Sequence:
    # distinct token ids per request so prefix caching never links them
    base = 1000 * (1 + sum(map(ord, request_id)))
    tokens = list(range(base, base + num_prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, detokenize=False, batch_invariant=batch_invariant)
    return Sequence(request_id, tokens, params, qos=qos)


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampling = [r.seq for r in out.scheduled if r.is_sampling]
    sched.advance(out)
    for seq in sampling:
        seq.output_token_ids.append(7)
        assert seq.params.max_tokens is not None
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.seq.request_id, r.num_new_tokens) for r in out.scheduled]


def test_continuous_batching_new_request_joins_and_finished_leave() -> None:
    sched = make_scheduler()
    a, b = make_seq("a", 10, max_tokens=5), make_seq("b", 6, max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [("a", 10), ("b", 6)]
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]
    assert b.is_finished and b.finish_reason == "length"
    assert b.block_table == []
    assert sched.running == [a]
    c = make_seq("c", 8, max_tokens=3)
    sched.add(c)
    assert plan(run_step(sched)) == [("a", 1), ("c", 8)]  # c joins while a decodes
    assert plan(run_step(sched)) == [("a", 1), ("c", 1)]
    assert plan(run_step(sched)) == [("a", 1), ("c", 1)]
    assert a.is_finished and c.is_finished
    assert a.output_token_ids == [7] * 5 and c.output_token_ids == [7] * 3
    assert not sched.has_unfinished()
    assert sched.schedule().is_empty
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_keeps_decodes_first_and_respects_the_budget() -> None:
    sched = make_scheduler(budget=16)
    d1, d2 = make_seq("d1", 3, max_tokens=20), make_seq("d2", 5, max_tokens=20)
    sched.add(d1)
    sched.add(d2)
    assert plan(run_step(sched)) == [("d1", 3), ("d2", 5)]
    long = make_seq("long", 40, max_tokens=2)
    sched.add(long)
    steps, samplers = [], []
    for _ in range(5):
        out = sched.schedule()
        steps.append(plan(out))
        samplers.append([r.seq.request_id for r in out.scheduled if r.is_sampling])
        assert out.num_batched_tokens <= 16
        sched.advance(out)
        for seq in samplers[-1]:
            next(s for s in sched.running if s.request_id == seq).output_token_ids.append(7)
    assert steps == [
        [("d1", 1), ("d2", 1), ("long", 14)],
        [("d1", 1), ("d2", 1), ("long", 14)],
        [("d1", 1), ("d2", 1), ("long", 12)],  # the last chunk samples long's first token
        [("d1", 1), ("d2", 1), ("long", 1)],
        [("d1", 1), ("d2", 1), ("long", 1)],
    ]
    assert samplers == [
        ["d1", "d2"],
        ["d1", "d2"],
        ["d1", "d2", "long"],
        ["d1", "d2", "long"],
        ["d1", "d2", "long"],
    ]
    assert long.num_output_tokens == 3


def test_a_long_prompt_alone_is_split_into_budget_sized_chunks() -> None:
    sched = make_scheduler(budget=16)
    seq = make_seq("p", 50, max_tokens=1)
    sched.add(seq)
    chunks = []
    while sched.has_unfinished():
        out = run_step(sched)
        chunks.append(plan(out))
    assert chunks == [[("p", 16)], [("p", 16)], [("p", 16)], [("p", 2)]]
    assert seq.output_token_ids == [7]


def test_waiting_prompts_share_what_the_budget_leaves() -> None:
    sched = make_scheduler(budget=20)
    for name in ("x", "y", "z"):
        sched.add(make_seq(name, 12, max_tokens=4))
    assert plan(run_step(sched)) == [("x", 12), ("y", 8)]
    assert plan(run_step(sched)) == [("x", 1), ("y", 4), ("z", 12)]
    assert plan(run_step(sched)) == [("x", 1), ("y", 1), ("z", 1)]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    first, second, third = make_seq("s1", 4, 2), make_seq("s2", 4, 3), make_seq("s3", 4, 1)
    for seq in (first, second, third):
        sched.add(seq)
    assert plan(run_step(sched)) == [("s1", 4), ("s2", 4)]
    assert sched.waiting == [third]
    assert plan(run_step(sched)) == [("s1", 1), ("s2", 1)]  # s1 finishes here
    assert plan(run_step(sched)) == [("s2", 1), ("s3", 4)]
    assert first.is_finished and second.is_finished and third.is_finished


def test_the_queue_time_is_taken_at_first_admission_and_kept_through_a_preemption() -> None:
    sched = make_scheduler(max_num_seqs=1)
    first, second = make_seq("q1", 4, 2), make_seq("q2", 4, 1)
    first.added_time = second.added_time = time.perf_counter() - 5.0  # both waited 5 s already
    sched.add(first)
    sched.add(second)
    run_step(sched)
    assert first.queue_s is not None and 5.0 <= first.queue_s < 6.0
    assert second.queue_s is None  # still waiting behind it
    run_step(sched)  # first finishes
    run_step(sched)
    assert second.queue_s is not None and second.queue_s >= first.queue_s
    sched.add(again := make_seq("q3", 4, 2))
    run_step(sched)
    taken = again.queue_s
    sched._preempt(again, SchedulerOutput())  # back to waiting: it is admitted again
    assert again in sched.waiting
    out = run_step(sched)
    assert [name for name, _ in plan(out)] == ["q3"]  # scheduled again (its blocks from the cache)
    assert again.queue_s == taken  # the first admission's, not the second's


def test_qos_orders_admission_regardless_of_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    inline = make_seq("inline", 4, 1, qos="inline")
    background = make_seq("background", 4, 1, qos="background")
    interactive = make_seq("interactive", 4, 1, qos="interactive")
    for seq in (inline, background, interactive):  # arrival order: worst first
        sched.add(seq)
    order = [plan(run_step(sched)) for _ in range(3)]
    assert order == [[("interactive", 4)], [("background", 4)], [("inline", 4)]]


def test_within_a_qos_class_earlier_arrival_goes_first() -> None:
    sched = make_scheduler(max_num_seqs=1)
    seqs = [make_seq(f"r{i}", 4, 1, qos="background") for i in range(3)]
    for seq in reversed(seqs):  # added newest-first; arrival was fixed at creation
        sched.add(seq)
    order = [plan(run_step(sched))[0][0] for _ in range(3)]
    assert order == ["r0", "r1", "r2"]


def _fill(sched: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        sched.add(seq)
    out = run_step(sched)
    assert plan(out) == [(s.request_id, 8) for s in sorted(seqs, key=lambda s: (s.qos_rank, s.arrival))]
    assert sched.block_manager.num_free_blocks == 0


def test_preemption_picks_the_lowest_qos_first() -> None:
    sched = make_scheduler(num_blocks=6)
    a = make_seq("a", 8, 10)
    b = make_seq("b", 8, 10, qos="background")
    c = make_seq("c", 8, 10)  # newer than b, but interactive
    _fill(sched, [a, b, c])  # 2 blocks each; every decode now needs a third block
    b_blocks = list(b.block_table)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("c", 1)]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.waiting == [b] and sched.running == [a, c]
    assert a.block_table[2] == b_blocks[1] and c.block_table[2] == b_blocks[0]  # b's freed blocks, tail first


def test_preemption_picks_the_newest_within_a_class() -> None:
    sched = make_scheduler(num_blocks=6)
    a, b, c = make_seq("a", 8, 10), make_seq("b", 8, 10), make_seq("c", 8, 10)
    _fill(sched, [a, b, c])
    out = run_step(sched)
    assert out.preempted == [c]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert c.output_token_ids == [7]  # its sampled token is kept for the recompute


def test_a_request_that_is_itself_the_lowest_priority_yields() -> None:
    sched = make_scheduler(num_blocks=5, budget=8)
    low = make_seq("low", 8, 10, qos="inline")
    sched.add(low)
    assert plan(run_step(sched)) == [("low", 8)]  # 2 blocks
    high = make_seq("high", 12, 10)
    sched.add(high)
    assert plan(run_step(sched)) == [("low", 1), ("high", 7)]  # low takes block 3; high 2 blocks
    assert sched.block_manager.num_free_blocks == 0
    out = run_step(sched)  # low's decode fits in its block; high's next chunk needs a block
    assert out.preempted == [low]
    assert plan(out) == [("high", 5)]
    assert low.status is SequenceStatus.PREEMPTED


def test_preempted_request_resumes_and_recomputes_its_outputs() -> None:
    sched = make_scheduler(num_blocks=6)
    a, b, c = make_seq("a", 8, 3), make_seq("b", 8, 3), make_seq("c", 8, 4)
    _fill(sched, [a, b, c])
    out = run_step(sched)
    assert out.preempted == [c]
    assert not any(r.seq is c for r in out.scheduled)
    assert (a.block_table, b.block_table) == ([0, 1, 5], [2, 3, 4])
    # a and b finish after this step and free their blocks; c comes back
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]
    assert a.is_finished and b.is_finished
    out = run_step(sched)
    # a and b took c's freed blocks (evicting their keys): prompt + output recomputed in full
    assert (a.block_table, b.block_table) == ([], [])
    assert plan(out) == [("c", 9)]
    assert c.num_cached_tokens == 0  # set at first admission only
    assert c.output_token_ids == [7, 7]
    while sched.has_unfinished():
        run_step(sched)
    assert c.is_finished and c.output_token_ids == [7] * 4
    assert c.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 6


# A batch-invariant request is preempted only when no other running request is left to
# preempt (a recompute could change its numerics). These pin it where plain priority
# (QoS class, then arrival) would pick the protected request: it is newer, or in a lower class.


def test_a_batch_invariant_request_is_preempted_last_even_when_newest() -> None:
    sched = make_scheduler(num_blocks=4)
    older = make_seq("older", 8, 20)
    inv = make_seq("inv", 8, 20, batch_invariant=True)  # same class, newer: priority's victim
    sched.add(older)
    sched.add(inv)
    assert plan(run_step(sched)) == [("inv", 8)]  # its own step: 2 blocks
    assert plan(run_step(sched)) == [("older", 8)]  # the others' step: the last 2 blocks
    out = run_step(sched)  # inv's 9th token needs a third block
    assert out.preempted == [older]
    assert plan(out) == [("inv", 1)]
    assert inv.num_preemptions == 0 and sched.running == [inv]


def test_a_batch_invariant_request_is_preempted_last_even_in_the_lowest_class() -> None:
    sched = make_scheduler(num_blocks=6)
    a = make_seq("a", 8, 20)
    b = make_seq("b", 8, 20, qos="background")
    inv = make_seq("inv", 8, 20, qos="inline", batch_invariant=True)
    for seq in (a, b, inv):
        sched.add(seq)
    assert plan(run_step(sched)) == [("inv", 8)]
    assert plan(run_step(sched)) == [("a", 8), ("b", 8)]
    out = run_step(sched)  # inv needs a block: among the others, QoS order still holds
    assert out.preempted == [b]
    assert plan(out) == [("inv", 1)]
    assert inv.num_preemptions == 0 and a.num_preemptions == 0


def test_a_request_yields_itself_rather_than_preempt_a_batch_invariant_one() -> None:
    sched = make_scheduler(num_blocks=4)
    older = make_seq("older", 8, 20)
    inv = make_seq("inv", 6, 20, batch_invariant=True)  # 2 blocks with 2 slots to spare
    sched.add(older)
    sched.add(inv)
    assert plan(run_step(sched)) == [("inv", 6)]
    assert plan(run_step(sched)) == [("older", 8)]  # no block left
    assert plan(run_step(sched)) == [("inv", 1)]  # fits in inv's own block
    out = run_step(sched)  # older's 9th token needs a block; only inv could give one
    assert out.preempted == [older]
    assert plan(out) == []
    assert inv.num_preemptions == 0 and sched.running == [inv]


def test_admission_waits_when_blocks_run_out_and_nobody_is_preempted_for_it() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_seq("a", 12, 2)
    sched.add(a)
    assert plan(run_step(sched)) == [("a", 12)]  # 3 blocks
    b = make_seq("b", 8, 1)
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("a", 1)]  # a's 13th token takes the last block; b does not fit
    assert out.preempted == [] and sched.waiting == [b]
    assert plan(run_step(sched)) == [("b", 8)]


@pytest.mark.parametrize("qos", ["interactive", "background", "inline"])
def test_finish_frees_blocks_from_waiting_or_running(qos: str) -> None:
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq("r", 6, 5, qos=qos), make_seq("w", 6, 5, qos=qos)
    sched.add(running)
    sched.add(waiting)
    run_step(sched)
    sched.finish(waiting, "abort")
    sched.finish(running, "abort")
    assert sched.waiting == [] and sched.running == []
    assert sched.block_manager.num_free_blocks == 64
    assert running.finish_reason == "abort" and running.status is SequenceStatus.FINISHED


def test_a_resumed_request_reuses_its_own_surviving_cached_block() -> None:
    sched = make_scheduler(num_blocks=7)
    a, b, c = make_seq("a", 8, 3), make_seq("b", 8, 3), make_seq("c", 8, 4)
    for seq in (a, b, c):
        sched.add(seq)
    assert plan(run_step(sched)) == [("a", 8), ("b", 8), ("c", 8)]  # a: 0,1  b: 2,3  c: 4,5
    out = run_step(sched)  # a takes the spare block 6; b needs one: c is preempted
    assert out.preempted == [c]
    assert (a.block_table, b.block_table) == ([0, 1, 6], [2, 3, 5])  # b took c's deepest block
    assert list(sched.block_manager.free_queue) == [4]  # c's root block, still keyed
    out = run_step(sched)  # c would need block 4 back plus 2 fresh ones: it waits
    assert plan(out) == [("a", 1), ("b", 1)]
    assert a.is_finished and b.is_finished
    out = run_step(sched)
    assert plan(out) == [("c", 5)]  # its first block (4 tokens) came from the cache
    assert c.block_table == [4, 6, 1]
    assert c.num_computed_tokens == 9


def test_a_prompt_sharing_part_of_a_cached_block_gets_its_slots_copied() -> None:
    sched = make_scheduler()
    a = make_seq("a", 8, max_tokens=1)
    sched.add(a)
    assert plan(run_step(sched)) == [("a", 8)]  # blocks 0 and 1 published
    assert a.is_finished
    b = Sequence("b", a.prompt_token_ids[:6] + [5, 6, 7], SamplingParams(max_tokens=2, detokenize=False))
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("b", 3)]  # block 0 whole, tokens 4 and 5 copied from block 1
    assert out.copies == [(1, b.block_table[1], 2)]
    assert b.num_cached_tokens == 6
