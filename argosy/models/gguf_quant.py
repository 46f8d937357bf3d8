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


# (codes int8 [N, K], scales float32 [N, K/G], mins float32 [N, K/32] or None)
Found = tuple[np.ndarray, np.ndarray, np.ndarray | None]
_SHIFTS_1 = np.arange(8, dtype=np.uint8).reshape(8, 1)
_SHIFTS_2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_SHIFTS_4 = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
_SHIFTS_32 = np.arange(32, dtype=np.uint32)


def _block_codes(kind: gguf.GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """Per block [N, B, bytes]: the codes int8 [N, B, weights a block] read from the bits, in
    weight order (the gguf package's dequantization reads the same bits in the same order)."""
    n, count = blocks.shape[:2]
    if kind == _Q.Q8_0:
        return blocks[..., 2:].view(np.int8)
    if kind == _Q.Q6_K:  # ql[128]: low then high nibbles of 64 bytes; qh[64]: 2 bits each
        low = blocks[..., :128].reshape(n, count, 2, 1, 64) >> _SHIFTS_4
        high = blocks[..., 128:192].reshape(n, count, 2, 1, 32) >> _SHIFTS_2
        q = (low & 0x0F).reshape(n, count, 256) | ((high & 0x03).reshape(n, count, 256) << 4)
        return q.view(np.int8) - np.int8(32)
    if kind in (_Q.Q4_K, _Q.Q5_K):  # a 32-byte chunk: low nibbles one sub-block, high the next
        qs = blocks[..., -128:].reshape(n, count, 4, 1, 32) >> _SHIFTS_4
        q = (qs & 0x0F).reshape(n, count, 256)
        if kind == _Q.Q5_K:  # qh[32]: bit i of byte j is weight j's 5th bit in sub-block i
            qh = blocks[..., 16:48].reshape(n, count, 1, 32) >> _SHIFTS_1
            q |= (qh & 0x01).reshape(n, count, 256) << 4
        return q.view(np.int8)
    # Q5_0 / Q5_1: qh (uint32, bit j: weight j's 5th bit), then 16 bytes: low nibbles weights
    # 0-15, high nibbles 16-31; Q5_0's codes are centred on 16
    at = 2 if kind == _Q.Q5_0 else 4
    qh = blocks[..., at : at + 4].copy().view("<u4") >> _SHIFTS_32
    low = blocks[..., at + 4 :].reshape(n, count, 1, 16) >> _SHIFTS_4
    q = (low & 0x0F).reshape(n, count, 32) | ((qh & 1).astype(np.uint8) << 4)
    return q.view(np.int8) - np.int8(16 if kind == _Q.Q5_0 else 0)


def block_codes(tensor: GGUFTensor) -> Found | None:
    """(codes int8 [N, K], scales float32 [N, K/G], mins float32 [N, K/32] or None) with
    codes * scale + min equal to the gguf package's dequantization of every value (the same
    bits, and the same float32 products and sum: tests/unit/test_gguf_blocks.py), or None if
    the tensor is in none of these formats (or a Q8_0 code is -128, outside the kernels'
    [-127, 127]: then the caller keeps the float weights)."""
    fmt = _BLOCK_FORMATS.get(tensor.tensor_type)
    if fmt is None or len(tensor.shape) != 2:
        return None
    block_bytes, group = fmt
    k, n = (int(x) for x in tensor.shape.tolist())
    per_block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // per_block, block_bytes)
    scales, mins = _scales_and_mins(tensor.tensor_type, blocks)
    codes = _block_codes(tensor.tensor_type, blocks).reshape(n, k)
    if tensor.tensor_type == _Q.Q8_0 and codes.min(initial=0) < -127:
        return None
    return codes, scales.reshape(n, k // group), None if mins is None else mins.reshape(n, k // 32)


def block_super(tensor: GGUFTensor) -> dict[str, np.ndarray]:
    """A K-quant's own scales, for its codes held at their bits (argosy/ops/packed_codes.py):
    `sc` (uint8 Q4_K / Q5_K per 32, int8 Q6_K per 16) and `d` (float16 per 256), and Q4_K's /
    Q5_K's `mn` (uint8 per 32) and `dmin` (float16 per 256), all [N, ...]; {} for the others.
    d * sc and -(dmin * mn) are `block_codes`' scales and mins."""
    kind = tensor.tensor_type
    if kind not in (_Q.Q4_K, _Q.Q5_K, _Q.Q6_K) or len(tensor.shape) != 2:
        return {}
    block_bytes = _BLOCK_FORMATS[kind][0]
    k, n = (int(x) for x in tensor.shape.tolist())
    count = k // 256
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, count, block_bytes)

    def half(at: int) -> np.ndarray:
        return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]

    if kind == _Q.Q6_K:
        return {"sc": blocks[..., 192:208].copy().view(np.int8).reshape(n, count * 16), "d": half(208)}
    packed = np.ascontiguousarray(blocks[..., 4:16]).reshape(n * count, 12)
    sc, mn = (a.reshape(n, count * 8).astype(np.uint8) for a in gguf.quants.Q4_K.get_scale_min(packed))
    return {"sc": sc, "d": half(0), "mn": mn, "dmin": half(2)}


def block_values(found: Found) -> np.ndarray:
    """float32 [N, K]: codes * scale (+ min), the gguf package's dequantization of the values."""
    codes, scales, mins = found
    n, k = codes.shape
    values = codes.reshape(n, scales.shape[1], -1).astype(np.float32)
    values *= scales[..., None]
    if mins is not None:
        values = values.reshape(n, k // 32, 32)
        values += mins[..., None]
    return values.reshape(n, k)


def file_block_codes(reader: GGUFFile) -> dict[str, Found]:
    """`block_codes` of every tensor of the file that has them, by GGUF tensor name."""
    return {tensor.name: found for tensor in reader.tensors if (found := block_codes(tensor)) is not None}


def iter_block_tensors(
    reader: GGUFFile, config: dict[str, Any], found_codes: dict[str, Found]
) -> Iterator[tuple[str, np.ndarray]]:
    """For every weight in one of `block_codes`' formats: `<hf name>.codes` (int8 [N, K]),
    `.scales` (float32 [N, K/G]) and `.mins` (float32 [N, K/32], where the format has them), a
    K-quant's own `.sc`, `.d`, `.mn`, `.dmin` (`block_super`), in
    HF row order (llama q/k un-permuted), from `found_codes` (`file_block_codes`)."""
    is_permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    heads = {"q_proj": int(config["num_attention_heads"]), "k_proj": int(config["num_key_value_heads"])}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
        if name is None:
            continue
        found = found_codes.get(tensor.name)
        if found is None:
            continue
        parts = {"codes": found[0], "scales": found[1]}
        if found[2] is not None:
            parts["mins"] = found[2]
        parts.update(block_super(tensor))
        for proj, num_heads in heads.items():
            if is_permuted and f".self_attn.{proj}." in name:
                parts = {key: unpermute_rope_rows(a, num_heads) for key, a in parts.items()}
        for key, array in parts.items():
            yield f"{name}.{key}", np.ascontiguousarray(array)
