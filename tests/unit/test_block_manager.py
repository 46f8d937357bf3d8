"""BlockManager: exact block ids, ref counts, prefix-cache hits and LRU eviction order.

In the manner of vLLM's test_prefix_caching.py: every test pins the block ids handed out and
the free queue's order, not just counts. Block size 4 throughout, so a block's tokens are
easy to read off.
"""

from __future__ import annotations

import itertools

import pytest

from argosy.engine.block_manager import BlockManager, block_key
from argosy.engine.sequence import Sequence
from argosy.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], prompt_logprobs: int | None = None) -> Sequence:
    params = SamplingParams(max_tokens=16, detokenize=False, prompt_logprobs=prompt_logprobs)
    return Sequence(f"seq-{next(_ids)}", list(tokens), params)


def admit(bm: BlockManager, seq: Sequence, num_new_tokens: int | None = None) -> list[int]:
    """What the scheduler does for a waiting sequence: look up, check, allocate. Returns the hits."""
    cached = bm.find_cached_prefix(seq)
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - len(cached) * BS
    assert bm.can_allocate(seq, num_new_tokens, cached)
    bm.allocate(seq, num_new_tokens, cached)
    return cached


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler does after the model ran `num_tokens` more tokens of `seq`."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def run_prompt(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Admit a prompt and compute all of it (blocks published)."""
    seq = make_seq(tokens)
    admit(bm, seq)
    compute(bm, seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


A = list(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
B = list(range(100, 108))  # 8 tokens: exactly 2 full blocks


# -- plain allocation ----------------------------------------------------------------------
def test_fresh_allocation_takes_blocks_in_free_queue_order() -> None:
    bm = BlockManager(8, BS)
    s1, s2 = make_seq(A), make_seq([1, 2, 3, 4, 5])
    admit(bm, s1)
    admit(bm, s2)
    assert s1.block_table == [0, 1, 2]
    assert s2.block_table == [3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert list(bm.free_queue) == [5, 6, 7]
    assert bm.num_free_blocks == 3
    assert s1.num_computed_tokens == 0


def test_allocate_only_what_the_chunk_needs_then_append() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    admit(bm, seq, num_new_tokens=5)  # a 5-token prefill chunk: 2 blocks
    assert seq.block_table == [0, 1]
    compute(bm, seq, 5)
    bm.append_slots(seq, 3)  # tokens 5..7 still fit in block 1
    assert seq.block_table == [0, 1]
    compute(bm, seq, 3)
    bm.append_slots(seq, 2)  # tokens 8, 9
    assert seq.block_table == [0, 1, 2]
    compute(bm, seq, 2)
    # decoding: a new block only when the sampled token spills past a block boundary
    seq.output_token_ids.append(7)  # token 10
    bm.append_slots(seq, 1)
    assert seq.block_table == [0, 1, 2]
    compute(bm, seq, 1)
    seq.output_token_ids.append(8)  # token 11
    bm.append_slots(seq, 1)
    compute(bm, seq, 1)
    seq.output_token_ids.append(9)  # token 12: block 3 starts
    bm.append_slots(seq, 1)
    assert seq.block_table == [0, 1, 2, 3]
    assert list(bm.free_queue) == [4, 5, 6, 7]


def test_can_allocate_and_can_append_count_free_blocks() -> None:
    bm = BlockManager(3, BS)
    big = make_seq(list(range(13)))  # 4 blocks
    assert not bm.can_allocate(big, 13, [])
    assert bm.can_allocate(big, 12, [])  # a 12-token chunk needs 3
    seq = make_seq(list(range(12)))
    admit(bm, seq)
    compute(bm, seq, 12)
    seq.output_token_ids.append(1)
    assert bm.num_free_blocks == 0
    assert not bm.can_append(seq, 1)
    assert bm.can_append(make_seq([1]), 0)


def test_free_returns_blocks_tail_first_and_clears_the_table() -> None:
    bm = BlockManager(8, BS)
    s1, s2 = make_seq(A), make_seq([1, 2, 3, 4, 5])
    admit(bm, s1)
    admit(bm, s2)
    bm.free(s1)
    assert s1.block_table == []
    assert bm.ref_counts == [0, 0, 0, 1, 1, 0, 0, 0]
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    bm.free(s2)
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert bm.ref_counts == [0] * 8


# -- prefix hits ---------------------------------------------------------------------------
def test_two_sequences_share_full_prefix_blocks() -> None:
    bm = BlockManager(8, BS)
    first = run_prompt(bm, A)
    assert first.block_table == [0, 1, 2]
    second = make_seq(A[:8] + [500, 501, 502])
    hits = admit(bm, second)
    assert hits == [0, 1]
    assert second.block_table == [0, 1, 3]
    assert second.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert list(bm.free_queue) == [4, 5, 6, 7]
    # freeing one holder keeps the shared blocks out of the free queue
    bm.free(first)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert list(bm.free_queue) == [4, 5, 6, 7, 2]


def test_partial_last_block_is_never_shared() -> None:
    bm = BlockManager(8, BS)
    first = run_prompt(bm, A)  # block 2 holds only tokens 8, 9
    assert bm.keys[2] is None
    assert len(bm.cached) == 2
    longer = make_seq(A + [600, 601, 602])  # same 10 tokens, then more
    assert bm.find_cached_prefix(longer) == [0, 1]
    assert first.block_table == [0, 1, 2]


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, B)  # both blocks full and published
    assert len(bm.cached) == 2
    exactly_two_blocks = make_seq(B)
    assert bm.find_cached_prefix(exactly_two_blocks) == [0]
    one_more = make_seq(B + [7])
    assert bm.find_cached_prefix(one_more) == [0, 1]
    # admitting the 2-block prompt computes its whole second block (its last token included)
    seq = make_seq(B)
    admit(bm, seq)
    assert seq.block_table == [0, 2]
    assert seq.num_computed_tokens == 4


def test_keys_chain_the_whole_prefix() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, B)
    assert bm.keys[0] == block_key(None, B[:4])
    assert bm.keys[1] == block_key(block_key(None, B[:4]), B[4:8])
    # same second block, different first block: no hit at all
    other = make_seq([9, 9, 9, 9] + B[4:8] + [1])
    assert bm.find_cached_prefix(other) == []
    # same first block, different second: one hit
    half = make_seq(B[:4] + [9, 9, 9, 9, 1])
    assert bm.find_cached_prefix(half) == [0]


def test_prompt_logprobs_and_disabled_caching_bypass_the_cache() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, A)
    assert bm.find_cached_prefix(make_seq(A + [1], prompt_logprobs=2)) == []
    off = BlockManager(8, BS, enable_prefix_caching=False)
    run_prompt(off, A)
    assert off.cached == {}
    assert off.keys == [None] * 8
    assert off.find_cached_prefix(make_seq(A + [1])) == []


