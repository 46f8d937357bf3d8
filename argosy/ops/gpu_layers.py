"""The CUDA path's layers: paged attention, linears (float weights and a GGUF's Q4 blocks) and
RMSNorm on the Triton kernels of ops/triton_kernels.py.

Each computes a row alike whatever else is in its batch, so a seeded request gives the same
tokens alone or beside others, chunked or from the prefix cache (the kernels' docstring
says how). `triton` is imported only when one of these is built: a CPU-only install never
needs it.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from argosy.ops.attention import AttentionMetadata


def kernels() -> ModuleType:
    from argosy.ops import triton_kernels  # noqa: PLC0415 - triton only where these layers run

    return triton_kernels


class TritonPagedAttention:
    """Every token of a step is a row over its own context (AttentionMetadata's per-row form:
    num_decodes == tokens, decode_lens set), in one launch for the whole step."""

    per_row = True  # the runner builds every token as a decode row for this backend

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = kernels()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.decode_lens is None or meta.decode_block_ids is None or meta.num_decodes != q.shape[0]:
            raise ValueError("TritonPagedAttention needs the per-row metadata (every token a row)")
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        tables = meta.decode_block_ids.view(meta.num_decodes, -1)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, tables, meta.decode_lens, meta.block_size, self.scale, meta.window
        )
        return out.view(q.shape[0], self.num_heads * self.head_dim)


class TritonLinear(nn.Module):
    """A float weight [N, K] on the fixed-tile matmul (never cuBLAS: see the kernels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight  # the same Parameter object: a tied head stays tied to the embedding
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ops = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.ops.matmul(x.reshape(-1, shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], y.shape[-1])


class TritonQ4Linear(nn.Module):
    """A GGUF Q4_0/Q4_1 weight as the file holds it: 4-bit codes (two a byte), a float16 scale
    and minimum per 32 weights; unpacked tile by tile inside the matmul (never to bf16 at load)."""

    def __init__(
        self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        n, half_k = codes.shape
        self.in_features, self.out_features = 2 * half_k, n
        self.register_buffer("codes", codes.contiguous())
        # GGUF holds d and m in float16: exact
        self.register_buffer("scales", d.to(torch.float16).contiguous())
        self.register_buffer("mins", m.to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ops = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.ops.q4_matmul(x.reshape(-1, shape[-1]), self.codes, self.scales, self.mins)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features)


class TritonRMSNorm(nn.Module):
    """RMSNorm, one program per row: transformers' Llama form w * (x / rms(x)).to(dtype), or
    Gemma's (x / rms(x) * (1 + w)) in float32 (`gemma`)."""

    def __init__(self, weight: torch.Tensor, eps: float, gemma: bool) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.gemma = gemma
        self.ops = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.gemma)
