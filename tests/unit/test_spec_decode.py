"""Speculative decoding (n-gram / prompt lookup): drafts, verification, engine integration.

Greedy: the tokens must equal non-speculative decoding, token for token, alone, in mixed
batches, with penalties, under preemption. Sampled: the verification must leave the output
distribution unchanged (rejection sampling, checked on fixed distributions), and the target
distribution it uses must be the one the sampler draws from.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch

from argosy.api.openai.common import usage_json
from argosy.chat.events import Finish
from argosy.config import EngineConfig, ModelSpec, OperatorSampling, ServerConfig
from argosy.core.service import ModelService, ServiceOptions
from argosy.core.stream import CoreRequest
from argosy.engine.async_engine import AsyncEngine
from argosy.engine.llm_engine import LLMEngine
from argosy.engine.sequence import Sequence
from argosy.errors import InvalidRequestError
from argosy.runner.kv_cache import kv_bytes_per_block
from argosy.runner.sampler import Sampler, SamplingRow
from argosy.runner.spec_decode import NgramProposer, StatelessProposer, find_draft, verify_batch, walk_draft
from argosy.sampling_params import RequestSampling, SamplingParams
from tests.unit.conftest import FakeGuide, TinyModel
from tests.unit.test_engine import Result, assert_all_blocks_free, collect, greedy, prompt, run, run_one


def draft_prone_prompt(tiny: TinyModel, seed: int, length: int = 12) -> list[int]:
    """x + (the model's own greedy continuation of x) + x: after the second x the n-gram
    proposer drafts that continuation, which the model partly follows (some drafts are
    accepted, some rejected)."""
    x = prompt(length, seed)
    return x + tiny.greedy(x, 24) + x


SPEC: dict[str, object] = dict(speculative="ngram", ngram_min=1, ngram_max=3, spec_max_decodes=64)


class OracleProposer(StatelessProposer):
    """Drafts the known reference continuation, with every `corrupt_every`-th draft token
    replaced by a wrong one: exercises long accepted runs and rejections at known places."""

    def __init__(
        self, reference: dict[str, list[int]], num_prompt: dict[str, int], corrupt_every: int = 0
    ) -> None:
        self.reference = reference
        self.num_prompt = num_prompt
        self.corrupt_every = corrupt_every
        self.num_calls = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        ref = self.reference[seq.request_id]
        done = seq.num_output_tokens
        draft = list(ref[done : done + min(limit, 4)])
        self.num_calls += 1
        if self.corrupt_every and draft and self.num_calls % self.corrupt_every == 0:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 300
        return draft


def use_proposer(engine: LLMEngine, proposer: object) -> LLMEngine:
    engine.proposer = proposer  # type: ignore[assignment]
    engine.scheduler.proposer = proposer  # type: ignore[assignment]
    return engine


# -- the proposer ---------------------------------------------------------------------------
def test_find_draft_takes_the_longest_then_most_recent_match() -> None:
    t = np.array([1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 1, 2, 3], dtype=np.int64)
    # suffix 1,2,3 occurs at 0 (followed by 9 9 5 ...); the 2-gram 2,3 at 6 is more recent,
    # but the 3-gram wins
    assert find_draft(t, 1, 3, 4) == [9, 9, 5, 2]
    assert find_draft(t, 1, 2, 4) == [7, 8, 6, 1]  # only 2-grams: the most recent one
    assert find_draft(t, 1, 2, 2) == [7, 8]
    assert find_draft(np.array([4, 5, 6, 7], dtype=np.int64), 1, 3, 4) == []
    assert find_draft(np.array([5, 6, 5], dtype=np.int64), 1, 3, 4) == [6, 5]  # as far as known
    assert find_draft(np.array([5, 5], dtype=np.int64), 1, 3, 4) == [5]
    assert find_draft(np.array([5], dtype=np.int64), 1, 3, 4) == []


def test_proposer_room_respects_max_tokens_context_and_grammar() -> None:
    proposer = NgramProposer(4, 1, 3, max_model_len=40)
    ids = [1, 2, 3, 4] * 6  # 24 tokens, endlessly repeating
    seq = Sequence("s", ids, SamplingParams(max_tokens=10, detokenize=False))
    assert proposer.propose(seq, 16) == [1, 2, 3, 4]
    assert proposer.propose(seq, 2) == [1, 2]
    seq.output_token_ids = [1, 2, 3, 4, 1, 2, 3]  # 3 left of max_tokens: one is the target's own
    assert proposer.propose(seq, 16) == [4, 1]
    seq.output_token_ids = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    assert proposer.propose(seq, 16) == []
    seq = Sequence(
        "c", ids + [1, 2, 3, 4] * 3 + [1], SamplingParams(max_tokens=None, detokenize=False)
    )  # 37 of 40
    assert proposer.propose(seq, 16) == [2, 3, 4]
    guided = Sequence("g", ids, SamplingParams(detokenize=False), guide=FakeGuide({1, 2, 3, 4}))  # type: ignore[arg-type]
    assert proposer.propose(guided, 16) == []
    seq = Sequence("grow", ids, SamplingParams(max_tokens=None, detokenize=False))
    proposer = NgramProposer(4, 1, 3, max_model_len=1000)
    for _ in range(300):  # the token buffer follows the outputs (and grows)
        seq.output_token_ids.append(proposer.propose(seq, 1)[0])
    assert seq.output_token_ids == ([1, 2, 3, 4] * 75)


def test_config_validates_speculation_fields() -> None:
    assert EngineConfig(speculative="ngram").speculation_enabled
    assert not EngineConfig().speculation_enabled
    with pytest.raises(InvalidRequestError, match="speculative"):
        EngineConfig(speculative="eagle")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(InvalidRequestError, match="ngram_min"):
        EngineConfig(ngram_min=3, ngram_max=2)


# -- greedy: equal to plain decoding --------------------------------------------------------
def test_greedy_speculative_equals_plain_decoding(tiny: TinyModel) -> None:
    requests = {f"r{s}": (draft_prone_prompt(tiny, s), greedy(48)) for s in range(4)}
    plain = run(tiny.engine(), requests)
    engine = tiny.engine(**SPEC)
    for rid, (ids, params) in requests.items():  # one at a time
        assert run_one(engine, ids, params, rid).token_ids == plain[rid].token_ids, rid
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0  # some drafts were right...
    assert stats.spec_proposed_tokens > stats.spec_accepted_tokens  # ...and some wrong
    assert_all_blocks_free(engine)


def test_greedy_speculative_in_a_mixed_batch(tiny_llama: TinyModel) -> None:
    tiny = tiny_llama
    requests: dict[str, tuple[list[int], SamplingParams]] = {
        f"g{s}": (draft_prone_prompt(tiny, s), greedy(40)) for s in range(4)
    }
    requests["pen"] = (
        draft_prone_prompt(tiny, 11),
        greedy(40, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    )
    requests["bias"] = (draft_prone_prompt(tiny, 12), greedy(40, logit_bias={7: 2.0}))
    requests["lp"] = (draft_prone_prompt(tiny, 13), greedy(40, logprobs=3, prompt_logprobs=2))
    requests["long"] = (prompt(90, 14), greedy(20))  # prefill chunks beside the drafts
    requests["seeded"] = (
        draft_prone_prompt(tiny, 15),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True, detokenize=False),
    )
    plain = run(tiny.engine(), requests)
    engine = tiny.engine(**SPEC)
    spec = run(engine, requests)
    for rid in requests:  # the seeded one too: one draw per emitted token, same generator
        assert spec[rid].token_ids == plain[rid].token_ids, rid
    # logprobs of each emitted token come from its own position's logits
    for got, want in zip(spec["lp"].logprobs, plain["lp"].logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert spec["lp"].prompt_logprobs is not None and plain["lp"].prompt_logprobs is not None
    assert len(spec["lp"].prompt_logprobs) == len(plain["lp"].prompt_logprobs)
    # a seeded request is still independent of its batch
    alone = run_one(tiny.engine(**SPEC), *requests["seeded"], "seeded")
    assert spec["seeded"].token_ids == alone.token_ids
    assert len(spec["seeded"].token_ids) == 40
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.0, top_k=0, top_p=0.9),
        dict(temperature=0.6, top_k=0, min_p=0.05, frequency_penalty=0.5),
    ],
)
def test_seeded_sampling_with_drafts_equals_plain_sampling(tiny_qwen2: TinyModel, options: dict) -> None:  # type: ignore[type-arg]
    """Draft-friendly prompts at low temperature: drafts get accepted and rejected, and the
    seeded tokens equal those of plain decoding."""
    tiny = tiny_qwen2
    params = SamplingParams(max_tokens=40, seed=11, ignore_eos=True, detokenize=False, **options)
    oracle_ref: dict[str, list[int]] = {}
    requests = {f"s{s}": (draft_prone_prompt(tiny, s), params) for s in range(3)}
    plain = run(tiny.engine(), requests)
    engine = tiny.engine(**SPEC)
    spec = run(engine, requests)
    assert {r: x.token_ids for r, x in spec.items()} == {r: x.token_ids for r, x in plain.items()}
    # and with drafts that are mostly right (the plain output, every other one corrupted)
    oracle_ref = {rid: r.token_ids for rid, r in plain.items()}
    oracle = use_proposer(tiny.engine(), OracleProposer(oracle_ref, {}, corrupt_every=2))
    assert {r: x.token_ids for r, x in run(oracle, requests).items()} == oracle_ref
    stats = oracle.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens


def test_no_drafts_in_a_crowded_step(tiny_llama: TinyModel) -> None:
    tiny = tiny_llama
    engine = tiny.engine(**{**SPEC, "spec_max_decodes": 2})
    requests = {f"c{s}": (draft_prone_prompt(tiny, s), greedy(12 + 20 * s)) for s in range(3)}
    seen: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        decodes = [r for r in out.scheduled if r.is_sampling and r.seq.num_output_tokens > 0]
        seen.append((len(decodes), sum(1 for r in decodes if r.num_spec_tokens)))
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    plain = run(tiny.engine(), requests)
    assert {r: x.token_ids for r, x in run(engine, requests).items()} == {
        r: x.token_ids for r, x in plain.items()
    }
    assert all(drafted == 0 for decodes, drafted in seen if decodes > 2)
    assert any(drafted for decodes, drafted in seen if decodes <= 2)


def test_preemption_with_drafts_gives_the_same_outputs(tiny: TinyModel) -> None:
    cfg = tiny.reference.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = kv_bytes_per_block(
        cfg.num_hidden_layers, 16, cfg.num_key_value_heads, head_dim, torch.float32
    )
    requests = {f"q{i}": (draft_prone_prompt(tiny, 40 + i, length=6), greedy(30)) for i in range(5)}
    plain = run(tiny.engine(), requests)
    tight = tiny.engine(kv_cache_memory=10 * per_block, **SPEC)
    assert tight.num_blocks == 10
    spec = run(tight, requests)
    assert tight.stats().num_preemptions > 0
    assert tight.stats().spec_proposed_tokens > 0
    for rid in requests:
        assert spec[rid].token_ids == plain[rid].token_ids, rid
    assert_all_blocks_free(tight)


def test_oracle_drafts_long_accepted_runs_and_rejections(tiny_qwen2: TinyModel) -> None:
    tiny = tiny_qwen2
    requests = {f"o{s}": (prompt(10 + s, 60 + s), greedy(37)) for s in range(3)}
    plain = run(tiny.engine(), requests)
    reference = {rid: r.token_ids for rid, r in plain.items()}
    oracle = OracleProposer(reference, {rid: len(ids) for rid, (ids, _) in requests.items()}, corrupt_every=3)
    engine = use_proposer(tiny.engine(), oracle)
    spec = run(engine, requests)
    assert {rid: r.token_ids for rid, r in spec.items()} == reference
    stats = engine.stats()
    # two of three drafts are right (4 tokens each, fewer near max_tokens); a corrupted one
    # keeps the tokens before the corruption
    assert stats.spec_accepted_tokens >= 0.6 * stats.spec_proposed_tokens
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens
    # several tokens per step: far fewer steps than tokens
    assert max(r.num_outputs for r in spec.values()) < 20
    assert_all_blocks_free(engine)


def test_prefix_cache_after_rejected_drafts_is_correct(tiny_llama: TinyModel) -> None:
    """Blocks holding KV of rejected drafts must never be published: a second request with
    the first one's whole text as its prompt reuses its blocks and must decode the same."""
    tiny = tiny_llama
    ids = prompt(10, 70)
    plain_tokens = run_one(tiny.engine(), ids, greedy(40)).token_ids
    reference = {"a": plain_tokens, "b": plain_tokens[33:]}
    oracle = OracleProposer(reference, {"a": len(ids)}, corrupt_every=1)  # every draft is wrong
    engine = use_proposer(tiny.engine(), oracle)
    assert run_one(engine, ids, greedy(40), "a").token_ids == plain_tokens
    follow = ids + plain_tokens[:33]
    again = run_one(engine, follow, greedy(7), "b")
    assert again.num_cached_tokens == 42  # 2 whole blocks, then 10 tokens of the third (copied)
    assert again.token_ids == plain_tokens[33:40]


def test_penalties_count_the_drafts_before_each_position(tiny_llama: TinyModel) -> None:
    """Position j of a draft is scored as if d_1..d_j-1 were already output tokens."""
    tiny = tiny_llama
    params = greedy(40, frequency_penalty=3.0, presence_penalty=1.0, repetition_penalty=1.5)
    requests = {f"p{s}": (prompt(8, 80 + s), params) for s in range(3)}
    reference = {rid: r.token_ids for rid, r in run(tiny.engine(), requests).items()}
    engine = use_proposer(tiny.engine(), OracleProposer(reference, {}))
    assert {rid: r.token_ids for rid, r in run(engine, requests).items()} == reference
    assert engine.stats().spec_accepted_tokens == engine.stats().spec_proposed_tokens > 60


# -- stops cut the accepted run exactly -----------------------------------------------------
def test_eos_stop_ids_and_max_tokens_cut_an_accepted_run(tiny_llama: TinyModel) -> None:
    tiny = tiny_llama
    ids = prompt(12, seed=21)
    reference = tiny.greedy(ids, 32)
    cut = next(i for i in range(5, 32) if reference[i] not in reference[:i])
    stop_id = reference[cut]
    oracle = OracleProposer({"s": reference}, {"s": len(ids)})

    r = run_one(use_proposer(tiny.engine(), oracle), ids, greedy(32, stop_token_ids=[stop_id]), "s")
    assert r.token_ids == reference[: cut + 1]
    assert (r.finish_reason, r.stop_reason) == ("stop", stop_id)

    eos_engine = use_proposer(LLMEngine(tiny.engine().config, source=tiny.with_eos([stop_id])), oracle)
    r = run_one(eos_engine, ids, SamplingParams(max_tokens=32, temperature=0.0, detokenize=False), "s")
    assert r.token_ids == reference[: cut + 1]
    assert (r.finish_reason, r.stop_reason) == ("stop", None)

    for max_tokens in (1, 2, 5, 7):
        engine = use_proposer(tiny.engine(), oracle)
        r = run_one(engine, ids, greedy(max_tokens), "s")
        assert r.token_ids == reference[:max_tokens] and r.finish_reason == "length"
        assert_all_blocks_free(engine)

    engine = use_proposer(tiny.engine(max_model_len=len(ids) + 9), oracle)
    r = run_one(engine, ids, greedy(9), "s")
    assert r.token_ids == reference[:9] and r.finish_reason == "length"


# -- counts ---------------------------------------------------------------------------------
def test_counts_are_reported_per_request_and_engine_wide(tiny_qwen2: TinyModel) -> None:
    tiny = tiny_qwen2
    engine = tiny.engine(**SPEC)
    results: dict[str, Result] = {}
    last: dict[str, tuple[int | None, int | None]] = {}
    for s in range(3):
        engine.add_request(f"c{s}", draft_prone_prompt(tiny, s), greedy(40))
    engine.add_request("guided", prompt(9, 8), greedy(10), guide=FakeGuide({5, 17, 42, 250}))  # type: ignore[arg-type]
    while engine.has_unfinished():
        outputs = engine.step()
        collect(results, outputs)
        for out in outputs:
            last[out.request_id] = (out.num_spec_proposed, out.num_spec_accepted)
    stats = engine.stats()
    assert last["guided"] == (0, 0)  # grammar-guided requests never speculate
    assert sum(p or 0 for p, _ in last.values()) == stats.spec_proposed_tokens > 0
    assert sum(a or 0 for _, a in last.values()) == stats.spec_accepted_tokens > 0
    # fewer outputs than tokens where drafts were accepted; every token still arrives
    assert all(len(results[f"c{s}"].token_ids) == 40 for s in range(3))

    plain = tiny.engine()
    plain.add_request("p", prompt(9, 8), greedy(3))
    outs = []
    while plain.has_unfinished():
        outs.extend(plain.step())
    assert all(o.num_spec_proposed is None and o.num_spec_accepted is None for o in outs)


# -- verification ---------------------------------------------------------------------------
def test_walk_draft_greedy() -> None:
    assert walk_draft([5, 6, 7, 8].__getitem__, [5, 6, 7]) == ([5, 6, 7, 8], 3)  # all + bonus
    assert walk_draft([5, 9, 7, 8].__getitem__, [5, 6, 7]) == ([5, 9], 1)  # the target's own
    assert walk_draft([4, 6, 7, 8].__getitem__, [5, 6, 7]) == ([4], 0)
    calls: list[int] = []
    walk_draft(lambda j: calls.append(j) or 0, [0, 1, 2])  # type: ignore[func-returns-value]
    assert calls == [0, 1]  # positions past the first mismatch are never sampled


P1 = [0.1, 0.4, 0.05, 0.25, 0.2]
P2 = [0.3, 0.1, 0.2, 0.15, 0.25]
P3 = [0.05, 0.05, 0.6, 0.2, 0.1]


def frequencies(tokens: list[int], vocab: int = 5) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("draft_token", [1, 2])  # a likely and an unlikely draft
@pytest.mark.parametrize("top_k", [0, 5])  # the sampler's full-sort and top-k paths
def test_verification_keeps_the_target_distribution(draft_token: int, top_k: int) -> None:
    """verify_batch on fixed distributions (logits = log p, temperature 1), 24,000 trials:
    the first emitted token is distributed as p1 whatever the draft (an always-accepting
    verifier emits the draft every time; resampling from p1 on rejection instead of p1
    without the draft gives p + (1 - p) p), the draft is accepted with probability p1(draft),
    and after an accepted draft the next token is distributed as p2."""
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, detokenize=False)
    sampler = Sampler(5, torch.Generator().manual_seed(99))
    seq = Sequence("v", [1, 2, 3], params)
    generator = torch.Generator().manual_seed(1234)
    logits = torch.tensor([P1, P2, P3]).log()

    def row_for(s: Sequence) -> SamplingRow:
        return SamplingRow(params, s.prompt_token_ids, s.output_token_ids, generator)

    trials = 24000
    first, second_after_accept, num_accepted = [], [], []
    for _ in range(trials):
        (verified,) = verify_batch(sampler, logits.clone(), [(seq, [draft_token, 0])], row_for)
        tokens, accepted = verified.token_ids, verified.num_accepted
        assert len(tokens) == accepted + 1 and tokens[:accepted] == [draft_token, 0][:accepted]
        first.append(tokens[0])
        num_accepted.append(accepted)
        if accepted:
            second_after_accept.append(tokens[1])
    assert torch.allclose(frequencies(first), torch.tensor(P1).double(), atol=0.012)
    accepted_first = sum(a >= 1 for a in num_accepted) / trials
    assert accepted_first == pytest.approx(P1[draft_token], abs=0.012)
    tolerance = max(0.012, 4.5 * (0.25 / len(second_after_accept)) ** 0.5)
    assert torch.allclose(frequencies(second_after_accept), torch.tensor(P2).double(), atol=tolerance)


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7, top_k=3),
        dict(temperature=1.3, top_p=0.8, top_k=0),
        dict(temperature=1.0, min_p=0.15, top_k=0),
        dict(temperature=0.9, top_k=300, top_p=0.95),  # above the fast-path limit
        dict(temperature=0.9, top_k=4, repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={2: 1.5}),
    ],
)
def test_sample_row_draws_what_the_batched_sampler_draws(options: dict) -> None:  # type: ignore[type-arg]
    """Same seeds -> the same tokens from sample_row as from the batched sampler, whatever
    else is in the batch: what makes seeded speculative decoding equal plain decoding."""
    vocab = 320
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(detokenize=False, **options)
    other = SamplingParams(temperature=1.0, top_k=7, seed=1, detokenize=False)
    batched_sampler = Sampler(vocab, torch.Generator().manual_seed(0))
    single_sampler = Sampler(vocab, torch.Generator().manual_seed(0))
    g_batch, g_single = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    row_batch = SamplingRow(params, [3, 4], [0, 0, 7], g_batch)
    row_single = SamplingRow(params, [3, 4], [0, 0, 7], g_single)
    other_row = SamplingRow(other, [1], [], torch.Generator().manual_seed(8))
    batched, single = [], []
    for _ in range(300):
        out = batched_sampler(torch.stack([logits.flip(0), logits]), [other_row, row_batch])
        batched.append(out[1][0])
        processed = logits.unsqueeze(0).clone()
        single_sampler.process_logits(processed, [row_single])
        single.append(single_sampler.sample_row(processed[0], row_single))
    assert batched == single
    assert len(set(single)) > 1