def test_prefix_stats_count_prompt_tokens() -> None:
    bm = BlockManager(16, BS)
    run_prompt(bm, A)
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10, 0)
    admit(bm, make_seq(A[:8] + [1, 2, 3]))
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (21, 8)
    admit(bm, make_seq(A + [1], prompt_logprobs=0))  # not a cache query
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (21, 8)


# -- revived blocks and can_allocate -------------------------------------------------------
def test_can_allocate_counts_revived_cached_blocks() -> None:
    bm = BlockManager(4, BS)
    first = run_prompt(bm, list(range(9)))  # blocks 0, 1 full; block 2 partial
    bm.free(first)
    assert list(bm.free_queue) == [3, 2, 1, 0]
    # 20 tokens = 5 blocks: 2 cached (both in the free queue) + 3 new = 5 taken from 4 free
    too_big = make_seq(list(range(8)) + list(range(50, 62)))
    hits = bm.find_cached_prefix(too_big)
    assert hits == [0, 1]
    assert not bm.can_allocate(too_big, 12, hits)
    # 16 tokens = 4 blocks: 2 revived + 2 new fits exactly
    fits = make_seq(list(range(8)) + list(range(50, 58)))
    hits = bm.find_cached_prefix(fits)
    assert bm.can_allocate(fits, 8, hits)
    bm.allocate(fits, 8, hits)
    assert fits.block_table == [0, 1, 3, 2]
    assert bm.num_free_blocks == 0
    assert bm.ref_counts == [1, 1, 1, 1]


def test_can_allocate_does_not_count_blocks_still_in_use() -> None:
    bm = BlockManager(5, BS)
    run_prompt(bm, list(range(9)))  # holds 0, 1, 2; free: 3, 4
    fits = make_seq(list(range(8)) + list(range(50, 58)))  # 2 shared + 2 new
    hits = bm.find_cached_prefix(fits)
    assert hits == [0, 1]
    assert bm.can_allocate(fits, 8, hits)
    too_big = make_seq(list(range(8)) + list(range(50, 62)))  # 2 shared + 3 new
    assert not bm.can_allocate(too_big, 12, bm.find_cached_prefix(too_big))


