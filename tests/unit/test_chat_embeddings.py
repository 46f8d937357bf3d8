"""Embeddings from a chat model: pooling requests through the chat engine's own scheduler.

A pooling request is a prefill-only sequence; its vector is the mean of the last norm's output
over every input token, L2-normalised (transformers: `model.model(ids).last_hidden_state`
averaged). On the tiny random checkpoints (fp32) it must equal transformers' to float32
rounding through everything the scheduler does to a prompt: chunked prefill, batching with
generations, preemption and recompute, a prefix cache holding its blocks, speculative decoding.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from argosy.config import ModelSpec
from argosy.engine.async_engine import AsyncEngine
from argosy.engine.llm_engine import LLMEngine
from argosy.errors import ContextLengthExceededError, InvalidRequestError
from argosy.runner.kv_cache import kv_bytes_per_block
from argosy.runner.pooler import MeanPooler
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import TINY_VOCAB, TinyModel


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB, (length,), generator=g).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


@torch.inference_mode()
def reference(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    """transformers' base model: last_hidden_state (after the final norm), mean, L2-normalised."""
    hidden = tiny.reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)


def run(
    engine: LLMEngine,
    pools: dict[str, list[int]],
    generations: dict[str, tuple[list[int], SamplingParams]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Everything added at once, stepped to the end: (vectors, generated tokens)."""
    for request_id, (ids, params) in (generations or {}).items():
        engine.add_request(request_id, ids, params)
    for request_id, ids in pools.items():
        engine.add_pooling_request(request_id, ids)
    vectors: dict[str, torch.Tensor] = {}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in generations or {}}
    while engine.has_unfinished():
        for out in engine.step():
            if request_id_is_pool := out.request_id in pools:
                assert out.finished and out.finish_reason == "stop" and out.embedding is not None
                assert out.num_prompt_tokens == len(pools[out.request_id]) and not out.new_token_ids
                assert out.request_id not in vectors, "a pooled output twice"
                vectors[out.request_id] = torch.tensor(out.embedding)
            assert request_id_is_pool or out.embedding is None
            if not request_id_is_pool:
                tokens[out.request_id].extend(out.new_token_ids)
    assert set(vectors) == set(pools)
    return vectors, tokens


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks)
    assert engine.sequences == {} and len(engine.runner.pooler) == 0


def test_pooled_vectors_equal_transformers_mean_of_the_last_hidden_state(tiny: TinyModel) -> None:
    engine = tiny.engine()  # 64 tokens a step: the 150-token input is pooled over three chunks
    pools = {"one": prompt(1, 1), "short": prompt(37, 2), "chunked": prompt(150, 3)}
    vectors, _ = run(engine, pools)
    for name, ids in pools.items():
        expected = reference(tiny, ids)
        torch.testing.assert_close(vectors[name], expected, atol=2e-6, rtol=0)
        assert vectors[name].norm().item() == pytest.approx(1.0, abs=1e-6)
    assert_all_blocks_free(engine)


def test_pooling_batches_with_generation_and_changes_neither(tiny_llama: TinyModel) -> None:
    generations = {f"g{i}": (prompt(9 + 11 * i, 40 + i), greedy(12)) for i in range(3)}
    pools = {f"p{i}": prompt(20 + 30 * i, 50 + i) for i in range(3)}
    _, alone_tokens = run(tiny_llama.engine(), {}, generations)
    alone_vectors, _ = run(tiny_llama.engine(), pools)
    engine = tiny_llama.engine()
    vectors, tokens = run(engine, pools, generations)
    assert tokens == alone_tokens
    assert tokens["g0"] == tiny_llama.greedy(generations["g0"][0], 12)
    for name in pools:
        torch.testing.assert_close(vectors[name], alone_vectors[name], atol=2e-6, rtol=0)
    assert_all_blocks_free(engine)


def test_pooling_takes_no_prefix_cache_hit_and_leaves_its_blocks_cached(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    ids = prompt(70, 7)
    run(engine, {}, {"warm": (ids + [1], greedy(2))})  # caches the blocks of ids
    hits = engine.stats().prefix_cache_hits
    vectors, _ = run(engine, {"pool": ids})
    torch.testing.assert_close(vectors["pool"], reference(tiny_llama, ids), atol=2e-6, rtol=0)
    assert engine.stats().prefix_cache_hits == hits  # every token computed, none skipped
    assert engine.block_manager.probe_cached_prefix(ids + [1]) == 64  # still cached


def test_preempted_pooling_requests_recompute_to_the_same_vectors(tiny: TinyModel) -> None:
    cfg = tiny.reference.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = kv_bytes_per_block(
        cfg.num_hidden_layers, 16, cfg.num_key_value_heads, head_dim, torch.float32
    )
    generations = {f"g{i}": (prompt(18 + 3 * i, 300 + i), greedy(24)) for i in range(4)}
    pools = {f"p{i}": prompt(90 + 10 * i, 400 + i) for i in range(3)}
    roomy, roomy_tokens = run(tiny.engine(), pools, generations)
    tight_engine = tiny.engine(kv_cache_memory=10 * per_block)
    tight, tight_tokens = run(tight_engine, pools, generations)
    assert tight_engine.stats().num_preemptions > 0
    assert tight_tokens == roomy_tokens
    for name, ids in pools.items():
        torch.testing.assert_close(tight[name], roomy[name], atol=2e-6, rtol=0)
        torch.testing.assert_close(tight[name], reference(tiny, ids), atol=2e-6, rtol=0)
    assert_all_blocks_free(tight_engine)


def test_a_pooling_request_never_carries_a_draft(tiny_llama: TinyModel) -> None:
    """65 tokens at 64 a step: its last chunk is one token, a 'decode' the n-gram proposer
    would draft for (a repeated pattern it matches) — a pooling request computes its input only
    (the scheduler asks no draft for it, and its one-token max_tokens leaves a draft no room)."""
    ids = ([5, 6, 7, 8] * 17)[:65]
    engine = tiny_llama.engine(speculative="ngram", ngram_min=1, ngram_max=3)
    vectors, _ = run(engine, {"pool": ids})
    torch.testing.assert_close(vectors["pool"], reference(tiny_llama, ids), atol=2e-6, rtol=0)
    assert engine.stats().spec_proposed_tokens == 0
    assert_all_blocks_free(engine)


def test_bad_pooling_requests_raise_typed_errors(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(max_model_len=128)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_pooling_request("empty", [])
    with pytest.raises(ContextLengthExceededError) as too_long:
        engine.add_pooling_request("long", prompt(129, 1))
    assert too_long.value.param == "input" and "128" in too_long.value.message
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_pooling_request("vocab", [TINY_VOCAB])
    with pytest.raises(InvalidRequestError, match="pooling"):
        engine.add_pooling_request("cls", [1, 2], pooling="cls")
    vectors, _ = run(engine, {"whole-context": prompt(128, 2)})  # the whole context is allowed
    assert vectors["whole-context"].shape == (tiny_llama.reference.config.hidden_size,)
    assert_all_blocks_free(engine)


def test_the_pooler_restarts_its_sum_at_token_zero_and_refuses_non_finite_values() -> None:
    pooler = MeanPooler()
    pooler.add("r", 0, torch.tensor([[1.0, 0.0], [9.0, 9.0]]))
    pooler.add("r", 0, torch.tensor([[3.0, 0.0], [1.0, 0.0]]))  # recomputed after a preemption
    pooler.add("r", 2, torch.tensor([[0.0, 4.0]]))
    assert pooler.finish("r", 3) == pytest.approx([0.7071068, 0.7071068])
    pooler.add("nan", 0, torch.tensor([[math.nan, 1.0]]))
    assert pooler.finish("nan", 1) is None
    pooler.add("gone", 0, torch.ones(1, 2))
    pooler.release("gone")
    assert len(pooler) == 0


def test_async_engine_embeds_a_batch_beside_generations(tiny_qwen2: TinyModel) -> None:
    inputs = [prompt(10 + 40 * i, 600 + i) for i in range(3)]
    generation = prompt(12, 700)
    engine = AsyncEngine(tiny_qwen2.engine())

    async def generate() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(generation, greedy(16)):
            tokens.extend(out.new_token_ids)
        return tokens

    async def main() -> tuple[list[int], list[list[float]], list[list[float]]]:
        tokens, outputs = await asyncio.gather(generate(), engine.embed(inputs))
        again = await engine.embed([inputs[1]])
        with pytest.raises(InvalidRequestError):  # a bad input fails its call, not the engine
            await engine.embed([inputs[0], []])
        cancelled = asyncio.create_task(engine.embed([prompt(200, 5)] * 4))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return tokens, [o.embedding or [] for o in outputs], [o.embedding or [] for o in again]

    try:
        tokens, vectors, again = asyncio.run(main())
        assert tokens == tiny_qwen2.greedy(generation, 16)
        for ids, vector in zip(inputs, vectors, strict=True):
            torch.testing.assert_close(torch.tensor(vector), reference(tiny_qwen2, ids), atol=2e-6, rtol=0)
        assert again[0] == pytest.approx(vectors[1], abs=2e-6)
        deadline = asyncio.run(_settled(engine))
        assert deadline and engine.num_in_flight() == 0
        assert_all_blocks_free(engine.engine)
    finally:
        engine.shutdown()


async def _settled(engine: AsyncEngine) -> bool:
    """The engine thread has handled the aborts of a cancelled batch (bounded wait)."""
    for _ in range(200):
        if not engine.engine.has_unfinished():
            return True
        await asyncio.sleep(0.01)
    return False


def test_embedding_routes_resolve_embedding_models_first_then_chat_models() -> None:
    from argosy.core.registry import ModelRegistry  # the core, here alone: the rest is the engine's

    def load(spec: ModelSpec) -> object:
        raise AssertionError("resolving loads nothing")

    kinds = ("embedding", "chat")
    chat_only = ModelRegistry([ModelSpec("chat", "smollm2")], load)  # type: ignore[arg-type]
    assert chat_only.resolve(None, kinds).spec.id == "chat"
    assert chat_only.resolve("chat", kinds).spec.id == "chat"
    both = ModelRegistry(
        [ModelSpec("chat", "smollm2"), ModelSpec("minilm", "minilm", kind="embedding")],
        load,  # type: ignore[arg-type]
    )
    assert both.resolve(None, kinds).spec.id == "minilm"
    speech = ModelRegistry([ModelSpec("voice", "piper", kind="speech")], load)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as wrong:
        speech.resolve("voice", kinds)
    assert wrong.value.param == "model" and wrong.value.code == "wrong_model_kind"
    assert "needs an embedding or chat model" in wrong.value.message
    with pytest.raises(InvalidRequestError, match="serves no embedding or chat model"):
        speech.resolve(None, kinds)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pooling_on_cuda_matches_transformers(tiny_llama: TinyModel) -> None:
    """The CUDA layers (per-row attention, Triton kernels): hidden rows pooled on the GPU."""
    engine = tiny_llama.engine(device="cuda")
    generations = {"g": (prompt(12, 1), greedy(8))}
    pools = {"one": prompt(1, 4), "short": prompt(37, 2), "chunked": prompt(150, 3)}
    vectors, tokens = run(engine, pools, generations)
    for name, ids in pools.items():
        cosine = float(vectors[name] @ reference(tiny_llama, ids))
        print(f"cuda {name}: cosine {cosine:.8f}")
        assert cosine >= 0.9999
    assert len(tokens["g"]) == 8
    assert_all_blocks_free(engine)
