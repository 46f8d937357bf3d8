"""BlockManager: accounts for KV-cache blocks; never decides who runs.

Blocks are fixed-size slabs of `block_size` token slots. Each block has a reference count;
a block whose count drops to zero returns to the free queue but keeps its prefix-cache key
(if it was full) until it is handed out again, so a later request with the same prefix can
take it back ("touch"). Allocation pops the free queue's head, so the least recently freed
block is evicted first; a finished sequence's blocks are queued tail-first, so its deepest
blocks go before its shared root.

A full block's key is hash(parent key, its token ids): equal keys mean equal whole prefixes.

Past the last whole block a prompt shares, reuse goes on token by token: a cached block under the
same parent whose leading tokens equal the prompt's next ones lends those tokens' K/V, copied into
the prompt's own fresh block (`find_partial`; the runner copies before the step). Their K/V are
the same bits as a recompute would give (same tokens, same positions, the same prefix before them:
the kernels' rows never depend on their batch). A shared system prompt rarely ends on a block
boundary: with 16-token blocks a request re-ran up to 15 of its tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import islice

from argosy.engine.sequence import Sequence


def block_key(parent: bytes | None, token_ids: list[int], images: bytes = b"") -> bytes:
    """`images`: the digests of the images whose tokens the block holds (a VLM's prompt)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(array("q", token_ids).tobytes())
    digest.update(images)
    return digest.digest()


def parent_key(seq: Sequence, i: int) -> bytes | None:
    """The key block i of `seq` chains from: block i - 1's, or the root's (its cache salt)."""
    return seq.block_hashes[i - 1] if i else seq.cache_salt


# the most recently cached blocks under one parent that find_partial compares (a bound on its
# work when many prompts branch at one point)
_MAX_PARTIAL_CANDIDATES = 64


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block id
        # a cached block's token ids and its parent's key, and per parent key its cached
        # children: where find_partial looks (blocks holding an image's tokens are left out)
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.parents: list[bytes] = [b""] * num_blocks
        self.children: dict[bytes, dict[int, None]] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # prompt tokens found

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_keys(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` over every full block of its known tokens."""
        bs = self.block_size
        num_full = seq.num_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = parent_key(seq, i)
            tokens = [seq.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            images = b"".join(im.digest for im in seq.images if im.start < (i + 1) * bs and im.stop > i * bs)
            seq.block_hashes.append(block_key(parent, tokens, images))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (its last token excluded,
        so at least one token is always computed and no shared block is written)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self.update_keys(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in seq.block_hashes[:max_blocks]:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_partial(self, seq: Sequence, num_cached_blocks: int) -> tuple[int, int] | None:
        """(block id, n): a cached block whose first n tokens equal the ones of `seq` that follow
        its `num_cached_blocks` cached whole blocks, the longest such n (>= 1; the last token of
        `seq` never counted); None if none."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or seq.images:
            return None
        self.update_keys(seq)
        bs = self.block_size
        start = num_cached_blocks * bs
        limit = min(bs, seq.num_tokens - 1 - start)
        candidates = self.children.get(parent_key(seq, num_cached_blocks) or b"")
        if limit < 1 or not candidates:
            return None
        want = [seq.token_at(start + j) for j in range(limit)]
        best_block, best = -1, 0
        for block_id in islice(reversed(candidates), _MAX_PARTIAL_CANDIDATES):
            tokens = self.block_tokens[block_id]
            assert tokens is not None
            n = 0
            while n < limit and tokens[n] == want[n]:
                n += 1
            if n > best:
                best_block, best = block_id, n
        return (best_block, best) if best else None

    def probe_cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` are in cached blocks now (whole blocks,
        the last token excluded as find_cached_prefix does). Reads, changes nothing."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent: bytes | None = None
        num_found = 0
        for i in range((len(token_ids) - 1) // bs):
            parent = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            if self.cached.get(parent) is None:
                break
            num_found += bs
        return num_found

    def _num_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int) -> int:
        total = seq.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        return max(0, self.num_blocks_for(total) - len(seq.block_table) - num_cached_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        # cached blocks that sit in the free queue stop being free once touched
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        needed = self._num_needed(seq, num_new_tokens, len(cached_blocks))
        return needed + num_revived <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_needed(seq, num_new_tokens, 0) <= self.num_free_blocks

    # -- transitions ---------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> None:
        """Admit `seq`: take its cached prefix blocks, then fresh blocks for
        `num_new_tokens` more tokens. Sets `num_computed_tokens` past the cached prefix."""
        assert not seq.block_table, "allocate() is for sequences holding no blocks"
        if seq.params.prompt_logprobs is None and seq.is_first_admission:
            self.num_prefix_queries += seq.num_prompt_tokens
            self.num_prefix_hits += min(len(cached_blocks) * self.block_size, seq.num_prompt_tokens)
        for block_id in cached_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def take_partial(self, seq: Sequence, partial: tuple[int, int]) -> tuple[int, int, int]:
        """After `allocate` (its `num_new_tokens` counting the partial's tokens): the partial
        block's first n tokens count as computed; returns the copy the runner makes before the
        step, (source block, the sequence's block, n)."""
        source, n = partial
        index = seq.num_computed_tokens // self.block_size
        assert seq.num_computed_tokens % self.block_size == 0 and index < len(seq.block_table)
        seq.num_computed_tokens += n
        if seq.params.prompt_logprobs is None and seq.is_first_admission:
            self.num_prefix_hits += n
        return source, seq.block_table[index], n

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self._num_needed(seq, num_new_tokens, 0)):
            seq.block_table.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        seq.block_table = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the keys of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        self.update_keys(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(num_full):
            block_id = seq.block_table[i]
            if self.keys[block_id] is not None:
                continue
            key = seq.block_hashes[i]
            if key in self.cached:  # an identical block exists already; keep that one
                continue
            self.keys[block_id] = key
            self.cached[key] = block_id
            start = i * self.block_size
            if not any(im.start < start + self.block_size and im.stop > start for im in seq.images):
                parent = parent_key(seq, i) or b""
                self.block_tokens[block_id] = tuple(
                    seq.token_at(j) for j in range(start, start + self.block_size)
                )
                self.parents[block_id] = parent
                self.children.setdefault(parent, {})[block_id] = None

    def reset_prefix_cache(self) -> None:
        for key, block_id in list(self.cached.items()):
            if self.ref_counts[block_id] == 0:
                self.keys[block_id] = None
                del self.cached[key]
                self._forget_tokens(block_id)

    def _forget_tokens(self, block_id: int) -> None:
        if self.block_tokens[block_id] is None:
            return
        self.block_tokens[block_id] = None
        siblings = self.children[self.parents[block_id]]
        del siblings[block_id]
        if not siblings:
            del self.children[self.parents[block_id]]

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        key = self.keys[block_id]
        if key is not None:  # evict: this block's content is about to be overwritten
            del self.cached[key]
            self.keys[block_id] = None
            self._forget_tokens(block_id)
        self.ref_counts[block_id] = 1
        return block_id
