"""Gemma 3 (text): the Llama decoder with Gemma's differences, as transformers' Gemma3ForCausalLM.

- Embeddings scaled by sqrt(hidden) (in the embeddings' dtype).
- RMS norms multiply by (1 + w), in float32 (HF's weight; llama.cpp's files hold 1 + w and the
  converter writes w back); four a layer: input, post-attention, pre- and post-feedforward.
- Per-head RMS norms of q and k before RoPE; queries scaled by query_pre_attn_scalar^-1/2.
- Interleaved attention: every layer of `layer_types` "sliding_attention" sees the last
  `sliding_window` positions, with its own RoPE base (rope_local_base_freq); the others see the
  whole context with rope_theta. The KV cache keeps every position; the masks narrow
  (AttentionMetadata.windowed).
- GeGLU feed-forward: gelu (tanh approximation) of the gate times the up projection.
- The head is the embedding matrix (tied); no logit soft-capping (Gemma 3 has none).

`model.rope` gives both RoPE tables side by side ([T, 2 * head_dim]: global, then local), so the
runner's one cos/sin serves both kinds of layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from argosy.errors import ModelLoadError
from argosy.models.decoder_config import DecoderConfig
from argosy.models.llama import MLP, Attention, DecoderForCausalLM, RMSNorm
from argosy.ops.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), in float32, then back to x's dtype (transformers' Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    offset = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := self.native(x)) is not None:
            return out
        h = x.float()
        mean = (
            h.double().pow(2).mean(-1, keepdim=True).float()
            if self.float64_mean
            else h.pow(2).mean(-1, keepdim=True)
        )
        h = h * torch.rsqrt(mean + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    def __init__(
        self, cfg: DecoderConfig, backend: AttentionBackend, window: int | None, scalar: float
    ) -> None:
        super().__init__(cfg, backend)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.window = window  # None: a global layer (the masks narrow: AttentionMetadata.windowed)
        # the backends scale by head_dim^-1/2; Gemma by query_pre_attn_scalar^-1/2
        self.query_scale = None if scalar == cfg.head_dim else (cfg.head_dim / scalar) ** 0.5

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim  # cos/sin hold the global table, then the local one
        half = slice(d, 2 * d) if self.window is not None else slice(0, d)
        q, k, v = super().project(x, cos[..., half], sin[..., half])
        return (q if self.query_scale is None else q * self.query_scale), k, v


@torch.library.custom_op("argosy::gelu_tanh", mutates_args=())
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """aten's gelu (tanh approximation) as an op the compiler cannot see into: the compiled decode
    step then computes each value with the eager step's instructions (inductor's own tanh and
    its order of the polynomial's operations are free to differ in the last bit)."""
    return F.gelu(x, approximate="tanh")


@gelu_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class GeGLU(MLP):
    swiglu_with_projection = False

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(gate) * up

    def invariant_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.argosy_iq.geglu(gate_up)
        return out


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, backend: AttentionBackend, window: int | None, scalar: float
    ) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg, backend, window, scalar)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeGLU(cfg)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.forward_with(x, lambda h: self.self_attn(h, k_cache, v_cache, meta), meta.keep)

    def forward_with(
        self,
        x: torch.Tensor,
        attention: Callable[[torch.Tensor], torch.Tensor],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.post_attention_layernorm(attention(self.input_layernorm(x)))
        x = x + attended if keep is None else x[keep] + attended
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(
        self, cfg: DecoderConfig, hf_config: dict[str, Any], backend: AttentionBackend | None = None
    ) -> None:
        super().__init__(cfg, backend)
        backend = backend or CpuPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        types = hf_config.get("layer_types") or ["full_attention"] * cfg.num_layers
        if len(types) != cfg.num_layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ModelLoadError(f"Gemma 3 layer_types must be {cfg.num_layers} of full/sliding_attention")
        window = int(hf_config.get("sliding_window") or 4096)
        scalar = float(hf_config.get("query_pre_attn_scalar") or cfg.head_dim)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, backend, window if kind == "sliding_attention" else None, scalar)
            for kind in types
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        local = DecoderConfig.from_hf(
            hf_config | {"rope_theta": hf_config.get("rope_local_base_freq", 10000.0)}
        )
        # local layers rotate with their own base, unscaled (transformers' default rope for them)
        self.local_inv_freq = 1.0 / (
            local.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim)
        )
        self.normalizer = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)  # in the embeddings' dtype, as transformers
        return x if self.hidden_dtype is None else x.to(self.hidden_dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().rope(positions, dtype)
        freqs = positions.float().unsqueeze(-1) * self.table_on(
            "local_inv_freq", self.local_inv_freq, positions.device
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.cat((cos, emb.cos().to(dtype)), dim=-1), torch.cat((sin, emb.sin().to(dtype)), dim=-1)


def build(hf_config: dict, backend: AttentionBackend | None = None) -> DecoderForCausalLM:
    if hf_config.get("final_logit_softcapping") or hf_config.get("attn_logit_softcapping"):
        raise ModelLoadError("Gemma logit soft-capping is not supported (Gemma 3 has none)")
    cfg = DecoderConfig.from_hf(hf_config, tie_word_embeddings=True, qk_norm=True)
    return Gemma3ForCausalLM(cfg, hf_config, backend)