# -- eviction ------------------------------------------------------------------------------
# -- token by token past the whole blocks (find_partial / take_partial) ----------------------
def admit_with_partial(bm: BlockManager, seq: Sequence) -> tuple[list[int], tuple[int, int, int] | None]:
    """What the scheduler does: whole blocks, then part of one; returns the hits and the copy."""
    cached = bm.find_cached_prefix(seq)
    partial = bm.find_partial(seq, len(cached))
    n = partial[1] if partial else 0
    num_new = seq.num_tokens - len(cached) * BS - n
    assert bm.can_allocate(seq, n + num_new, cached)
    bm.allocate(seq, n + num_new, cached)
    return cached, bm.take_partial(seq, partial) if partial else None


def test_a_prompt_takes_the_leading_tokens_of_a_cached_block_as_a_copy() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, B + [7])  # blocks 0 and 1 published, block 2 holds one token
    seq = make_seq(B[:6] + [900, 901])  # block 0 whole, then 2 of block 1's 4 tokens
    cached, copy = admit_with_partial(bm, seq)
    assert cached == [0]
    assert seq.block_table == [0, 3]
    assert copy == (1, 3, 2)  # block 1's first 2 slots into the sequence's block 3
    assert seq.num_computed_tokens == 6
    assert bm.num_prefix_hits == 6


def test_the_longest_match_among_siblings_wins_and_the_last_token_is_computed() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, B[:4] + [50, 51, 60, 61, 0])  # block 1: 50 51 60 61
    run_prompt(bm, B[:4] + [50, 51, 52, 70, 0])  # block 3: 50 51 52 70 (same parent)
    assert bm.find_partial(make_seq(B[:4] + [50, 51, 52, 99, 5]), 1) == (3, 3)
    assert bm.find_partial(make_seq(B[:4] + [50, 51, 60, 1]), 1) == (1, 3)
    # the whole of block 3's tokens but the prompt ends there: its last token is computed
    assert bm.find_partial(make_seq(B[:4] + [50, 51, 52, 70]), 1) == (3, 3)
    assert bm.find_partial(make_seq(B[:4] + [99, 50, 51, 52, 70]), 1) is None
    # another parent: no match, whatever the tokens
    assert bm.find_partial(make_seq([1, 2, 3, 4, 50, 51, 52, 70, 0]), 1) is None
    # the first block's siblings sit under the root
    assert bm.find_partial(make_seq(B[:3] + [0]), 0) == (0, 3)


def test_an_evicted_block_is_no_longer_lent() -> None:
    bm = BlockManager(2, BS)
    a = run_prompt(bm, B)
    bm.free(a)
    assert bm.find_partial(make_seq(B[:6] + [9]), 1) == (1, 2)
    admit(bm, make_seq([1, 2, 3]))  # takes block 1 (the deepest) for new content
    assert bm.find_partial(make_seq(B[:6] + [9]), 1) is None
    assert bm.children == {b"": {0: None}}
    bm.reset_prefix_cache()
    assert bm.children == {} and bm.block_tokens == [None, None]


def test_prompt_logprobs_and_disabled_caching_take_no_partial_block() -> None:
    bm = BlockManager(8, BS)
    run_prompt(bm, B + [7])
    assert bm.find_partial(make_seq(B[:6] + [1], prompt_logprobs=1), 1) is None
    off = BlockManager(8, BS, enable_prefix_caching=False)
    run_prompt(off, B + [7])
    assert off.find_partial(make_seq(B[:6] + [1]), 1) is None


def test_eviction_is_lru_and_deepest_block_first() -> None:
    bm = BlockManager(6, BS)
    a = run_prompt(bm, B)  # blocks 0, 1
    b = run_prompt(bm, list(range(200, 208)))  # blocks 2, 3
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [4, 5, 1, 0, 3, 2]
    c = run_prompt(bm, list(range(300, 312)))  # 3 blocks: never-used ones, then a's deepest
    assert c.block_table == [4, 5, 1]
    # a's second block was evicted: its key is gone, its first block still hits
    assert bm.keys[1] is not None  # now holds c's third block
    assert bm.find_cached_prefix(make_seq(B + [1])) == [0]
    d = run_prompt(bm, list(range(400, 405)))  # 2 blocks: a's root, then b's deepest
    assert d.block_table == [0, 3]
    assert bm.find_cached_prefix(make_seq(B + [1])) == []
    assert bm.find_cached_prefix(make_seq(list(range(200, 208)) + [1])) == [2]


