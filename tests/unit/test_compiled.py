"""The compiled decode path (EngineConfig.compile="wait") computes what the eager path does.

torch.compile of the tiny models takes ~10-30 s per engine, so the engines here are few and
each one is asked a lot: a mixed batch (prefill chunks beside decodes, seeded sampling,
logprobs, penalties), speculative drafts verified as decode rows, and preemption.
"""

from __future__ import annotations

import gc
import itertools
import shutil
import time
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from argosy.engine.llm_engine import COMPILE_AFTER_QUIET_S, LLMEngine
from argosy.ops.attention import grouped_decode_attention
from argosy.ops.composite_linear import BatchSwitchLinear
from argosy.ops.native import load_native_ops
from argosy.ops.packed_linear import PackedLinear, apply_packing, packing_supported
from argosy.runner.compiled import paged_decode_attention
from argosy.runner.kv_cache import kv_bytes_per_block
from argosy.runner.model_runner import DECODE_CHUNK_TOKENS, ModelRunner
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import TinyModel
from tests.unit.test_engine import Result, assert_all_blocks_free, collect, greedy, prompt, run
from tests.unit.test_spec_decode import SPEC, draft_prone_prompt


def mixed_requests(tiny: TinyModel) -> dict[str, tuple[list[int], SamplingParams]]:
    requests: dict[str, tuple[list[int], SamplingParams]] = {
        f"g{i}": (prompt(5 + 7 * i, seed=40 + i), greedy(24)) for i in range(5)
    }
    requests["long"] = (prompt(150, seed=50), greedy(12))  # chunked prefill beside decodes
    requests["pen"] = (prompt(20, seed=51), greedy(24, repetition_penalty=1.3, presence_penalty=0.3))
    requests["lp"] = (prompt(9, seed=52), greedy(16, logprobs=3))
    requests["seeded"] = (
        prompt(11, seed=53),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, detokenize=False),
    )
    requests["drafty"] = (draft_prone_prompt(tiny, 3), greedy(32))
    return requests


