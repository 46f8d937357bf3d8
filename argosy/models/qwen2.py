"""Qwen2 / Qwen2.5: the Llama decoder with biases on the Q/K/V projections."""

from __future__ import annotations

from argosy.models.decoder_config import DecoderConfig
from argosy.models.llama import DecoderForCausalLM
from argosy.ops.attention import AttentionBackend


def build(hf_config: dict, backend: AttentionBackend | None = None) -> DecoderForCausalLM:
    cfg = DecoderConfig.from_hf(hf_config, qkv_bias=True, o_bias=False, mlp_bias=False)
    return DecoderForCausalLM(cfg, backend)
