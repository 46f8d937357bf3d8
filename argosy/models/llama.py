"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) — also the base for Qwen2/Qwen3.

Our own module so attention can read and write the paged KV cache. Q/K/V and gate/up are
fused into one matmul each; `load_weights` maps Hugging Face tensor names onto them.
Numerics follow transformers (RMSNorm in fp32 then cast; RoPE cos/sin in model dtype) so
greedy outputs match it token for token on the same weights and dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from argosy.errors import ModelLoadError
from argosy.models.decoder_config import DecoderConfig
from argosy.ops.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention
from argosy.ops.native import invariant_ops_ready


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # the invariant mode: the mean of squares summed in float64 and rounded once to float32,
        # so the order of summation (aten's per batch shape, inductor's in the compiled step)
        # does not reach the result: each square is exact in float64 and the order moves the
        # sum by ~2^-52 of itself, which changes the float32 result only when it lies that
        # close to a rounding boundary (~1 in 10^8 norms). In float32 the two orders differed
        # in the last bit, which the int8 quantization of the next layer's input amplified to
        # 0.6 in the logits of a compiled step against the eager one. The invariant mode runs
        # `native` below, that sum in one fixed order; the statement in forward is its reference.
        self.float64_mean = False

    offset = 0.0  # out = x * r * (offset + w): Gemma's 1, its (1 + w)

    def native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The invariant mode's eager step: one native pass (csrc/iq_norm.cpp: the float64 sum
        of squares in one fixed order, each token's values read in place, e.g. q or k of the
        fused projection) instead of a chain of eager ops and float64 copies (Qwen2.5-1.5B, a
        1,000-token prefill: ~230 -> ~10 ms). None where it does not apply, and in the compiled
        graph, where inductor fuses the statement in forward with the residual add (the op
        there cost a 1.5B decode step 2-3%); the two orders of the float64 sum differ in the
        float32 result about once in 10^8 norms, as aten's and inductor's did before."""
        if not (
            self.float64_mean
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and not torch.compiler.is_compiling()
        ):
            return None
        if x.dim() in (2, 3):
            out: torch.Tensor = torch.ops.argosy_iq.rms_norm(
                token_rows(x), self.weight, self.eps, self.offset
            )
            return out
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return torch.ops.argosy_iq.rms_norm(flat, self.weight, self.eps, self.offset).view(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := self.native(x)) is not None:
            return out
        dtype = x.dtype
        h = x.float()
        if self.float64_mean:
            mean = h.double().pow(2).mean(-1, keepdim=True).float()
        else:
            mean = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(mean + self.eps)
        return self.weight * h.to(dtype)


# q [T, H, D], k and v [T, KVH, D] (projected and rotated) and the layer's sliding window (None:
# global) -> the attended heads [T, H * D]: the eager step's backend call, or the compiled graph's op
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


def cast_for_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_dtype: torch.dtype,
    invariant: bool,
    k_channel_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k and v in the cache's dtype (an int8 cache: float32, which the kernel quantizes as it
    writes); q too, except for the invariant kernel, which takes float32 queries (the stream's,
    unrounded). The eager step and the compiled graph both call this. `k_channel_scale` (an int8
    cache, kv8_channel_scale): k divided by it and q multiplied by it per channel, powers of two,
    so exactly, and q . k is unchanged."""
    if cache_dtype == torch.int8:
        k, v, q = k.float(), v.float(), q.float()
        if k_channel_scale is not None:
            group = q.shape[1] // k.shape[1]
            k = k / k_channel_scale
            q = q * k_channel_scale.repeat_interleave(group, dim=0)
        return q, k, v
    k, v = k.to(cache_dtype), v.to(cache_dtype)
    return (q.float() if invariant else q.to(cache_dtype)), k, v


# K channels whose bias is larger than this share the int8 cache's 32-dim groups badly (Qwen2.5's
# first layer: |b| up to 145, the median 6.4): they are scaled down (kv8_channel_scale)
KV8_BIAS_THRESHOLD = 16.0


