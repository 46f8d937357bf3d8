"""One bad request in a batch fails alone: a grammar that allows no token, or logits that
turn NaN for one request, end that request with an error while the others in the same steps
finish with exactly the tokens they get without it."""

from __future__ import annotations

from typing import Any

import torch

from argosy.engine.llm_engine import LLMEngine
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import FakeGuide, TinyModel

PROMPTS = {"a": [5, 17, 42, 8, 99], "c": [3, 250, 11, 7, 64, 21]}
BAD_PROMPT = [9, 9, 9, 9]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, guides: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, tuple[Any, Any]]]:
    """Run PROMPTS (plus BAD_PROMPT as request "bad" when `guides` has that key) to the end:
    (tokens, (finish_reason, error)) by request id."""
    prompts = {**PROMPTS, "bad": BAD_PROMPT} if "bad" in guides else dict(PROMPTS)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(), guide=guides.get(request_id))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finishes: dict[str, tuple[Any, Any]] = {}
    for _ in range(200):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finishes[out.request_id] = (out.finish_reason, out.error)
        if not engine.has_unfinished():
            break
    return tokens, finishes


def assert_the_others_kept_their_tokens(
    tiny: TinyModel, tokens: dict[str, list[int]], finishes: dict
) -> None:  # type: ignore[type-arg]
    solo, _ = run(tiny.engine(), {})
    for request_id in PROMPTS:
        assert finishes[request_id] == ("length", None) and tokens[request_id] == solo[request_id]


def test_a_grammar_that_allows_nothing_fails_only_its_request(tiny_llama: TinyModel) -> None:
    tokens, finishes = run(tiny_llama.engine(), {"bad": FakeGuide(allowed=set())})
    assert finishes["bad"][0] == "error" and "grammar allows no token" in finishes["bad"][1]
    assert tokens["bad"] == []
    assert_the_others_kept_their_tokens(tiny_llama, tokens, finishes)


def test_nan_logits_in_one_row_fail_only_that_request(tiny_llama: TinyModel) -> None:
    """The model's output for one request turns NaN at its third token (a numeric fault)."""
    engine = tiny_llama.engine()
    sample_and_verify = engine.runner._sample_and_verify
    num_bad_rows = [0]

    def poisoned(batch, offsets, logits_at, result, device_logits_at=None):  # type: ignore[no-untyped-def]
        rows = {offsets[i] + r.num_new_tokens - 1 for i, r in enumerate(batch) if r.seq.request_id == "bad"}

        def at(wanted: list[int]) -> torch.Tensor:
            logits = logits_at(wanted)
            for j, row in enumerate(wanted):
                if row in rows:
                    num_bad_rows[0] += 1
                    if num_bad_rows[0] >= 3:
                        logits[j] = float("nan")
            return logits

        assert device_logits_at is None  # on the CPU every row's logits come through logits_at
        return sample_and_verify(batch, offsets, at, result)

    engine.runner._sample_and_verify = poisoned  # type: ignore[method-assign]
    tokens, finishes = run(engine, {"bad": None})
    assert finishes["bad"][0] == "error" and "not a number" in finishes["bad"][1]
    assert len(tokens["bad"]) == 2  # the two tokens before the fault
    assert_the_others_kept_their_tokens(tiny_llama, tokens, finishes)
