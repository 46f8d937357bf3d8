"""The engine on an NVIDIA GPU (`--device cuda`), on random weights of SmolLM2-135M's exact shapes
(bench/gpu_models.py), in bfloat16: logits against transformers on the same weights, the
kernels against float64 references, a request bit-identical solo and in a batch of 64, chunked
and from the prefix cache, and CUDA-graph decode equal to eager. Skipped without CUDA (run by
bench/gpu_check.sh on the GPU machine; tests/unit/test_gpu_layers.py runs the same kernels in
Triton's interpreter on the CPU).
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")

Result = tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]


@functools.cache
def model_folder() -> Path:
    from bench.gpu_models import build

    folder = os.environ.get("ARGOSY_GPU_MODEL")
    return Path(folder) if folder else build(Path(tempfile.gettempdir()) / "argosy-gpu-smollm2")


def engine(**options: object):  # type: ignore[no-untyped-def]
    """A fresh engine; the ones before it must be unreferenced: each sizes its KV cache from the
    GPU's free memory (0.3 of it, less what is in use), so a live one would leave no room."""
    import gc

    from argosy.config import EngineConfig
    from argosy.engine.llm_engine import LLMEngine

    gc.collect()
    torch.cuda.empty_cache()

    values: dict[str, object] = {
        "model": str(model_folder()),
        "device": "cuda",
        "dtype": "bfloat16",
        "gpu_memory_fraction": 0.3,
        "compile": "off",
    }
    return LLMEngine(EngineConfig(**(values | options)))  # type: ignore[arg-type]


def generate(llm, prompts: list[list[int]], max_tokens: int = 16, seed: int | None = None) -> list[Result]:  # type: ignore[no-untyped-def]
    from argosy.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if seed is None else 0.9,
        seed=seed,
        ignore_eos=True,
        logprobs=5,
        detokenize=False,
    )
    names = [f"r{random.random()}" for _ in prompts]
    for name, prompt in zip(names, prompts, strict=True):
        llm.add_request(name, prompt, params)
    results: dict[str, Result] = {name: ([], []) for name in names}
    while llm.has_unfinished():
        for out in llm.step():
            tokens, lps = results[out.request_id]
            tokens.extend(out.new_token_ids)
            lps.extend((lp.logprob, lp.top) for lp in out.new_logprobs or [])
    return [results[name] for name in names]


