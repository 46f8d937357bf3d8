"""The KV cache's element and layout: what --kv-cache-dtype resolves to for a model's kernels,
a KV head's row width and the bytes a token takes, an int8 cache's per-channel K scale, and
slots copied between blocks."""

from __future__ import annotations

import torch
from torch import nn

from argosy.errors import ModelLoadError
from argosy.models.llama import Attention, DecoderForCausalLM, kv8_channel_scale
from argosy.ops.attention import per_row_attention_available


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """A KV head's row in the cache, in its elements: head_dim, or for int8 head_dim codes and
    an fp16 scale per 32 (csrc/iq_attention.cpp)."""
    return head_dim + head_dim // 16 if kv_dtype == torch.int8 else head_dim


def copy_slots(
    k_all: torch.Tensor, v_all: torch.Tensor, copies: list[tuple[int, int, int]], block_size: int
) -> None:
    """(source block, target block, n): the first n slots' K and V, every layer's ([layers, slots,
    ...] tensors), copied, in order (a later copy may write a block an earlier one read): a
    prompt's tokens found in part of a cached block (BlockManager.find_partial)."""
    for source, target, n in copies:
        if source != target:
            a, b = source * block_size, target * block_size
            k_all[:, b : b + n] = k_all[:, a : a + n]
            v_all[:, b : b + n] = v_all[:, a : a + n]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    element = torch.tensor([], dtype=kv_dtype).element_size()
    return 2 * num_layers * num_kv_heads * kv_row_width(head_dim, kv_dtype) * element


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def fused_bias(layer: nn.Module) -> torch.Tensor | None:
    """A projection's bias, a fused layer split by format (PartsLinear) its parts' together."""
    parts = getattr(layer, "parts", None)
    if parts is not None:
        biases = [getattr(part, "bias", None) for part in parts]
        return None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore[arg-type]
    bias = getattr(layer, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def uses_per_row_attention(model: DecoderForCausalLM, invariant: bool, device: torch.device) -> bool:
    """Every token attends as a decode row through the one native kernel: a token's attention
    is then the same whatever chunk, cache hit or batch it comes in (the invariant mode;
    ops/attention.py). The CUDA backend (ops/gpu_layers.py) takes every token as a row too."""
    backend = getattr(getattr(model.layers[0], "self_attn", None), "backend", None)
    return getattr(backend, "per_row", False) or (
        invariant and device.type == "cpu" and per_row_attention_available()
    )


def resolve_kv_dtype(
    choice: str, model: DecoderForCausalLM, invariant: bool, device: torch.device | str, dtype: torch.dtype
) -> torch.dtype:
    """The KV cache's element for --kv-cache-dtype `choice`. The invariant attention kernel
    keeps fp16 (as llama.cpp's: 3 more mantissa bits than bf16, the same bytes) or int8 (q8_0);
    the other kernels the model's dtype. A choice the model's kernels do not have is refused."""
    device = torch.device(device)
    native = invariant and device.type == "cpu" and uses_per_row_attention(model, invariant, device)
    own = torch.float16 if native else dtype
    wanted = {"auto": own, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[choice]
    if wanted == own:
        return own
    if wanted == torch.int8 and native:
        head_dim = model.config.head_dim
        if head_dim % 32:
            raise ModelLoadError(
                f"--kv-cache-dtype int8 needs a head dim that is a multiple of 32, not {head_dim}"
            )
        return torch.int8
    where = (
        "the invariant attention kernel"
        if native
        else f"this model's attention ({device.type}, numerics fast)"
    )
    takes = "fp16 or int8" if native else str(own).removeprefix("torch.")
    raise ModelLoadError(
        f"--kv-cache-dtype {choice}: {where} keeps a {takes} KV cache"
        + ("" if native else "; int8 needs the invariant kernels (--numerics invariant on a CPU)")
    )


def set_k_channel_scales(model: DecoderForCausalLM) -> None:
    """An int8 cache's per-channel K scales (kv8_channel_scale) on each attention layer, from
    its fused q/k/v bias."""
    cfg = model.config
    for layer in model.layers:
        attention = getattr(layer, "self_attn", None)
        if isinstance(attention, Attention):
            bias = fused_bias(attention.qkv_proj)
            k_bias = None if bias is None else bias[attention.q_size : attention.q_size + attention.kv_size]
            attention.k_channel_scale = kv8_channel_scale(k_bias, cfg.num_kv_heads, cfg.head_dim)
