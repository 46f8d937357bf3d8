"""Paged attention over a block-structured KV cache.

The flattened batch holds decode tokens first (one per sequence), then prefill chunks.
`AttentionMetadata` is built once per step by the model runner and passed explicitly to
every layer (no globals). `CpuPagedAttention` is the CPU backend; the CUDA one
(ops/gpu_layers.py, Triton) plugs in behind the same `forward(q, k, v, k_cache, v_cache, meta)`
seam.

KV cache layout per layer: [num_blocks * block_size, num_kv_heads, head_dim] ("slots").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from argosy.ops.native import load_invariant_ops


def per_row_attention_available() -> bool:
    """True when the invariant attention kernel (csrc/iq_attention.cpp) can serve every row of a
    step: each token over its own visible positions, in an order that depends on nothing
    else in the step (--numerics invariant)."""
    return load_invariant_ops()


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the flattened batch
    num_query_tokens: int
    context_len: int  # tokens of context including this chunk
    context_slots: torch.Tensor  # [context_len] slot ids of the whole context


@dataclass(slots=True)
class ContextBatch:
    """Prefill chunks (cold or over cached context) padded into one batch for one SDPA call
    a layer, built once a step for every layer. C chunks, up to Lq queries and Lk context."""

    q_index: torch.Tensor  # [C * Lq] token rows (padding rows repeat a real one)
    context_slots: torch.Tensor  # [C * Lk] (padding points at slot 0, masked out)
    mask: torch.Tensor  # [C, 1, Lq, Lk] bool
    valid_rows: torch.Tensor  # rows of the padded [C * Lq] result that are real queries
    out_rows: torch.Tensor  # their token rows, in the same order
    num_queries: int  # Lq
    num_context: int  # Lk

    def to(self, device: torch.device) -> ContextBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return ContextBatch(
            move(self.q_index),
            move(self.context_slots),
            move(self.mask),
            move(self.valid_rows),
            move(self.out_rows),
            self.num_queries,
            self.num_context,
        )

    @staticmethod
    def worth_it(chunks: list[PrefillChunk], max_padding: float = 2.0) -> bool:
        """Batch only when padding at most doubles the attention work (a long prompt beside
        short ones would make every chunk as long as the longest)."""
        if len(chunks) < 2:
            return False
        work = sum(c.num_query_tokens * c.context_len for c in chunks)
        padded = len(chunks) * max(c.num_query_tokens for c in chunks) * max(c.context_len for c in chunks)
        return padded <= max_padding * work

    @staticmethod
    def build(chunks: list[PrefillChunk]) -> ContextBatch:
        lq = max(c.num_query_tokens for c in chunks)
        lk = max(c.context_len for c in chunks)
        q_index = torch.zeros(len(chunks), lq, dtype=torch.long)
        slots = torch.zeros(len(chunks), lk, dtype=torch.long)
        mask = torch.zeros(len(chunks), 1, lq, lk, dtype=torch.bool)
        valid: list[int] = []
        for i, c in enumerate(chunks):
            rows = torch.arange(c.token_start, c.token_start + c.num_query_tokens)
            q_index[i, : c.num_query_tokens] = rows
            q_index[i, c.num_query_tokens :] = c.token_start
            slots[i, : c.context_len] = c.context_slots
            offset = c.context_len - c.num_query_tokens
            visible = torch.arange(c.context_len).unsqueeze(0) <= (
                torch.arange(c.num_query_tokens) + offset
            ).unsqueeze(1)
            mask[i, 0, : c.num_query_tokens, : c.context_len] = visible
            mask[i, 0, c.num_query_tokens :, 0] = True  # padding rows see one slot: no NaN
            valid.extend(range(i * lq, i * lq + c.num_query_tokens))
        valid_rows = torch.tensor(valid, dtype=torch.long)
        return ContextBatch(
            q_index.view(-1), slots.view(-1), mask, valid_rows, q_index.view(-1)[valid_rows], lq, lk
        )


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    cos: torch.Tensor  # [num_tokens, head_dim] RoPE, model dtype
    sin: torch.Tensor
    num_decodes: int = 0
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * max_blocks] block table rows
    decode_max_context: int = 0  # max_blocks * block_size
    block_size: int = 16
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool: attend
    decode_lens: torch.Tensor | None = None  # [num_decodes] context length of each row (long)
    invariant: bool = False  # decode rows through the invariant kernel (--numerics invariant)
    prefills: list[PrefillChunk] = field(default_factory=list)
    context_batch: ContextBatch | None = None  # all prefill chunks as one padded batch
    window: int | None = None  # sliding-window attention: a token sees its last `window` positions
    local: dict[int, AttentionMetadata] = field(default_factory=dict)  # windowed copies, per window
    # the rows whose output the step uses (the model's last layer: its attention, MLP and norm
    # run for these rows alone, after every row's K/V is in the cache); None: every row
    keep: torch.Tensor | None = None
    # rows whose input embedding is given, not looked up (a VLM's image features): (rows [k],
    # values [k, hidden]); None: every row's is its token's
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    def without_keep(self) -> AttentionMetadata:
        """This step's metadata for the layers before the last: every row's output. Built once
        a step (kept in `local` under -1, no window's key)."""
        if self.keep is None:
            return self
        plain = self.local.get(-1)
        if plain is None:
            plain = self.local[-1] = dataclasses.replace(self, keep=None, local={})
        return plain

    def windowed(self, window: int) -> AttentionMetadata:
        """This step's metadata for a sliding-window layer (Gemma 3's local layers): each token
        sees the positions p - window < j <= p of its sequence. Built once a step per window;
        the masks narrow, the K/V cache keeps every position (global layers read them)."""
        cached = self.local.get(window)
        if cached is None:
            cached = dataclasses.replace(
                self,
                decode_mask=None if self.decode_mask is None else window_mask(self.decode_mask, window),
                context_batch=None
                if self.context_batch is None
                else dataclasses.replace(
                    self.context_batch, mask=window_mask(self.context_batch.mask, window)
                ),
                window=window,
                local={},
            )
            self.local[window] = cached
        return cached

    def to(self, device: torch.device) -> AttentionMetadata:
        """A copy with every tensor on `device` (built on the host, run on an accelerator)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            cos=self.cos.to(device, non_blocking=True),
            sin=self.sin.to(device, non_blocking=True),
            num_decodes=self.num_decodes,
            decode_block_ids=move(self.decode_block_ids),
            decode_max_context=self.decode_max_context,
            block_size=self.block_size,
            decode_mask=move(self.decode_mask),
            decode_lens=move(self.decode_lens),
            invariant=self.invariant,
            window=self.window,
            keep=move(self.keep),
            embeds=None if self.embeds is None else (self.embeds[0].to(device), self.embeds[1].to(device)),
            context_batch=None if self.context_batch is None else self.context_batch.to(device),
            prefills=[
                PrefillChunk(c.token_start, c.num_query_tokens, c.context_len, c.context_slots.to(device))
                for c in self.prefills
            ],
        )


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal mask [..., L] (each row's visible positions a prefix 0..p) narrowed to the last
    `window` positions of each row, p - window < j <= p; a padding row keeps its one slot."""
    visible = mask.sum(-1, keepdim=True)
    return mask & (torch.arange(mask.shape[-1], device=mask.device) >= visible - window)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class CpuPagedAttention:
    """q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H * D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.invariant and meta.num_decodes == q.shape[0]:
            # every row a decode row (the invariant mode's prefill too): the kernel writes each
            # row's K/V at its slot itself (a write and a read back of the whole chunk: 6% of a
            # 1,000-token prefill of Gemma 3)
            if meta.keep is not None:
                return self._kept(q, k, v, k_cache, v_cache, meta)
            return self._decode(q, k_cache, v_cache, meta, k, v).view(q.shape[0], -1)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta)
        if meta.context_batch is not None:  # every prefill chunk in one call
            self._prefill_batched(q, k_cache, v_cache, meta.context_batch, out)
        else:
            for chunk in meta.prefills:
                rows = slice(chunk.token_start, chunk.token_start + chunk.num_query_tokens)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta.window)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _kept(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Every row's K/V into the cache, then the attention of the kept rows alone: a row's
        result is the same bits whatever rows share its call (the invariant kernel), and the
        cache holds what the whole call would have written."""
        assert meta.keep is not None and meta.decode_block_ids is not None and meta.decode_mask is not None
        keep = meta.keep
        torch.ops.argosy_iq.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kept = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping[keep],
            num_decodes=keep.numel(),
            decode_block_ids=meta.decode_block_ids.view(q.shape[0], -1)[keep].reshape(-1),
            decode_mask=meta.decode_mask[keep],
            keep=None,
            local={},
        )
        return self._decode(q[keep], k_cache, v_cache, kept, k[keep], v[keep]).view(keep.numel(), -1)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decode rows' attention; `k`, `v`: their new K/V, not yet in the cache (the
        invariant kernel writes them), else read back from it."""
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        if meta.invariant:  # the one kernel every row takes in this mode, eager and compiled
            rows = meta.num_decodes
            out = torch.ops.argosy_iq.attention(
                q,
                k if k is not None else k_cache.index_select(0, meta.slot_mapping[:rows]),
                v if v is not None else v_cache.index_select(0, meta.slot_mapping[:rows]),
                k_cache,
                v_cache,
                meta.slot_mapping[:rows],
                meta.decode_block_ids,
                meta.decode_mask,
                meta.block_size,
            )
        else:
            out = grouped_decode_attention(
                q, k_cache, v_cache, meta.decode_block_ids, meta.decode_mask, meta.block_size
            )
        return out.view(q.shape)

    def _prefill_batched(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ContextBatch,
        out: torch.Tensor,
    ) -> None:
        """Every prefill chunk in one SDPA call over K/V read back from the cache (padded; the
        mask hides padding and the future): the per-chunk path costs ~200-400 us of gathers
        and dispatch a chunk and layer, most of a step that prefills 8 short prompts or 8
        requests behind one shared system prompt."""
        chunks, lq, lk = batch.mask.shape[0], batch.num_queries, batch.num_context
        shape = (chunks, lk, self.num_kv_heads, self.head_dim)
        keys = k_cache.index_select(0, batch.context_slots).view(shape).transpose(1, 2)
        values = v_cache.index_select(0, batch.context_slots).view(shape).transpose(1, 2)
        queries = (
            q.index_select(0, batch.q_index).view(chunks, lq, self.num_heads, self.head_dim).transpose(1, 2)
        )
        result = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=batch.mask, enable_gqa=self.group > 1
        )
        rows = result.transpose(1, 2).reshape(chunks * lq, self.num_heads, self.head_dim)
        out.index_copy_(0, batch.out_rows, rows.index_select(0, batch.valid_rows))

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        window: int | None = None,
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if chunk.context_len == chunk.num_query_tokens and (window is None or window >= chunk.context_len):
            keys, values, mask, causal = k, v, None, True  # no earlier context: plain causal
        else:
            keys = k_cache.index_select(0, chunk.context_slots)
            values = v_cache.index_select(0, chunk.context_slots)
            offset = chunk.context_len - chunk.num_query_tokens
            device = q.device
            rows = torch.arange(chunk.num_query_tokens, device=device).unsqueeze(1) + offset
            mask = torch.arange(chunk.context_len, device=device).unsqueeze(0) <= rows
            if window is not None:
                mask = window_mask(mask, window)
            causal = False
        # enable_gqa: SDPA maps each query head to its KV head itself, bit-identical to
        # repeating K/V per query head and ~1.6x faster for a short chunk over a long context
        # (no 3x copy of the context). (A layout with the query group as extra query rows,
        # as in decode, changed bf16 rounding against a cold prefill of the same prompt.)
        kh = keys.transpose(0, 1).unsqueeze(0)
        vh = values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=self.group > 1
        )
        return out.squeeze(0).transpose(0, 1)


def grouped_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """One query token per row over its cached context. q: [B, H, D]; block_ids: [B * max_blocks]
    block table rows; mask: [B, 1, 1, max_blocks * block_size] bool. Returns [B, H * D].

    Each row's query heads are laid out as [KV heads, group, D], i.e. the group is the
    "query length" of an ordinary SDPA over the un-repeated K/V: one fused kernel, 3-7x faster
    on this CPU than matmul/softmax/matmul and far faster than SDPA's enable_gqa
    (see shared/notes/cpu-decode-probe.md). Whole blocks are gathered with index_select.
    """
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    shape = (n, mask.shape[-1], kv_heads, dim)
    keys = k_cache.view(k_cache.shape[0] // block_size, -1).index_select(0, block_ids).view(shape)
    values = v_cache.view(v_cache.shape[0] // block_size, -1).index_select(0, block_ids).view(shape)
    out = F.scaled_dot_product_attention(
        q.view(n, kv_heads, heads // kv_heads, dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
    )
    return out.reshape(n, heads * dim)
