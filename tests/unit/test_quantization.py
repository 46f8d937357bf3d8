"""Weight-only quantization: the GGUF's own Q4 blocks (int4) and per-channel int8.

In float32 the int4 path multiplies by exactly the file's weights (codes, scales and mins are
exact there), so its logits equal the dequantized model's; in bfloat16 scales round, so only
closeness is pinned. int8 requantizes, so it is pinned by closeness too.
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
from argosy.models.quantized_linear import Int4Linear, Int8Linear
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
    layer = Int4Linear(packed, d, m, bias, torch.float32)
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_int8_linear_is_close_to_its_float_weights() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(3, 64)
    layer = Int8Linear(weight, None, torch.float32)
    assert (layer(x) - x @ weight.T).abs().max() < 0.05 * (x @ weight.T).abs().max()


def _mean_logprob(quantization: str, dtype: str) -> tuple[torch.Tensor, float]:
    engine = LLMEngine(
        EngineConfig(
            model="smollm2", dtype=dtype, quantization=quantization, compile="off", kv_cache_memory=1 << 24
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
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_bf16_quantized_mean_logprob_is_close_to_bf16(mode: str) -> None:
    _, ref_lp = _mean_logprob("none", "bfloat16")
    _, lp = _mean_logprob(mode, "bfloat16")
    print(f"mean logprob bf16 {ref_lp:.4f} {mode} {lp:.4f}")
    assert abs(lp - ref_lp) < 0.05
