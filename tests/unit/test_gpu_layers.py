"""The CUDA path's Triton kernels and layers, run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1): each kernel against a float64 reference, each output row the same
whatever else is in its batch, and a tiny model served through the engine with the CUDA
layers swapped in (models/device_kernels.py) against the CPU layers' logits, with a
request's tokens and logprobs bit-identical solo, in a batch, chunked and from the prefix
cache. tests/gpu/ runs the same on a GPU, in bfloat16 (the interpreter rounds bf16 by
truncation and its bf16 dot is wrong, so here the dtype is float32).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no GPU
    pytest.skip("Triton's interpreter is off (a GPU is here: tests/gpu/ runs these)", allow_module_level=True)

from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.models import build as build_module  # noqa: E402
from argosy.models.device_kernels import apply_cuda_kernels  # noqa: E402
from argosy.ops import triton_kernels as tk  # noqa: E402
from argosy.ops.gpu_layers import TritonPagedAttention  # noqa: E402
from argosy.sampling_params import SamplingParams  # noqa: E402
from tests.unit.conftest import TinyModel, prefill_logits  # noqa: E402


def test_matmul_is_the_float64_product() -> None:
    """(Not bit for bit per row here: the interpreter's tl.dot is numpy's BLAS, whose rounding
    depends on a row's place in its tile; the GPU's MMA does not, which tests/gpu checks.)"""
    torch.manual_seed(0)
    x, w = torch.randn(37, 100), torch.randn(70, 100)  # neither a multiple of a tile
    assert torch.allclose(tk.matmul(x, w).double(), x.double() @ w.double().T, atol=1e-4)


def _q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.1).half()
    m = (-torch.rand(n, k // 32)).half()
    values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, k).double()
    weight = values * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    return codes, d, m, weight


def test_q4_matmul_unpacks_the_gguf_blocks_exactly() -> None:
    torch.manual_seed(1)
    codes, d, m, weight = _q4(48, 96)
    x = torch.randn(19, 96)
    y = tk.q4_matmul(x, codes, d, m)
    assert torch.allclose(y.double(), x.double() @ weight.T, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 32"):
        tk.q4_matmul(torch.randn(2, 40), codes[:, :20], d[:, :1], m[:, :1])


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_the_torch_forms(gemma: bool) -> None:
    torch.manual_seed(2)
    x, w = torch.randn(9, 50), torch.randn(50)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = h * (1.0 + w) if gemma else w * h
    y = tk.rms_norm(x, w, 1e-6, gemma)
    assert torch.allclose(y, expected, atol=1e-5)
    assert torch.equal(tk.rms_norm(x[4:6], w, 1e-6, gemma), y[4:6])


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """One row: q [H, D] over positions lo..hi-1 of k, v [L, KVH, D], in float64."""
    group = q.shape[0] // k.shape[1]
    keys = k[lo:hi].double().repeat_interleave(group, 1)
    values = v[lo:hi].double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * q.shape[-1] ** -0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense_attention_over_each_rows_blocks(window: int | None) -> None:
    torch.manual_seed(3)
    block, heads, kv_heads, dim = 4, 6, 2, 16
    k_cache, v_cache = torch.randn(12 * block, kv_heads, dim), torch.randn(12 * block, kv_heads, dim)
    table = torch.tensor([7, 2, 9, 0, 4])  # the sequence's blocks, out of order in the cache
    slots = (table.unsqueeze(1) * block + torch.arange(block)).view(-1)
    lens = torch.tensor([1, 3, 4, 5, 11, 17, 20])
    q = torch.randn(len(lens), heads, dim)
    out = tk.paged_attention(q, k_cache, v_cache, table.expand(len(lens), -1), lens, block, dim**-0.5, window)
    for row, length in enumerate(lens.tolist()):
        lo = 0 if window is None else max(0, length - window)
        expected = _dense_attention(q[row], k_cache[slots], v_cache[slots], lo, length)
        assert torch.allclose(out[row].double(), expected, atol=1e-5), row
        alone = tk.paged_attention(
            q[row : row + 1],
            k_cache,
            v_cache,
            table.unsqueeze(0),
            lens[row : row + 1],
            block,
            dim**-0.5,
            window,
        )
        assert torch.equal(alone[0], out[row])


@pytest.fixture
def cuda_layers_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine loads its model with the CUDA layers on the CPU (interpreted kernels)."""
    monkeypatch.setitem(build_module.DEVICE_KERNELS, "cpu", apply_cuda_kernels)


