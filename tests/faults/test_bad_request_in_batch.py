"""One bad request in a batch fails alone: a grammar that allows no token, or logits that
turn NaN for one request, end that request with an error while the others in the same steps
finish with exactly the tokens they get without it."""

from __future__ import annotations

import torch

from argosy.sampling_params import SamplingParams
from tests.unit.conftest import FakeGuide, TinyModel

PROMPTS = {"a": [5, 17, 42, 8, 99], "c": [3, 250, 11, 7, 64, 21]}


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_grammar_that_allows_nothing_fails_only_its_request(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    requests = {rid: (p, greedy(), None) for rid, p in PROMPTS.items()}
    requests["bad"] = ([9, 9, 9, 9], greedy(), FakeGuide(allowed=set()))
    tokens = {rid: [] for rid in requests}  # type: ignore[var-annotated]
    finishes = {}
    for rid, (prompt, params, guide) in requests.items():
        engine.add_request(rid, prompt, params, guide=guide)
    for _ in range(200):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finishes[out.request_id] = (out.finish_reason, out.error)
        if not engine.has_unfinished():
            break
    alone = tiny_llama.engine()
    expected = {rid: [] for rid in PROMPTS}  # type: ignore[var-annotated]
    for rid, prompt in PROMPTS.items():
        alone.add_request(rid, prompt, greedy())
    while alone.has_unfinished():
        for out in alone.step():
            expected[out.request_id].extend(out.new_token_ids)
    assert finishes["bad"][0] == "error" and finishes["bad"][1]
    for rid in PROMPTS:
        assert finishes[rid] == ("length", None)
        assert tokens[rid] == expected[rid]


def test_nan_logits_in_one_row_fail_only_that_request(tiny_llama: TinyModel) -> None:
    """The model's output for one request turns NaN at its third token (a numeric fault):
    that request ends with an error; the others in the same steps keep their tokens."""
    engine = tiny_llama.engine()
    runner = engine.runner
    sample_and_verify = runner._sample_and_verify
    calls = {"bad": 0}

    def poisoned(batch, offsets, logits_at, result):  # type: ignore[no-untyped-def]
        rows = {offsets[i] + r.num_new_tokens - 1 for i, r in enumerate(batch) if r.seq.request_id == "bad"}

        def at(wanted: list[int]) -> torch.Tensor:
            logits = logits_at(wanted)
            for j, row in enumerate(wanted):
                if row in rows:
                    calls["bad"] += 1
                    if calls["bad"] >= 3:
                        logits[j] = float("nan")
            return logits

        return sample_and_verify(batch, offsets, at, result)

    runner._sample_and_verify = poisoned  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {rid: [] for rid in [*PROMPTS, "bad"]}
    finishes = {}
    for rid, prompt in {**PROMPTS, "bad": [9, 9, 9, 9]}.items():
        engine.add_request(rid, prompt, greedy())
    for _ in range(200):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finishes[out.request_id] = (out.finish_reason, out.error)
        if not engine.has_unfinished():
            break
    alone = tiny_llama.engine()
    expected: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        alone.add_request(rid, prompt, greedy())
    while alone.has_unfinished():
        for out in alone.step():
            expected[out.request_id].extend(out.new_token_ids)
    assert finishes["bad"][0] == "error" and "not a number" in (finishes["bad"][1] or "")
    assert len(tokens["bad"]) == 2  # the two tokens before the fault
    for rid in PROMPTS:
        assert finishes[rid] == ("length", None) and tokens[rid] == expected[rid]
