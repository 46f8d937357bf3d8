"""CpuPagedAttention's prefill paths: prefill chunks (cold, or over cached context) batched
into one padded call give what each chunk computes alone, to rounding (SDPA's blocking
follows the padded lengths, so the last bits can differ; a batch_invariant request is
scheduled alone and never batched)."""

from __future__ import annotations

import pytest
import torch

from argosy.ops.attention import AttentionMetadata, ContextBatch, CpuPagedAttention, PrefillChunk

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _chunks(token_counts: list[tuple[int, int]], num_blocks: int) -> list[PrefillChunk]:
    """(query tokens, context length) per chunk; each chunk's context on shuffled blocks."""
    generator = torch.Generator().manual_seed(5)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    chunks, start = [], 0
    for queries, context in token_counts:
        blocks = [order.pop() for _ in range((context + BLOCK - 1) // BLOCK)]
        slots = (torch.tensor(blocks).unsqueeze(1) * BLOCK + torch.arange(BLOCK)).view(-1)[:context]
        chunks.append(PrefillChunk(start, queries, context, slots))
        start += queries
    return chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_context_prefill_equals_each_chunk_alone(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # three chunks over cached context (different lengths) and one cold prompt
    chunks = _chunks([(5, 37), (1, 9), (12, 60), (7, 7)], num_blocks=40)
    tokens = sum(c.num_query_tokens for c in chunks)
    q = torch.randn(tokens, HEADS, DIM, dtype=dtype)
    k, v = torch.randn(tokens, KV_HEADS, DIM, dtype=dtype), torch.randn(tokens, KV_HEADS, DIM, dtype=dtype)
    k_cache = torch.randn(40 * BLOCK, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.cat([c.context_slots[c.context_len - c.num_query_tokens :] for c in chunks])
    meta = AttentionMetadata(slot_mapping, torch.zeros(0), torch.zeros(0), block_size=BLOCK, prefills=chunks)
    assert ContextBatch.worth_it(chunks, max_padding=4.0)
    meta.context_batch = ContextBatch.build(chunks)
    assert meta.context_batch.mask.shape == (4, 1, 12, 60)
    attention = CpuPagedAttention(HEADS, KV_HEADS, DIM)
    batched = attention.forward(q, k, v, k_cache, v_cache, meta)
    for chunk in chunks:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_query_tokens)
        alone = attention._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(
            batched.view(tokens, HEADS, DIM)[rows], alone, atol=tolerance, rtol=tolerance
        )


def test_context_batch_masks_padding_and_the_future() -> None:
    chunks = _chunks([(2, 5), (3, 3 + 4)], num_blocks=8)
    batch = ContextBatch.build(chunks)
    assert (batch.num_queries, batch.num_context) == (3, 7)
    # chunk 0: queries at positions 3, 4 of 5; its padding query row sees slot 0 only
    assert batch.mask[0, 0].int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.mask[1, 0, 0].int().tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert batch.valid_rows.tolist() == [0, 1, 3, 4, 5]
    assert batch.out_rows.tolist() == [0, 1, 2, 3, 4]


def test_batching_waits_for_chunks_of_like_size() -> None:
    alike = _chunks([(40, 40), (35, 35), (12, 1000), (10, 1000)], num_blocks=600)
    assert not ContextBatch.worth_it(alike)  # 4 x 40 x 1000 padded vs ~27k real
    assert ContextBatch.worth_it(alike[2:])
    assert ContextBatch.worth_it(alike[:2])
    assert not ContextBatch.worth_it(alike[:1])
