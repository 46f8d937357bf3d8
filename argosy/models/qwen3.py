"""Qwen3: the Llama decoder with per-head RMS norm of Q and K before RoPE."""

from __future__ import annotations

from argosy.models.decoder_config import DecoderConfig
from argosy.models.llama import DecoderForCausalLM
from argosy.ops.attention import AttentionBackend


def build(hf_config: dict, backend: AttentionBackend | None = None) -> DecoderForCausalLM:
    bias = bool(hf_config.get("attention_bias", False))
    cfg = DecoderConfig.from_hf(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return DecoderForCausalLM(cfg, backend)
