"""A draft model for speculative decoding (argosy/runner/draft_model.py): greedy and seeded
requests give the tokens they give without it, the draft really runs its model (a draft equal to
the target is always right), its KV blocks go back when requests end, chaining with the n-gram
lookup, and a draft of another vocabulary is refused naming the difference."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tokenizers import Tokenizer, models

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.errors import InvalidRequestError, ModelLoadError
from argosy.runner.draft_model import ChainProposer, DraftModelProposer, vocabulary_difference
from argosy.runner.spec_decode import NgramProposer
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import TinyModel
from tests.unit.test_engine import Result, collect, greedy, prompt, run, run_one
from tests.unit.test_spec_decode import draft_prone_prompt, use_proposer


def with_draft(
    target: TinyModel, draft: TinyModel, **options: object
) -> tuple[LLMEngine, DraftModelProposer]:
    draft_vocab = options.pop("draft_vocab", None)
    engine = target.engine(**options)
    config = replace(engine.config, draft_model=str(draft.folder))
    if draft_vocab is not None:
        config = replace(config, draft_vocab=draft_vocab)
    proposer = DraftModelProposer(config, target.source, engine.max_model_len, source=draft.source)
    return use_proposer(engine, proposer), proposer


def test_greedy_with_a_draft_model_equals_plain_decoding(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
) -> None:
    requests = {f"r{s}": (prompt(10 + s, s), greedy(24)) for s in range(3)}
    plain = run(tiny_qwen2.engine(), requests)
    engine, proposer = with_draft(tiny_qwen2, tiny_llama)
    for rid, (ids, params) in requests.items():  # alone, then all together
        assert run_one(engine, ids, params, rid).token_ids == plain[rid].token_ids, rid
    together = run(engine, {f"b{rid}": request for rid, request in requests.items()})
    assert all(together[f"b{rid}"].token_ids == plain[rid].token_ids for rid in requests)
    assert engine.stats().spec_proposed_tokens > 0
    # every request ended: its draft's blocks are back
    assert not proposer.states
    bm = proposer.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_qwen2: TinyModel) -> None:
    engine, _ = with_draft(tiny_qwen2, tiny_qwen2)
    ids = prompt(12, 3)
    out = run_one(engine, ids, greedy(30), "same")
    assert out.token_ids == tiny_qwen2.greedy(ids, 30)
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 20 and stats.spec_accepted_tokens == stats.spec_proposed_tokens


def test_seeded_sampling_with_a_draft_model_equals_plain_sampling(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24)
    ids = prompt(9, 5)
    plain = run_one(tiny_qwen2.engine(), ids, params, "s").token_ids
    engine, _ = with_draft(tiny_qwen2, tiny_llama)
    assert run_one(engine, ids, params, "s").token_ids == plain
    same, _ = with_draft(tiny_qwen2, tiny_qwen2)
    assert run_one(same, ids, params, "s").token_ids == plain


def test_ngram_drafts_first_then_the_draft_model(tiny_qwen2: TinyModel, tiny_llama: TinyModel) -> None:
    ids = draft_prone_prompt(tiny_qwen2, 2)
    plain = run_one(tiny_qwen2.engine(), ids, greedy(30), "c").token_ids
    engine, proposer = with_draft(tiny_qwen2, tiny_llama)
    ngram = NgramProposer(3, 1, 3, engine.max_model_len)
    chain = ChainProposer(ngram, proposer)
    use_proposer(engine, chain)
    calls = {"model": 0}
    propose = proposer.propose

    def counted(seq, limit):  # type: ignore[no-untyped-def]
        calls["model"] += 1
        return propose(seq, limit)

    proposer.propose = counted  # type: ignore[method-assign]
    assert run_one(engine, ids, greedy(30), "c").token_ids == plain
    # the n-gram lookup drafted some steps (the repeated half), the model the others
    assert 0 < calls["model"] < engine.stats().spec_steps


def test_a_draft_of_another_vocabulary_is_refused_naming_the_difference(tiny_qwen2: TinyModel) -> None:
    other = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    draft = replace(tiny_qwen2.source, tokenizer=other)
    assert (
        vocabulary_difference(draft, tiny_qwen2.source)
        == "the draft's tokenizer has 2 tokens, the target's 1"
    )
    renamed = replace(tiny_qwen2.source, tokenizer=Tokenizer(models.WordLevel({"b": 0}, unk_token="b")))
    assert (
        vocabulary_difference(renamed, tiny_qwen2.source)
        == "token 'b' is id 0 in the draft, None in the target"
    )
    engine = tiny_qwen2.engine()
    config = replace(engine.config, draft_model="other")
    with pytest.raises(ModelLoadError, match="cannot draft for 'tiny': the draft's tokenizer has 2 tokens"):
        DraftModelProposer(config, tiny_qwen2.source, engine.max_model_len, source=draft)


def test_a_draft_cut_to_its_first_tokens_proposes_only_those_and_changes_no_token(
    tiny_qwen2: TinyModel,
) -> None:
    """draft_vocab: the draft's head keeps its first rows (rounded up to 16); the target's tokens
    are the same, and a draft equal to the target is now wrong exactly where the target picks a
    token past the cut."""
    ids = prompt(12, 3)
    plain = tiny_qwen2.greedy(ids, 30)
    engine, proposer = with_draft(tiny_qwen2, tiny_qwen2, draft_vocab=100)
    assert proposer.engine.model.lm_head.out_features == 112
    proposed: list[int] = []
    propose = proposer.propose

    def recorded(seq, limit):  # type: ignore[no-untyped-def]
        draft = propose(seq, limit)
        proposed.extend(draft)
        return draft

    proposer.propose = recorded  # type: ignore[method-assign]
    assert run_one(engine, ids, greedy(30), "cut").token_ids == plain
    assert proposed and max(proposed) < 112
    stats = engine.stats()
    assert (stats.spec_accepted_tokens == stats.spec_proposed_tokens) == all(t < 112 for t in plain)


def test_draft_vocab_zero_keeps_the_whole_head(tiny_qwen2: TinyModel) -> None:
    _, proposer = with_draft(tiny_qwen2, tiny_qwen2, draft_vocab=0)
    assert proposer.engine.model.lm_head.out_features == tiny_qwen2.source.hf_config["vocab_size"]
    with pytest.raises(InvalidRequestError, match="draft_vocab"):
        EngineConfig(draft_vocab=-1)


def test_the_draft_computes_each_prompt_chunk_beside_the_target(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
) -> None:
    """follow: the draft's prefill runs in the target's prompt steps (chunked as the target's:
    64 tokens a step here), not on the first draft after it; the tokens are plain decoding's."""
    ids = prompt(100, 8)
    plain = run_one(tiny_qwen2.engine(), ids, greedy(12), "p").token_ids
    engine, proposer = with_draft(tiny_qwen2, tiny_llama)
    engine.add_request("p", ids, greedy(12))
    results: dict[str, Result] = {}
    collect(results, engine.step())
    assert proposer.states["p"].num_computed_tokens == 64  # the target's first chunk
    collect(results, engine.step())
    assert proposer.states["p"].num_computed_tokens == 100  # its last: the draft is level with it
    while engine.has_unfinished():
        collect(results, engine.step())
    assert results["p"].token_ids == plain
    engine.add_request("short", prompt(20, 9), greedy(2))  # one token after the first: no draft
    collect(results, engine.step())
    assert "short" not in proposer.states


def test_the_engine_reports_compiling_until_the_drafts_graphs_are_built_too(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
) -> None:
    engine, proposer = with_draft(tiny_qwen2, tiny_llama)
    engine.compile_status = "ready"
    proposer.engine.compile_status = "compiling"  # the draft's background compile, still going
    assert engine.stats().compile_status == "compiling"
    chained, _ = with_draft(tiny_qwen2, tiny_llama)
    chained.compile_status = "ready"
    chained.proposer = ChainProposer(NgramProposer(3, 1, 3, chained.max_model_len), proposer)
    assert chained.stats().compile_status == "compiling"
    proposer.engine.compile_status = "ready"
    assert engine.stats().compile_status == "ready" and chained.stats().compile_status == "ready"
    engine.compile_status = "failed"  # the target's own state otherwise
    assert engine.stats().compile_status == "failed"