# -- the core: usage extension, access log, --spec-max-temperature --------------------------
@pytest.mark.parametrize("speculative", ["ngram", "none"])
def test_core_reports_speculation_in_usage_and_the_access_log(
    tiny_llama: TinyModel, speculative: str, caplog: pytest.LogCaptureFixture
) -> None:
    tiny = tiny_llama
    operator = OperatorSampling(spec_max_temperature=0.0)
    engine = AsyncEngine(tiny.engine(max_model_len=256, speculative=speculative, ngram_min=1, ngram_max=3))
    options = ServiceOptions.of(
        ModelSpec("tiny", "tiny"), ServerConfig(operator_sampling=operator), speculative
    )
    core = ModelService("tiny", engine, options)
    try:
        ids = draft_prone_prompt(tiny, 3)
        sampling = RequestSampling(max_tokens=40, ignore_eos=True)  # temperature: nobody's choice
        stream = core.start(CoreRequest(prompts=[ids, draft_prone_prompt(tiny, 1)], sampling=sampling))
        # the operator cap applies only while speculation is on (the fallback is sampled)
        assert [c.params.temperature == 0.0 for c in stream.choices] == [speculative == "ngram"] * 2

        async def go() -> list[object]:
            async with stream:
                return [event async for event in stream]

        with caplog.at_level(logging.INFO, logger="argosy.access"):
            events = asyncio.run(go())
        finishes = [e for e in events if isinstance(e, Finish)]
        assert all(f.usage.completion_tokens == 40 for f in finishes)
        usage = stream.usage
        body = usage_json(usage)
        line = next(r.getMessage() for r in caplog.records if r.name == "argosy.access")
        if speculative == "none":
            assert usage.spec_proposed_tokens is None and "speculative" not in body
            assert "spec=" not in line
            return
        stats = engine.stats()
        assert body["speculative"] == {
            "proposed_tokens": stats.spec_proposed_tokens,
            "accepted_tokens": stats.spec_accepted_tokens,
        }
        assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
        assert sum(f.usage.spec_proposed_tokens or 0 for f in finishes) == stats.spec_proposed_tokens
        assert f" spec={stats.spec_accepted_tokens}/{stats.spec_proposed_tokens} " in line
        assert core.model_info().speculative == "ngram"
    finally:
        engine.shutdown()
