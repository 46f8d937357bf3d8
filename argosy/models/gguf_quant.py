"""GGUF blocks read as they are, for matmuls on the file's own quantization (no requantizing).

Q4_0 / Q4_1: 4-bit codes plus a scale and a minimum per 32 weights (`q4_codes`, the int4
kernels). Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K: int8 codes times a float32 scale per 32 (Q6_K:
16) weights plus, where the format has one, a minimum per 32 (`block_codes`, the int8 kernels'
form): every value of these formats is exactly that, as the gguf package dequantizes it.

A Q4_1 block is fp16 d, fp16 m, then 16 bytes: byte j holds code j (low nibble) and code
j + 16 (high nibble); weight = d * code + m. Q4_0 has no m: weight = d * (code - 8), i.e.
m = -8 d. Both are exact in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from argosy.models.gguf_file import GGUFFile, GGUFTensor
from argosy.models.gguf_tensors import _PERMUTED_MODEL_TYPES, hf_tensor_name, unpermute_rope_rows
from argosy.ops.quantized_linear import GROUP_SIZE

INT4_FILE = "argosy-int4.safetensors"
BLOCKS_FILE = "argosy-blocks.safetensors"
_BLOCK_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def q4_codes(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
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


def iter_int4_tensors(reader: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """For every Q4 weight: `<hf name>.codes` (uint8, two codes per byte, even column in the
    low nibble), `<hf name>.d` and `<hf name>.m` — in HF row order (llama q/k un-permuted)."""
    is_permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    heads = {"q_proj": int(config["num_attention_heads"]), "k_proj": int(config["num_key_value_heads"])}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
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


_Q = gguf.GGMLQuantizationType
# bytes a block, weights a scale group, where its fp16 d (and dmin) sit
_BLOCK_FORMATS: dict[gguf.GGMLQuantizationType, tuple[int, int]] = {
    _Q.Q8_0: (34, 32),
    _Q.Q5_0: (22, 32),
    _Q.Q5_1: (24, 32),
    _Q.Q4_K: (144, 32),
    _Q.Q5_K: (176, 32),
    _Q.Q6_K: (210, 16),
}


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _scales_and_mins(
    kind: gguf.GGMLQuantizationType, blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per block [N, B, ...]: scales float32 [N, B, per block] and mins (or None), computed as
    the gguf package's dequantization computes them (d * sc and dmin * m: exact in float32)."""
    n, count = blocks.shape[:2]
    if kind in (_Q.Q8_0, _Q.Q5_0):
        return _half(blocks, 0)[..., None], None
    if kind == _Q.Q5_1:
        return _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]
    if kind in (_Q.Q4_K, _Q.Q5_K):
        packed = np.ascontiguousarray(blocks[..., 4:16]).reshape(n * count, 12)
        sc, mn = (a.reshape(n, count, 8).astype(np.float32) for a in gguf.quants.Q4_K.get_scale_min(packed))
        return _half(blocks, 0)[..., None] * sc, -(_half(blocks, 2)[..., None] * mn)
    # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    return _half(blocks, 208)[..., None] * sc, None


def block_codes(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(codes int8 [N, K], scales float32 [N, K/G], mins float32 [N, K/32] or None) with
    codes * scale + min equal to the gguf package's dequantization of every value, or None if
    the tensor is in none of these formats (or a value does not come back exactly, or a code
    falls outside [-127, 127]: then the caller keeps the float weights)."""
    fmt = _BLOCK_FORMATS.get(tensor.tensor_type)
    if fmt is None or len(tensor.shape) != 2:
        return None
    block_bytes, group = fmt
    k, n = (int(x) for x in tensor.shape.tolist())
    per_block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // per_block, block_bytes)
    scales, mins = _scales_and_mins(tensor.tensor_type, blocks)
    scales = scales.reshape(n, k // group)
    if tensor.tensor_type == _Q.Q8_0:  # the codes are the file's bytes, d * q is gguf's formula
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return None if codes.min(initial=0) < -127 else (codes, scales, None)
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(n, k)
    groups = values.reshape(n, k // group, group).astype(np.float64)
    if mins is not None:
        mins = mins.reshape(n, k // 32)
        per_group = np.repeat(mins, 32 // group, axis=1) if group != 32 else mins
        groups = groups - per_group[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scales[..., None] != 0, np.rint(groups / scales[..., None]), 0.0)
    if np.abs(codes).max(initial=0) > 127:
        return None
    codes = codes.astype(np.int8).reshape(n, k)
    rebuilt = codes.reshape(n, k // group, group).astype(np.float32) * scales[..., None]
    if mins is not None:
        rebuilt = rebuilt.reshape(n, k // 32, 32) + mins[..., None]
    if not np.array_equal(rebuilt.reshape(n, k), values):
        return None
    return codes, scales, mins


def iter_block_tensors(reader: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """For every weight in one of `block_codes`' formats: `<hf name>.codes` (int8 [N, K]),
    `.scales` (float32 [N, K/G]) and `.mins` (float32 [N, K/32], where the format has them), in
    HF row order (llama q/k un-permuted)."""
    is_permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    heads = {"q_proj": int(config["num_attention_heads"]), "k_proj": int(config["num_key_value_heads"])}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
        found = None if name is None else block_codes(tensor)
        if name is None or found is None:
            continue
        parts = {"codes": found[0], "scales": found[1]}
        if found[2] is not None:
            parts["mins"] = found[2]
        for proj, num_heads in heads.items():
            if is_permuted and f".self_attn.{proj}." in name:
                parts = {key: unpermute_rope_rows(a, num_heads) for key, a in parts.items()}
        for key, array in parts.items():
            yield f"{name}.{key}", np.ascontiguousarray(array)
