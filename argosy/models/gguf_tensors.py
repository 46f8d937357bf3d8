"""GGUF tensors as Hugging Face tensors: names, dequantization and llama.cpp's q/k permutation.

Each GGUF tensor maps to exactly one HF tensor. `hf_tensor_name` is the naming table;
`dequantize_tensor` turns one tensor into float32 in HF layout. They are separate so that a
later loader can keep some tensors quantized (e.g. Q4_1 blocks) and still reuse the naming.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np

from argosy.errors import ModelLoadError
from argosy.models.gguf_file import GGUFFile, GGUFTensor

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Tensors llama.cpp derives from config values and the HF model recomputes itself. rope_freqs
# holds Llama 3.1's rope-scaling factors; like transformers' GGUF loader we drop it, so such
# files run with unscaled rope (weak: long-context quality of Llama 3.1+ GGUFs).
_DERIVED_TENSORS = frozenset({"rope_freqs.weight"})

# HF model types whose GGUF attn_q / attn_k rows llama.cpp's converter permuted (see
# `unpermute_rope_rows`); Qwen's converter leaves them in HF order.
_PERMUTED_MODEL_TYPES = frozenset({"llama", "mistral"})


# Gemma 3's four norms a layer: llama.cpp's ffn_norm is its pre-feedforward norm
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp stores a Gemma norm's multiplier, 1 + the HF weight (HF computes x * (1 + w))
GEMMA_MODEL_TYPES = frozenset({"gemma3_text"})


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The HF name of a GGUF tensor; None for tensors HF recomputes; ModelLoadError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _DERIVED_TENSORS:
        return None
    names = _GEMMA3_LAYER_NAMES if model_type in GEMMA_MODEL_TYPES else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart we know")
    layer, role, kind = match.groups()
    return f"model.layers.{layer}.{names[role]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k projection rows (weights or biases).

    HF Llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent
    pairs, so its converter reorders each head's rows from [half0, half1] to interleaved.
    Reshaping to (heads, dim, 2) and swapping back restores HF order. For k, `num_heads` is
    the number of KV heads.
    """
    head_half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, head_half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as float32 in HF shape (GGUF lists dims innermost-first, HF outermost-first)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(values, dtype=np.float32).reshape(hf_shape)


def iter_hf_tensors(
    reader: GGUFFile,
    config: dict[str, Any],
    known: Callable[[GGUFTensor], np.ndarray | None] | None = None,
    include: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every weight of the file (those whose HF name `include`
    takes, if given), in HF layout, one at a time. `known(tensor)`: its float32 values [N, K]
    where already computed (None: dequantize it)."""
    is_permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config["num_key_value_heads"])
    gemma = config["model_type"] in GEMMA_MODEL_TYPES
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
        if name is None or (include is not None and not include(name)):
            continue
        values = known(tensor) if known is not None else None
        values = dequantize_tensor(tensor) if values is None else values
        if gemma and name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # the HF weight (the model adds the 1 back)
        if is_permuted and ".self_attn.q_proj." in name:
            values = unpermute_rope_rows(values, num_heads)
        elif is_permuted and ".self_attn.k_proj." in name:
            values = unpermute_rope_rows(values, num_kv_heads)
        yield name, np.ascontiguousarray(values)
