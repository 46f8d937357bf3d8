"""batch_invariant: such a request runs in steps of its own, so its tokens equal a solo run."""

from __future__ import annotations

from argosy.engine.sequence import Sequence
from argosy.sampling_params import SamplingParams
from tests.unit.test_scheduler import make_scheduler, make_seq, plan, run_step


def invariant_seq(request_id: str, num_prompt_tokens: int, max_tokens: int = 4) -> Sequence:
    seq = make_seq(request_id, num_prompt_tokens, max_tokens)
    seq.params = SamplingParams(max_tokens=max_tokens, detokenize=False, batch_invariant=True)
    return seq


def test_a_batch_invariant_request_never_shares_a_step() -> None:
    sched = make_scheduler(budget=64)
    for name in ("a", "b", "c"):
        sched.add(make_seq(name, 5, max_tokens=6))
    sched.add(invariant_seq("inv", 9, max_tokens=4))
    plans = []
    while sched.has_unfinished():
        plans.append(plan(run_step(sched)))
    inv_steps = [p for p in plans if any(r == "inv" for r, _ in p)]
    assert inv_steps == [[("inv", 9)], [("inv", 1)], [("inv", 1)], [("inv", 1)]]
    # others keep running in the steps in between
    assert all(p and "inv" not in dict(p) for p in plans if p not in inv_steps)


def test_alone_it_runs_every_step() -> None:
    sched = make_scheduler(budget=8)
    sched.add(invariant_seq("inv", 12, max_tokens=2))
    plans = [plan(run_step(sched)) for _ in range(3)]
    assert plans == [[("inv", 8)], [("inv", 4)], [("inv", 1)]]


def test_it_is_preempted_last() -> None:
    sched = make_scheduler(num_blocks=6, budget=64)
    # x is older than inv in the same class, so plain priority would preempt inv first
    x = make_seq("x", 8, max_tokens=20)
    inv = invariant_seq("inv", 8, max_tokens=20)
    sched.add(inv)
    run_step(sched)  # inv admitted alone: 2 blocks of 4
    sched.add(x)
    while sched.has_unfinished() and sched.num_preemptions == 0:
        run_step(sched)
    assert inv.num_preemptions == 0 and x.num_preemptions == 1


def test_bf16_tokens_equal_a_solo_run(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(3)
    prompt = [rng.randrange(300) for _ in range(40)]
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False, batch_invariant=True
    )

    def run(with_others: bool) -> list[int]:
        engine = tiny_llama.engine(dtype="bfloat16")
        engine.add_request("inv", prompt, params)
        if with_others:
            for i in range(8):
                other = [rng.randrange(300) for _ in range(rng.randrange(5, 70))]
                engine.add_request(
                    f"o{i}", other, SamplingParams(max_tokens=30, temperature=0.0, detokenize=False)
                )
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == "inv":
                    tokens += out.new_token_ids
        return tokens

    assert run(with_others=True) == run(with_others=False)
