"""GGUF Q4_0 / Q4_1 blocks read as they are: 4-bit codes plus a scale and a minimum per 32
weights, for weight-only int4 matmuls that use the file's own quantization (no requantizing).

A Q4_1 block is fp16 d, fp16 m, then 16 bytes: byte j holds code j (low nibble) and code
j + 16 (high nibble); weight = d * code + m. Q4_0 has no m: weight = d * (code - 8), i.e.
m = -8 d. Both are exact in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from argosy.models.gguf_tensors import _PERMUTED_MODEL_TYPES, hf_tensor_name, unpermute_rope_rows
from argosy.ops.quantized_linear import GROUP_SIZE

INT4_FILE = "argosy-int4.safetensors"
_BLOCK_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def q4_codes(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32]), or None if the tensor
    is not Q4_0/Q4_1. N = output rows, K = input columns (HF layout)."""
    block_bytes = _BLOCK_BYTES.get(tensor.tensor_type)
    if block_bytes is None:
        return None
    k, n = (int(x) for x in tensor.shape.tolist())  # GGUF lists the innermost dimension first
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // GROUP_SIZE, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    else:
        m = -8.0 * d
        packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [N, K/32, 32]
    return codes.reshape(n, k), d, m


def iter_int4_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """For every Q4 weight: `<hf name>.codes` (uint8, two codes per byte, even column in the
    low nibble), `<hf name>.d` and `<hf name>.m` — in HF row order (llama q/k un-permuted)."""
    is_permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    heads = {"q_proj": int(config["num_attention_heads"]), "k_proj": int(config["num_key_value_heads"])}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        blocks = None if name is None else q4_codes(tensor)
        if name is None or blocks is None:
            continue
        codes, d, m = blocks
        for proj, num_heads in heads.items():
            if is_permuted and f".self_attn.{proj}." in name:
                codes, d, m = (unpermute_rope_rows(a, num_heads) for a in (codes, d, m))
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        yield f"{name}.codes", np.ascontiguousarray(packed)
        yield f"{name}.d", np.ascontiguousarray(d)
        yield f"{name}.m", np.ascontiguousarray(m)
