"""Weight-only quantization: the GGUF's own Q4 blocks (int4) and per-channel int8.

In float32 the int4 path multiplies by exactly the file's weights (codes, scales and mins are
exact there), so its logits equal the dequantized model's; in bfloat16 scales round, so only
closeness is pinned. int8 requantizes, so it is pinned by closeness too. With --numerics
invariant (csrc/iq_linear.cpp) x is quantized to int8 per group of 32 as well: closeness.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.models.gguf_convert import open_gguf
from argosy.models.gguf_quant import q4_codes
from argosy.models.gguf_tensors import dequantize_tensor
from argosy.models.loader import MODEL_REGISTRY
from argosy.ops.quantized_linear import (
    Int4Linear,
    Int8Linear,
    invariant_qlinear,
    native_qlinear,
    q4_tiles,
    q8_tiles,
)
from tests.unit.conftest import prefill_logits

TEXT = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    "The capital of France is Paris, a city known for its art and food."
)


def test_q4_codes_rebuild_the_dequantized_weights_exactly() -> None:
    reader = open_gguf(MODEL_REGISTRY["smollm2"]())
    checked = 0
    for tensor in reader.tensors[:40]:
        blocks = q4_codes(tensor)
        if blocks is None:
            continue
        codes, d, m = blocks
        rebuilt = codes.astype(np.float32) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
        assert np.array_equal(rebuilt, dequantize_tensor(tensor)), tensor.name
        checked += 1
    assert checked > 20


def test_int4_linear_matches_its_float_weights() -> None:
    torch.manual_seed(0)
    n, k = 48, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, m = torch.rand(n, k // 32) * 0.02, -torch.rand(n, k // 32) * 0.1
    weight = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    bias = torch.randn(n)
    x = torch.randn(5, k)
    exact = x @ weight.T + bias
    # torch's int4 kernel: the file's weights exactly
    torch.testing.assert_close(Int4Linear(packed, d, m, bias, torch.float32)(x), exact, rtol=1e-5, atol=1e-5)
    invariant = Int4Linear(packed, d, m, bias, torch.float32, invariant=True)
    if invariant.invariant:  # x quantized to int8 per group of 32 (csrc/iq_linear.cpp)
        assert (invariant(x) - exact).norm() < 0.01 * exact.norm()


def test_int8_linear_is_close_to_its_float_weights() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(3, 64)
    layer = Int8Linear(weight, None, torch.float32)
    assert (layer(x) - x @ weight.T).abs().max() < 0.05 * (x @ weight.T).abs().max()


def _mean_logprob(quantization: str, dtype: str, numerics: str = "fast") -> tuple[torch.Tensor, float]:
    engine = LLMEngine(
        EngineConfig(
            model="smollm2",
            dtype=dtype,
            quantization=quantization,
            compile="off",
            kv_cache_memory=1 << 24,
            numerics=numerics,
        )
    )
    ids = engine.encode(TEXT)
    logits = prefill_logits(engine, ids)
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return logits, float(logprobs.mean())


@pytest.mark.slow
def test_int4_in_float32_equals_the_dequantized_model() -> None:
    reference, ref_lp = _mean_logprob("none", "float32")
    int4, int4_lp = _mean_logprob("int4", "float32")
    assert (int4 - reference).abs().max() < 1e-3
    assert abs(int4_lp - ref_lp) < 1e-4


@pytest.mark.slow
@pytest.mark.skipif(not invariant_qlinear(torch.float32), reason="the invariant kernels need a C++ compiler")
def test_invariant_int4_is_the_dequantized_model_up_to_its_activation_quantization() -> None:
    reference, ref_lp = _mean_logprob("none", "float32")
    int4, int4_lp = _mean_logprob("int4", "bfloat16", numerics="invariant")
    # bf16 storage (embeddings, KV cache), a float32 stream, and x quantized to int8 per group
    # of 32 as llama.cpp does (measured: mean logprob -2.0209 vs -2.0118, the same top token at
    # 31 of 32 positions)
    assert abs(int4_lp - ref_lp) < 0.02
    assert (int4.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_bf16_quantized_mean_logprob_is_close_to_bf16(mode: str) -> None:
    _, ref_lp = _mean_logprob("none", "bfloat16")
    _, lp = _mean_logprob(mode, "bfloat16")
    print(f"mean logprob bf16 {ref_lp:.4f} {mode} {lp:.4f}")
    assert abs(lp - ref_lp) < 0.05


needs_native = pytest.mark.skipif(
    not native_qlinear(torch.bfloat16), reason="the native quantized kernels need AVX-512 BF16 and AMX"
)


def _q4_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()  # fp16 values, as in GGUF
    m = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    weight = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), d, m, weight


@needs_native
@pytest.mark.parametrize(("n", "k"), [(48, 64), (32, 96)])  # an even and an odd number of groups
def test_native_q4_linear_is_the_exact_dot_product_rounded_once(n: int, k: int) -> None:
    """Exact products, fp32 sums: equal to the float64 product within the bf16 rounding of
    the result (and of x, which both sides use)."""
    packed, d, m, weight = _q4_weights(n, k, seed=n + k)
    tiles, scales, mins = q4_tiles(packed, d, m)
    for rows in (1, 2, 7, 16, 17, 33):
        x = torch.randn(rows, k).bfloat16()
        out = torch.ops.argosy_ext.q4_linear(x, tiles, scales, mins, n)
        exact = x.double() @ weight.double().T
        torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-3)


@needs_native
def test_native_q8_linear_is_the_exact_dot_product_rounded_once() -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (64, 96), dtype=torch.int8, generator=gen)
    scales = torch.rand(64, generator=gen) * 0.01
    for rows in (1, 5, 16, 20):
        x = torch.randn(rows, 96).bfloat16()
        out = torch.ops.argosy_ext.q8_linear(x, q8_tiles(codes), scales, 64)
        exact = (x.double() @ codes.double().T) * scales.double()
        torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4)


@needs_native
def test_native_quantized_ops_reject_bad_inputs() -> None:
    packed, d, m, _ = _q4_weights(32, 64, seed=1)
    tiles, scales, mins = q4_tiles(packed, d, m)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.argosy_ext.q4_linear(torch.randn(2, 64), tiles, scales, mins, 32)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.argosy_ext.q4_linear(torch.randn(2, 32).bfloat16(), tiles, scales, mins, 32)
    with pytest.raises(RuntimeError, match="outputs"):
        torch.ops.argosy_ext.q4_linear(torch.randn(2, 64).bfloat16(), tiles, scales, mins, 48)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.argosy_ext.q4_linear(torch.randn(2, 64).bfloat16(), tiles, scales.float(), mins, 32)


@needs_native
def test_bf16_int4_and_int8_layers_agree_across_row_counts() -> None:
    """One row takes torch's kernels, more rows the native ones: the same weights either way."""
    packed, d, m, weight = _q4_weights(48, 64, seed=5)
    int4 = Int4Linear(packed, d, m, None, torch.bfloat16)
    int8 = Int8Linear(weight, None, torch.bfloat16)
    assert int4.native and int8.native
    x = torch.randn(6, 64).bfloat16()
    for layer in (int4, int8):
        together = layer(x).float()
        alone = torch.cat([layer(x[i : i + 1]) for i in range(6)]).float()
        torch.testing.assert_close(together, alone, rtol=0.02, atol=0.02)
    torch.testing.assert_close(int4(x).double(), x.double() @ weight.double().T, rtol=2**-8, atol=1e-3)