def test_compiled_steps_equal_eager_steps(tiny: TinyModel) -> None:
    requests = mixed_requests(tiny)
    eager = run(tiny.engine(), requests)
    engine = tiny.engine(compile="wait", **SPEC)
    assert engine.compiled and engine.runner.compiled is not None
    compiled = run(engine, requests)
    assert engine.runner.num_compiled_steps > 10  # decode-only steps went through the graph
    assert engine.stats().spec_accepted_tokens > 0  # drafts were verified there too
    for rid in requests:
        assert compiled[rid].token_ids == eager[rid].token_ids, rid
    for got, want in zip(compiled["lp"].logprobs, eager["lp"].logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    # a prompt of a few tokens (a draft model's catch-up is such a chunk) runs as decode rows:
    # every step of this request, its prompt's included, goes through the graph
    short = {"short": (prompt(DECODE_CHUNK_TOKENS, seed=54), greedy(12))}
    before, steps = engine.runner.num_compiled_steps, 0
    engine.add_request("short", *short["short"])
    results: dict[str, Result] = {}
    while engine.has_unfinished():
        collect(results, engine.step())
        steps += 1
    assert engine.runner.num_compiled_steps - before == steps
    assert results["short"].token_ids == run(tiny.engine(), short)["short"].token_ids
    assert_all_blocks_free(engine)


def test_a_background_compile_serves_eagerly_then_switches_between_steps(tiny_llama: TinyModel) -> None:
    """compile="on": the engine takes requests at once, with eager steps, while a low-priority
    thread builds the graphs; once they are all built the next steps run them, and the
    tokens are the ones eager steps give."""
    requests = {f"q{i}": (prompt(9 + 4 * i, seed=700 + i), greedy(24)) for i in range(3)}
    eager = run(tiny_llama.engine(), requests)
    engine = tiny_llama.engine(compile="on")
    assert engine.stats().compile_status == "compiling"
    during = run(engine, requests)  # served while compiling (or just after, on a warm cache)
    assert engine._compile_thread is not None
    engine._compile_thread.join(timeout=600)
    stats = engine.stats()
    assert stats.compile_status == "ready" and engine.compiled and stats.compiled_graphs >= 1
    steps_before = engine.runner.num_compiled_steps
    after = run(engine, requests)
    assert engine.runner.num_compiled_steps > steps_before  # the graphs serve now
    for rid in requests:
        assert during[rid].token_ids == eager[rid].token_ids == after[rid].token_ids, rid
    assert_all_blocks_free(engine)


def test_the_background_compile_waits_until_the_engine_is_quiet(
    tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile (dynamo's import and tracing hold the GIL for seconds) starts once no
    request is in the engine and none came nor any step ran for COMPILE_AFTER_QUIET_S: the
    first requests of a start are not served beside it."""
    seen: list[tuple[bool, float]] = []
    engines: list[LLMEngine] = []

    def compile_decode(self: ModelRunner, row_counts: list[int], stop: object = None) -> bool:
        engine = engines[0]
        seen.append((engine.has_unfinished(), time.monotonic() - engine._last_busy))
        return False

    monkeypatch.setattr(ModelRunner, "compile_decode", compile_decode)
    engines.append(engine := tiny_llama.engine(compile="on"))
    run(engine, {f"q{i}": (prompt(9 + 4 * i, seed=720 + i), greedy(24)) for i in range(3)})
    assert engine._compile_thread is not None
    engine._compile_thread.join(timeout=60)
    assert len(seen) == 1
    unfinished, quiet_for = seen[0]
    assert not unfinished and quiet_for >= COMPILE_AFTER_QUIET_S
    assert engine.stats().compile_status == "failed"  # what the stand-in said


def test_compiled_graphs_are_cached_under_the_native_sources_digest(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    """torch's compile caches key a graph by its own code, not by the native ops it calls: a
    graph cached before those ops changed would call them the old way. The digest of their
    sources goes into every key, and a changed source changes it."""
    from argosy.ops import native
    from argosy.runner.compiled import CompiledDecoder

    engine = tiny_llama.engine()
    CompiledDecoder(engine.model, block_size=16)
    digest = native.native_sources_digest()
    assert torch.compiler.config.cache_key_tag == digest and digest.startswith("argosy-native-")
    copy = shutil.copytree(native._CSRC, tmp_path / "csrc")
    assert native.native_sources_digest(copy) == digest
    source = copy / "iq_linear.cpp"
    source.write_text(source.read_text() + "\n")
    assert native.native_sources_digest(copy) != digest


def test_a_background_compile_stops_when_the_engine_closes(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(compile="on")
    engine.stop_compiling(timeout=600)
    assert engine.stats().compile_status in ("stopped", "ready")  # ready: it beat the stop
    assert engine._compile_thread is not None and not engine._compile_thread.is_alive()


def test_compiled_steps_under_preemption(tiny_llama: TinyModel) -> None:
    cfg = tiny_llama.reference.config
    per_block = kv_bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, 16, torch.float32)
    requests = {f"q{i}": (prompt(18 + 3 * i, seed=300 + i), greedy(32)) for i in range(6)}
    roomy = run(tiny_llama.engine(), requests)
    engine = tiny_llama.engine(compile="wait", kv_cache_memory=9 * per_block)
    assert engine.num_blocks == 9
    tight = run(engine, requests)
    assert engine.stats().num_preemptions > 0
    assert engine.runner.num_compiled_steps > 0
    assert {r: t.token_ids for r, t in tight.items()} == {r: t.token_ids for r, t in roomy.items()}
    assert_all_blocks_free(engine)


class _Cycle:
    """Garbage only the cycle collector frees: a pair referring to each other, one of them in a
    WeakSet (whose weakref callback runs as a Python frame when the pair is collected)."""

    watched: weakref.WeakSet[_Cycle] = weakref.WeakSet()

    def __init__(self) -> None:
        self.partner = _Cycle.__new__(_Cycle)
        self.partner.partner = self
        _Cycle.watched.add(self)


def test_garbage_collection_during_a_compiled_step_and_a_failing_graph(tiny_llama: TinyModel) -> None:
    """Found by the 30-minute soak: a collection inside the compiled call ran a weakref callback
    under dynamo's frame hook, whose skip-guard stance refused it and failed the whole step.
    Here every compiled step leaves one collectable cycle and a collection threshold that
    falls at a different allocation inside the call; the steps must still give the eager
    tokens, with no fallback needed, through both calls of a warm graph (direct and dynamo's
    guarded one). Then a graph that raises: that step reruns eagerly."""
    requests = {f"c{i}": (prompt(5 + 7 * i, seed=60 + i), greedy(40)) for i in range(3)}
    eager = run(tiny_llama.engine(), requests)
    engine = tiny_llama.engine(compile="wait")
    compiled = engine.runner.compiled
    assert compiled is not None
    run_warm, threshold, calls = compiled._run_warm, gc.get_threshold(), itertools.count()

    def collect_inside(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gc.set_threshold(100_000, *threshold[1:])
        gc.collect()
        _Cycle()
        gc.set_threshold(gc.get_count()[0] + 1 + next(calls) % 60, *threshold[1:])
        try:
            return run_warm(args)
        finally:
            gc.set_threshold(*threshold)

    compiled._run_warm = collect_inside  # type: ignore[method-assign]
    # every object alive now (torch's, the compiled graphs') out of the collector's sight: each
    # step's collection then walks what the test made since, not the whole process (~4x faster)
    gc.freeze()
    try:
        for direct in (True, False):
            if not direct:  # dynamo's guarded call, as when the direct one is not found
                compiled._find_direct = lambda args: None  # type: ignore[method-assign]
            compiled._direct.clear()
            assert {r: o.token_ids for r, o in run(engine, requests).items()} == {
                r: o.token_ids for r, o in eager.items()
            }
            assert next(calls) > 30 and compiled.num_eager_fallbacks == 0
            assert bool(compiled._direct) == direct
    finally:
        gc.unfreeze()

    def broken(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise RuntimeError("torch.compile with fullgraph=True found no compiled frames")

    compiled._run_warm, steps_before = broken, engine.runner.num_compiled_steps  # type: ignore[method-assign]
    assert {r: o.token_ids for r, o in run(engine, requests).items()} == {
        r: o.token_ids for r, o in eager.items()
    }
    assert compiled.num_eager_fallbacks == engine.runner.num_compiled_steps - steps_before > 30
    assert_all_blocks_free(engine)


def test_paged_decode_attention_writes_the_cache_then_attends() -> None:
    torch.manual_seed(0)
    block_size, blocks, kv_heads, heads, dim = 4, 6, 2, 4, 8
    k_cache = torch.randn(blocks * block_size, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    q, k, v = torch.randn(2, heads, dim), torch.randn(2, kv_heads, dim), torch.randn(2, kv_heads, dim)
    tables = torch.tensor([[3, 1], [5, 0]])
    positions = torch.tensor([6, 2])  # row 0: block 1 slot 2; row 1: block 5 slot 2
    slots = torch.tensor([1 * block_size + 2, 5 * block_size + 2])
    mask = (torch.arange(2 * block_size).unsqueeze(0) <= positions.unsqueeze(1)).view(2, 1, 1, -1)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[slots], expected_v[slots] = k, v
    out = paged_decode_attention(q, k, v, k_cache, v_cache, slots, tables.view(-1), mask, block_size)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for row in range(2):  # reference: plain attention with repeated K/V heads
        ctx_slots = (tables[row].unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)
        ctx_slots = ctx_slots[: int(positions[row]) + 1]
        keys = expected_k[ctx_slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = expected_v[ctx_slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = (q[row].unsqueeze(1) @ keys.transpose(1, 2)) * dim**-0.5  # [H, 1, ctx]
        want = (scores.softmax(-1) @ values).reshape(-1)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)
    eager = grouped_decode_attention(q, k_cache, v_cache, tables.view(-1), mask, block_size)
    torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_paged_decode_equals_the_python_op(dtype: torch.dtype) -> None:
    """The C++ op (argosy/ops/csrc/paged_decode.cpp) is built on this machine and computes
    what the Python op does: the same cache writes (bit-exact) and the same attention (fp32
    accumulation in both; bf16 differs by output rounding only). Rows cover one block, many
    blocks, a grouped-query ratio of 3, padding blocks masked out and unordered block ids."""
    assert load_native_ops(), "the native ops did not build (see the log)"
    torch.manual_seed(1)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    lengths = torch.tensor([1, 17, 200, 64, 33])
    max_blocks = int((lengths.max() + block_size - 1) // block_size) + 1
    num_blocks = len(lengths) * max_blocks + 1
    tables = torch.randperm(num_blocks)[: len(lengths) * max_blocks].view(len(lengths), max_blocks)
    positions = lengths - 1
    slots = tables[torch.arange(len(lengths)), positions // block_size] * block_size + positions % block_size
    mask = (torch.arange(max_blocks * block_size).unsqueeze(0) < lengths.unsqueeze(1)).view(
        len(lengths), 1, 1, -1
    )
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(lengths), heads, dim, dtype=dtype)
    k, v = (
        torch.randn(len(lengths), kv_heads, dim, dtype=dtype),
        torch.randn(len(lengths), kv_heads, dim, dtype=dtype),
    )
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    want = paged_decode_attention(q, k, v, *caches[0], slots, tables.view(-1), mask, block_size)
    got = torch.ops.argosy_ext.paged_decode(q, k, v, *caches[1], slots, tables.view(-1), mask, block_size)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_native_paged_decode_rejects_bad_slots() -> None:
    assert load_native_ops()
    cache = torch.zeros(32, 1, 8)
    q, kv = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.argosy_ext.paged_decode(
            q, kv, kv, cache, cache.clone(), torch.tensor([32]), torch.tensor([0]), mask, 16
        )
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.argosy_ext.paged_decode(
            q, kv, kv, cache, cache.clone(), torch.tensor([0]), torch.tensor([2]), mask, 16
        )


@pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_runs_the_native_op_and_releases_its_weight() -> None:
    assert load_native_ops()
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    layer = PackedLinear(weight, bias)
    assert layer.op is torch.ops.argosy_ext.packed_linear
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    assert torch.equal(layer(x), expected)
    key = layer.key
    del layer
    with pytest.raises(RuntimeError, match="no packed weight under key"):
        torch.ops.argosy_ext.packed_linear(x, key, 40, None)


def test_batch_switch_linear_picks_by_rows() -> None:
    small, large = nn.Linear(8, 3, bias=False), nn.Linear(8, 3, bias=False)
    layer = BatchSwitchLinear(small, large, max_small_rows=4)
    for rows, chosen in ((1, small), (4, small), (5, large), (64, large)):
        x = torch.randn(rows, 8)
        assert torch.equal(layer(x), chosen(x))


@pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_equals_linear_in_bf16() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    expected = {rows: torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 3, 40)}
    wanted = {rows: model(x) for rows, x in expected.items()}
    assert apply_packing(model) == 2
    assert all(isinstance(m, PackedLinear) for m in model)
    for rows, x in expected.items():
        torch.testing.assert_close(model(x), wanted[rows], atol=0.02, rtol=0.02)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(expected[3]), wanted[3], atol=0.02, rtol=0.02)


def test_the_one_row_graph_compiles_its_fused_kernels_for_one_thread(
    tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-row step's fused kernels (norms, RoPE, residual adds) work on a few thousand
    values: OpenMP's fork and join on each cost more than the work. The one-row graph is
    compiled with inductor's cpp.threads = 1; a graph of more rows keeps its threads."""
    from argosy.runner.compiled import CompiledDecoder

    engine = tiny_llama.engine()
    runner = engine.runner
    compiled = CompiledDecoder(engine.model, block_size=runner.block_size)
    seen: list[tuple[int, int]] = []

    def record(self: CompiledDecoder, input_ids: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        seen.append((input_ids.shape[0], torch._inductor.config.cpp.threads))
        return torch.empty(0)

    monkeypatch.setattr(CompiledDecoder, "__call__", record)
    default = torch._inductor.config.cpp.threads
    assert compiled.warm_up(runner.k_all, runner.v_all, runner.scratch_block, runner.dtype, [1, 4])
    assert seen == [(1, 1), (4, default)]
    assert torch._inductor.config.cpp.threads == default  # the setting did not outlive its graph
