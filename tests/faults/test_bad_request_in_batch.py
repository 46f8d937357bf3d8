"""One bad request in a batch fails alone: a grammar that allows no token ends that request
with an error while the others in the same steps finish with exactly the tokens they get
without it."""

from __future__ import annotations

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