def test_eviction_removes_the_key_so_a_later_lookup_misses() -> None:
    bm = BlockManager(2, BS)
    a = run_prompt(bm, B)
    key0, key1 = bm.keys[0], bm.keys[1]
    bm.free(a)
    assert bm.cached == {key0: 0, key1: 1}
    other = make_seq([1, 2, 3])
    admit(bm, other)
    assert other.block_table == [1]  # the deepest block goes first
    assert bm.keys[1] is None
    assert bm.cached == {key0: 0}
    assert bm.find_cached_prefix(make_seq(B + [1])) == [0]


def test_a_touched_cached_block_leaves_the_free_queue() -> None:
    bm = BlockManager(6, BS)
    a = run_prompt(bm, B)  # 0, 1
    b = run_prompt(bm, list(range(200, 208)))  # 2, 3
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [4, 5, 1, 0, 3, 2]
    again = make_seq(B + [1])
    assert admit(bm, again) == [0, 1]
    assert again.block_table == [0, 1, 4]
    assert list(bm.free_queue) == [5, 3, 2]
    assert bm.ref_counts == [1, 1, 0, 0, 1, 0]
    # freed again, the re-touched blocks are now the most recently used: evicted last
    bm.free(again)
    assert list(bm.free_queue) == [5, 3, 2, 4, 1, 0]
    fresh = run_prompt(bm, list(range(500, 516)))
    assert fresh.block_table == [5, 3, 2, 4]
    assert bm.find_cached_prefix(make_seq(B + [1])) == [0, 1]


# -- publishing ----------------------------------------------------------------------------
def test_cache_full_blocks_publishes_only_full_computed_blocks() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(A)
    admit(bm, seq, num_new_tokens=6)  # blocks 0, 1
    compute(bm, seq, 6)  # block 0 full and computed; block 1 half computed
    assert bm.keys[0] == block_key(None, A[:4])
    assert bm.keys[1] is None
    assert list(bm.cached.values()) == [0]
    bm.append_slots(seq, 4)
    compute(bm, seq, 4)  # tokens 0..9 computed: block 1 full, block 2 partial
    assert list(bm.cached.values()) == [0, 1]
    assert bm.keys[2] is None
    # outputs fill block 2; it is published once the tokens are computed, not before
    seq.output_token_ids.extend([1, 2])
    bm.update_keys(seq)
    assert len(seq.block_hashes) == 3
    bm.cache_full_blocks(seq)
    assert bm.keys[2] is None
    compute(bm, seq, 2)
    assert bm.keys[2] == block_key(bm.keys[1], A[8:] + [1, 2])
    assert list(bm.cached.values()) == [0, 1, 2]


def test_duplicate_content_keeps_the_first_block() -> None:
    bm = BlockManager(8, BS)
    x, y = make_seq(A), make_seq(A)
    admit(bm, x)
    admit(bm, y)  # neither is computed yet: no hit, separate blocks
    assert (x.block_table, y.block_table) == ([0, 1, 2], [3, 4, 5])
    compute(bm, x, 10)
    compute(bm, y, 10)
    assert list(bm.cached.values()) == [0, 1]
    assert bm.keys[3] is None and bm.keys[4] is None
    assert bm.find_cached_prefix(make_seq(A + [1])) == [0, 1]
    # y's duplicates carry no key: reusing them evicts nothing
    bm.free(y)
    z = run_prompt(bm, list(range(700, 712)))
    assert z.block_table == [6, 7, 5]
    assert list(bm.cached.values())[:2] == [0, 1]


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, BS)
    held = run_prompt(bm, B)  # 0, 1 (held)
    gone = run_prompt(bm, list(range(200, 208)))  # 2, 3
    bm.free(gone)
    assert len(bm.cached) == 4
    bm.reset_prefix_cache()
    assert sorted(bm.cached.values()) == [0, 1]
    assert bm.keys[2] is None and bm.keys[3] is None
    assert bm.find_cached_prefix(make_seq(list(range(200, 208)) + [1])) == []
    assert bm.find_cached_prefix(make_seq(B + [1])) == [0, 1]
    assert list(bm.free_queue) == [4, 5, 6, 7, 3, 2]  # the free queue itself is untouched
    assert held.block_table == [0, 1]


@pytest.mark.parametrize("num_tokens, expected", [(1, 1), (4, 1), (5, 2), (16, 4), (17, 5)])
def test_num_blocks_for_rounds_up(num_tokens: int, expected: int) -> None:
    assert BlockManager(1, BS).num_blocks_for(num_tokens) == expected