def prompts(count: int, seed: int, low: int = 8, high: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def test_kernels_match_float64_and_rows_are_batch_invariant_in_bf16() -> None:
    from argosy.ops import triton_kernels as tk

    torch.manual_seed(0)
    x = torch.randn(300, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    y = tk.matmul(x, w)
    ref = x.double() @ w.double().T
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    for rows in ([0], [7], [17, 250], list(range(100, 164))):  # alone, in odd places, in other tiles
        assert torch.equal(tk.matmul(x[rows], w), y[rows])
    codes = torch.randint(0, 256, (1536, 288), dtype=torch.uint8, device="cuda")
    d = (torch.rand(1536, 18, device="cuda") * 0.01).half()
    m = (-torch.rand(1536, 18, device="cuda") * 0.05).half()
    values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(1536, 576).double()
    weight = values * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    q = tk.q4_matmul(x, codes, d, m)
    ref = x.double() @ weight.T
    assert (q.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert torch.equal(tk.q4_matmul(x[5:6], codes, d, m), q[5:6])
    n = tk.rms_norm(x, w[0], 1e-5)
    assert torch.equal(tk.rms_norm(x[3:4], w[0], 1e-5), n[3:4])


def test_paged_attention_matches_dense_attention() -> None:
    from argosy.ops import triton_kernels as tk

    torch.manual_seed(1)
    block, heads, kv_heads, dim = 16, 9, 3, 64
    k_cache = torch.randn(64 * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(64 * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(64, device="cuda")[:40]
    slots = (table.unsqueeze(1) * block + torch.arange(block, device="cuda")).view(-1)
    lens = torch.tensor([1, 15, 16, 17, 300, 640], device="cuda")
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=torch.bfloat16)
    out = tk.paged_attention(
        q, k_cache, v_cache, table.expand(len(lens), -1).contiguous(), lens, block, dim**-0.5
    )
    for row, length in enumerate(lens.tolist()):
        keys = k_cache[slots[:length]].double().repeat_interleave(3, 1)
        values = v_cache[slots[:length]].double().repeat_interleave(3, 1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), keys) * dim**-0.5
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        assert (out[row].double() - expected).abs().max() < 2e-2, row


def _reference_logprobs(
    folder: Path, prompts_: list[list[int]], weights: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """transformers in float32 on the GPU: the reference every dtype is judged against (a bf16
    transformers is itself 0.09-0.15 off it in logprob on these random 30-layer weights, H200,
    2026-12-04)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if weights is not None:
        with torch.no_grad():
            params = dict(reference.named_parameters())
            for name, values in weights.items():
                params[name].copy_(values.to(torch.float32))
    reference = reference.cuda()
    out = []
    for prompt in prompts_:
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1).cpu())
    return out


def _assert_close(result: Result, expected: torch.Tensor, tie: float, tolerance: float) -> None:
    tokens, logprobs = result
    # the reference's top token (or a near-tie with it), and each top-5 logprob within tolerance
    assert expected[tokens[0]] >= expected.max() - tie
    for token, logprob in logprobs[0][1]:
        assert abs(logprob - expected[token].item()) < tolerance, token


def test_logits_match_transformers_on_the_same_weights() -> None:
    batch = prompts(3, seed=2, low=20, high=120)
    expected = _reference_logprobs(model_folder(), batch)
    # float32: the same computation, to float32's rounding (measured: 0.0000 on the H200)
    exact = generate(engine(dtype="float32"), batch, max_tokens=1)
    for result, reference in zip(exact, expected, strict=True):
        _assert_close(result, reference, tie=1e-4, tolerance=1e-3)
    # bfloat16: within bf16's rounding of a 30-layer model (measured: 0.07-0.16; transformers'
    # own bf16 0.09-0.10 on the same prompts)
    for result, reference in zip(generate(engine(), batch, max_tokens=1), expected, strict=True):
        _assert_close(result, reference, tie=0.1, tolerance=0.3)


def test_a_request_is_the_same_solo_in_a_batch_of_64_chunked_and_cached() -> None:
    llm = engine(max_num_seqs=64)
    prompt = prompts(1, seed=3, low=150, high=151)[0]
    solo = generate(llm, [prompt], max_tokens=32)[0]
    assert generate(llm, [prompt], max_tokens=32)[0] == solo  # a prefix-cache hit
    others = prompts(63, seed=4)
    assert generate(llm, [*others[:31], prompt, *others[31:]], max_tokens=32)[31] == solo
    seeded = generate(llm, [prompt], max_tokens=32, seed=7)[0]
    assert generate(llm, [prompt, *others[:20]], max_tokens=32, seed=7)[0] == seeded
    del llm
    chunked = engine(max_num_batched_tokens=32, block_size=32, enable_prefix_caching=False)
    assert generate(chunked, [prompt], max_tokens=32)[0] == solo


def test_cuda_graph_decode_gives_the_eager_tokens_and_logprobs() -> None:
    batch = prompts(12, seed=5)
    eager = generate(engine(compile="off"), batch, max_tokens=24)  # dropped: engine() collects it
    graphed = engine(compile="on", max_num_seqs=16)
    assert graphed.runner.graphs is not None and graphed.compile_status == "ready"
    assert generate(graphed, batch, max_tokens=24) == eager
    assert graphed.runner.num_compiled_steps > 0


def test_q4_blocks_stay_four_bit_and_match_their_dequantized_weights(tmp_path: Path) -> None:
    """The model's projections as Q4_1 blocks (what a GGUF's Q4 converts to): served 4-bit,
    and the logprobs those of transformers holding the same blocks' values (float32), within
    bf16's rounding."""
    import shutil

    from argosy.ops.gpu_layers import TritonQ4Linear
    from bench.gpu_models import write_q4_blocks

    folder = tmp_path / "q4"
    shutil.copytree(model_folder(), folder)
    dequantized = write_q4_blocks(folder)
    llm = engine(model=str(folder), quantization="auto")
    assert sum(isinstance(m, TritonQ4Linear) for m in llm.model.modules()) == 4 * 30
    assert "int4 (GGUF Q4 blocks)" in llm.weights
    prompt = prompts(1, seed=6, low=40, high=41)[0]
    expected = _reference_logprobs(folder, [prompt], dequantized)[0]
    _assert_close(generate(llm, [prompt], max_tokens=1)[0], expected, tie=0.1, tolerance=0.3)