def kv8_channel_scale(bias: torch.Tensor | None, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """Per KV head and channel, the power of two an int8 cache divides K by before its q8_0 rows
    (q is multiplied by it): for each RoPE pair (i, i + D/2) 2^ceil(log2(max |bias| / 16)) where
    that is above 1, else 1. K's bias is a near-constant offset (its pair rotates slowly) that
    otherwise sets its 32-dim group's scale: on Qwen2.5-Coder-0.5B (bench/quality.py, 1,024
    positions) the int8 cache's mean |dlp| to fp32 was 0.110 (the fp16 cache 0.0155); scaled,
    0.027. None: no bias, or none that large."""
    if bias is None:
        return None
    kb = bias.detach().float().abs().view(num_kv_heads, head_dim)
    half = head_dim // 2
    pair = torch.maximum(kb[:, :half], kb[:, half:])
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(pair / KV8_BIAS_THRESHOLD, min=1.0))))
    if bool((scale == 1.0).all()):
        return None
    return torch.cat([scale, scale], dim=-1).contiguous()


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when each token's values (all but dim 0) lie contiguous, else a contiguous copy."""
    inner = x[0] if x.shape[0] else x
    return x if x.shape[0] and inner.is_contiguous() and x.stride(-1) == 1 else x.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (rotate-half layout, as transformers)."""
    if x.dtype == torch.float32 and not torch.compiler.is_compiling() and invariant_ops_ready():
        # the eager step: the same operations in one native pass (the same bits as the
        # statement below, which the compiled decode graph keeps)
        # each token's values contiguous, tokens any stride apart (read in place: q or k of the
        # fused projection, one half of Gemma's two tables)
        n = x.shape[0]
        table = (token_rows(cos.reshape(n, -1).float()), token_rows(sin.reshape(n, -1).float()))
        out: torch.Tensor = torch.ops.argosy_iq.rope(token_rows(x), *table)
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.window: int | None = None  # a sliding-window layer's window (Gemma 3's local layers)
        # an int8 KV cache's per-channel K scale (kv8_channel_scale; set by the runner), or None
        self.k_channel_scale: torch.Tensor | None = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of x, normed (if the model does) and rotated;
        cos/sin: [T, 1, D]. Shared with the compiled decode graph."""
        n = x.shape[0]
        sizes = [self.q_size, self.kv_size, self.kv_size]
        split = getattr(self.qkv_proj, "split", None)  # PartsLinear: no concatenation
        pieces = None if split is None else split(x, sizes)
        q, k, v = self.qkv_proj(x).split(sizes, dim=-1) if pieces is None else pieces
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend_with(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """The layer's attention of x (normed), with `attend` computing the heads: the one
        definition the eager step and the compiled decode graph share."""
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(attend(q, k, v, self.window).to(x.dtype))

    def forward(
        self,
        x: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
            q, k, v = cast_for_cache(q, k, v, k_cache.dtype, meta.invariant, self.k_channel_scale)
            layer_meta = meta if window is None else meta.windowed(window)
            return self.backend.forward(q, k, v, k_cache, v_cache, layer_meta)

        return self.attend_with(x, meta.cos.unsqueeze(1), meta.sin.unsqueeze(1), attend)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # the invariant mode (set by build): an activation with an invariant native op uses it
        self.invariant_ops = False

    # the activation is SwiGLU, which a packed gate_up projection can compute with itself
    swiglu_with_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant_ops and self.swiglu_with_projection:
            swiglu = getattr(self.gate_up_proj, "swiglu", None)  # Int8Linear (not LoRA's wrapper)
            fused = None if swiglu is None else swiglu(x)
            if fused is not None:  # the bits of the two steps below
                return self.down_proj(fused)
        gate_up = self.gate_up_proj(x)
        if self.invariant_ops:  # one pass, rounded once, the same bits on every path and graph
            shape = gate_up.shape
            out = self.invariant_activation(gate_up.reshape(-1, shape[-1]).contiguous())
            return self.down_proj(out.view(*shape[:-1], self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.activation(gate, up))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def invariant_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation's native op: [rows, 2I] -> [rows, I]."""
        out: torch.Tensor = torch.ops.argosy_iq.swiglu(gate_up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

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
        """The layer around its attention (a function of the normed stream): shared by the eager
        step and the compiled decode graph. `keep`: the rows the attention returns (the last
        layer's, AttentionMetadata.keep), the rest of the layer runs for them alone."""
        attended = attention(self.input_layernorm(x))
        x = x + attended if keep is None else x[keep] + attended
        return x + self.mlp(self.post_attention_layernorm(x))


# HF name fragment -> (our fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderForCausalLM(nn.Module):
    supports_compiled_decode = True  # runner/compiled.py's DecodeGraph runs its layers' forward_with

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        backend = backend or CpuPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE's inverse frequencies, always float32: not a buffer, so that `.to(bfloat16)` does
        # not round them (a bf16 frequency is off by up to 2^-9 of itself, which at position p
        # turns the angle by p times that: ~1 radian at p = 500 for SmolLM2)
        self.inv_freq = cfg.inv_freq()
        # the residual stream's dtype when it is not the weights' (None): float32 in the
        # invariant mode, as llama.cpp keeps it (with an fp16 KV cache, float32 queries)
        self.hidden_dtype: torch.dtype | None = None
        self._device_tables: dict[tuple[str, torch.device], torch.Tensor] = {}

    def table_on(self, name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host table (RoPE frequencies) on `device`, copied once per device and kept: a
        captured CUDA graph reads the copy it was captured with, so that copy must live on (a
        table moved back and forth between host and GPU steps would free it under the graph)."""
        if table.device == device:
            return table
        copy = self._device_tables.get((name, device))
        if copy is None:
            copy = self._device_tables[(name, device)] = table.to(device)
        return copy

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.hidden_dtype is None else x.to(self.hidden_dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.table_on("inv_freq", self.inv_freq, positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The last norm's output for every row, or for meta.keep's rows (in that order)."""
        x = self.embed(input_ids)
        if meta.embeds is not None:  # an image's features in place of its tokens' embeddings
            rows, values = meta.embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, k_cache, v_cache, meta if i == last else meta.without_keep())
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Copy the checkpoint's weights in; a weight given as None is served by the file's own
        codes (build.load_model) and left unread: its parameter is replaced before any step."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for fragment, (fused, index) in _STACKED.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(fragment, fused), index
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected weight {hf_name!r} for this architecture")
            if tensor is None:
                pass
            elif shard is None:
                _copy(param, tensor, hf_name)
            else:
                _copy(self._shard(target, param, shard), tensor, hf_name)
            loaded.add(f"{target}#{shard}")
        missing = [n for n in params if not _is_loaded(n, loaded, self.config)]
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[:5]}")

    def _shard(self, name: str, param: torch.Tensor, index: int) -> torch.Tensor:
        cfg = self.config
        if "qkv_proj" in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
        else:
            i = cfg.intermediate_size
            bounds = [(0, i), (i, 2 * i)][index]
        return param.narrow(0, bounds[0], bounds[1] - bounds[0])


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _is_loaded(name: str, loaded: set[str], cfg: DecoderConfig) -> bool:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True
    if "qkv_proj" in name or "gate_up_proj" in name:
        count = 3 if "qkv_proj" in name else 2
        return all(f"{name}#{i}" in loaded for i in range(count))
    return f"{name}#None" in loaded


def build(hf_config: dict, backend: AttentionBackend | None = None) -> DecoderForCausalLM:
    return DecoderForCausalLM(DecoderConfig.from_hf(hf_config), backend)