@pytest.fixture
def row_stable_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tl.dot rounds a row by its place in the tile (numpy's BLAS): for the
    engine-level invariance checks the matmuls are float64 products rounded once, which are
    the same for a row wherever it sits, as the kernels are on a GPU (tests/gpu)."""

    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x.double() @ weight.double().T).to(x.dtype)

    def q4_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape[0], 2 * codes.shape[1]
        values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, k).double()
        weight = values * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
        return matmul(x, weight)

    monkeypatch.setattr(tk, "matmul", matmul)
    monkeypatch.setattr(tk, "q4_matmul", q4_matmul)


def _engine(tiny: TinyModel, **options: object) -> LLMEngine:
    return tiny.engine(max_num_batched_tokens=options.pop("budget", 64), **options)


def test_the_model_swaps_every_layer_and_matches_the_cpu_layers(
    tiny_llama: TinyModel, cuda_layers_on_cpu: None
) -> None:
    engine = _engine(tiny_llama)
    assert engine.runner.per_row_attention
    assert all(isinstance(layer.self_attn.backend, TritonPagedAttention) for layer in engine.model.layers)
    kinds = {type(m).__name__ for m in engine.model.modules()}
    assert {"TritonLinear", "TritonRMSNorm"} <= kinds and not kinds & {"Linear", "RMSNorm"}
    assert "Triton kernels" in engine.weights
    prompt = [random.Random(4).randrange(300) for _ in range(11)]
    reference = tiny_llama.logits(prompt)
    tokens, logprobs = _generate(engine, [prompt], max_tokens=1)[0]
    assert tokens == [int(reference[-1].argmax())]
    expected = torch.log_softmax(reference[-1], -1)[tokens[0]].item()
    assert logprobs[0][0] == pytest.approx(expected, abs=1e-4)


Result = tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]


def _generate(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 4, seed: int | None = None
) -> list[Result]:
    names = [f"r{random.random()}" for _ in prompts]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if seed is None else 0.9,
        seed=seed,
        ignore_eos=True,
        logprobs=3,
        detokenize=False,
    )
    for name, prompt in zip(names, prompts, strict=True):
        engine.add_request(name, prompt, params)
    results: dict[str, Result] = {name: ([], []) for name in names}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, lps = results[out.request_id]
            tokens.extend(out.new_token_ids)
            lps.extend((lp.logprob, lp.top) for lp in out.new_logprobs or [])
    return [results[name] for name in names]


def test_a_request_is_bit_identical_solo_batched_chunked_and_cached(
    tiny_llama: TinyModel, cuda_layers_on_cpu: None, row_stable_matmuls: None
) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(300) for _ in range(21)]
    others = [[rng.randrange(300) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    engine = _engine(tiny_llama)
    solo = _generate(engine, [prompt], seed=7)[0]
    assert _generate(engine, [prompt], seed=7)[0] == solo  # a prefix-cache hit now
    assert engine.stats().prefix_cache_hits > 0
    assert _generate(engine, [*others, prompt], seed=7)[-1] == solo  # in a batch
    chunked = _engine(tiny_llama, budget=16, block_size=4, enable_prefix_caching=False)
    assert _generate(chunked, [prompt], seed=7)[0] == solo  # prefilled in chunks of 4


def test_a_tied_head_stays_tied_and_its_logprobs_match(
    tiny_qwen2: TinyModel, cuda_layers_on_cpu: None
) -> None:
    """qwen2 ties its head to the embedding: the head's TritonLinear holds the same parameter."""
    engine = _engine(tiny_qwen2)
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight
    prompt = [random.Random(6).randrange(300) for _ in range(9)]
    expected = torch.log_softmax(tiny_qwen2.logits(prompt)[-1], -1)
    _, logprobs = _generate(engine, [prompt], max_tokens=1)[0]
    for token, logprob in logprobs[0][1]:
        assert logprob == pytest.approx(expected[token].item(), abs=1e-4)
    with pytest.raises(ValueError, match="per-row"):  # the CPU backend's chunk form is refused
        prefill_logits(engine, prompt)


def test_greedy_rows_take_their_argmax_where_the_logits_are(
    tiny_llama: TinyModel, cuda_layers_on_cpu: None, row_stable_matmuls: None
) -> None:
    """The accelerator's fast path (only token ids cross to the host) picks the sampler's tokens;
    rows that report logprobs or are sampled still go through the sampler."""
    from argosy.sampling_params import SamplingParams as Params

    rng = random.Random(8)
    batch = [[rng.randrange(300) for _ in range(rng.randrange(4, 20))] for _ in range(4)]

    def run(on_device: bool) -> list[list[int]]:
        engine = _engine(tiny_llama)
        engine.runner.greedy_on_device = on_device
        plain = Params(max_tokens=5, temperature=0.0, ignore_eos=True, detokenize=False)
        sampled = Params(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True, detokenize=False)
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, sampled if i == 3 else plain)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return list(tokens.values())

    assert run(on_device=True) == run(on_device=False)
