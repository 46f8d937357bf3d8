"""DecoderConfig: the numbers a decoder-only transformer needs, read from config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from argosy.errors import ModelLoadError


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMS norm of each q/k head before rope

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides: Any) -> DecoderConfig:
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            values: dict[str, Any] = dict(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json lacks or mangles a required field: {exc}") from exc
        values.update(overrides)
        return cls(**values)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (fp32), with llama3 / linear scaling when configured."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        elif kind != "default":
            raise ModelLoadError(f"unsupported rope scaling type {kind!r}")
        return inv


def _llama3_inv_freq(inv: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
