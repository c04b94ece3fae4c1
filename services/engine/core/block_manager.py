"""Paged KV blocks with a prefix cache.

Every full block whose KV has been computed is registered under a hash that chains the previous
block's hash with the block's token ids, so a later sequence with the same prefix reuses those blocks.
Freed blocks keep their hash and wait in an LRU free queue: a hit revives one until it is reused.
"""

from array import array
from collections import OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

import xxhash

from services.engine.core.sequence import Sequence


def hash_block_tokens(token_ids: TokenIds[int], prefix_hash: int | None) -> int:
    """xxh64 of one block's token ids chained with the hash of the block before it (None for the first)."""
    hasher = xxhash.xxh64()
    if prefix_hash is not None:
        hasher.update(prefix_hash.to_bytes(8, "little"))
    hasher.update(array("i", token_ids).tobytes())
    return hasher.intdigest()


@dataclass(slots=True)
class Block:
    """One KV block. `block_hash` and `token_ids` are set once its KV is computed and it is full."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV blocks to sequences and finds cached prefixes.

    NOTE: the free queue is ordered oldest first: blocks are taken for new data from its head, and a
    freed block goes to its tail (or to its head when it holds nothing cacheable), so the least recently
    used cached blocks are evicted first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    def can_allocate(self, seq: Sequence) -> int | None:
        """Number of leading blocks of `seq` served from the prefix cache, or None if its blocks can't be had.

        A hit on a block that sits in the free queue takes that block out of it, so it counts as used.
        """
        cached_block_ids = self.cached_prefix(seq)
        num_revived = sum(1 for block_id in cached_block_ids if self.blocks[block_id].ref_count == 0)
        num_new = seq.num_blocks(self.block_size) - len(cached_block_ids)
        if num_new + num_revived > len(self.free_block_ids):
            return None
        return len(cached_block_ids)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that `seq` could reuse now (its last token is never among them)."""
        return self._match_prefix(seq, self._max_cached_blocks(seq))

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Give `seq` its whole block table: `num_cached_blocks` prefix hits (from can_allocate), then new blocks."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        cached_block_ids = self._match_prefix(seq, num_cached_blocks)
        if len(cached_block_ids) != num_cached_blocks:
            raise RuntimeError("prefix cache changed between can_allocate and allocate")
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        num_new = seq.num_blocks(self.block_size) - num_cached_blocks
        seq.block_table = cached_block_ids + [self._take_free_block() for _ in range(num_new)]
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        if seq.num_preemptions == 0:
            seq.num_prefix_hit_tokens = seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go back to the free queue, last block first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self.free_block_ids[block_id] = None
            if block.block_hash is None:
                block.token_ids = ()
                self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token `seq` computes next (its last one) has a slot, taking a free block if needed."""
        return len(seq.block_table) >= seq.num_blocks(self.block_size) or bool(self.free_block_ids)

    def may_append(self, seq: Sequence) -> None:
        """Add a block to `seq` when its last token starts a new one."""
        if len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step's computed tokens filled (call before num_cached_tokens moves)."""
        if not self.enable_prefix_caching:
            return
        first = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for index in range(first, end):
            prefix_hash = self.blocks[seq.block_table[index - 1]].block_hash if index > 0 else None
            if index > 0 and prefix_hash is None:
                return
            token_ids = seq.block_token_ids(index, self.block_size)
            block = self.blocks[seq.block_table[index]]
            block.block_hash = hash_block_tokens(token_ids, prefix_hash)
            block.token_ids = tuple(token_ids)
            self.hash_to_block_id[block.block_hash] = block.block_id

    def _max_cached_blocks(self, seq: Sequence) -> int:
        """NOTE: at least one token is always computed, in a block of its own, so the step yields logits."""
        if not self.enable_prefix_caching:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def _match_prefix(self, seq: Sequence, limit: int) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, at most `limit` blocks."""
        block_ids: list[int] = []
        prefix_hash = None
        for index in range(limit):
            token_ids = seq.block_token_ids(index, self.block_size)
            prefix_hash = hash_block_tokens(token_ids, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
                break
            block_ids.append(block_id)
        return block_ids

    def _take_free_block(self) -> int:
        """Take the least recently used free block for new data, evicting its cache entry."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block_id.get(block.block_hash) == block_id:
            del self.hash_to_block_id[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.ref_count = 1
        return block_id
