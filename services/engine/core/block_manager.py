"""Paged KV blocks with a prefix cache.

Every full block whose KV has been computed is registered under a hash that chains the previous
block's hash with the block's token ids, so a later sequence with the same prefix reuses those blocks.
Freed blocks keep their hash and wait in an LRU free queue: a hit revives one until it is reused.

Per-block state lives in flat lists and arrays indexed by block id (no object per block), so a manager of
millions of blocks is built in milliseconds: building costs a few zero-filled buffers, not a loop.

Cache events (for SubscribeKvEvents): while recording is on, a hash is reported stored when it enters
`hash_to_block_id` and removed when it leaves it, so a subscriber's set always equals that map's keys.
"""

from array import array
from dataclasses import dataclass

from services.common.block_hash import block_key, hash_block_key
from services.engine.core.sequence import Sequence


class _FreeQueue:
    """The free blocks, oldest first, with O(1) take-from-head, push-head, push-tail and remove.

    NOTE: the queue is three runs, in order: blocks freed holding nothing cacheable (pushed at the head, so a
    stack, newest first), blocks never used (ids `next_fresh..num_blocks-1`, implicit), and blocks freed
    with a hash (pushed at the tail, a doubly linked list in two arrays with sentinel `num_blocks`). Only
    hashed blocks are ever removed from the middle (revival), and they all sit in the linked list.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.unhashed: list[int] = []
        self.next_fresh = 0
        self.num_linked = 0
        sentinel = num_blocks
        self.next = array("i", bytes(4 * (num_blocks + 1)))  # zero-filled: no Python loop over the blocks
        self.prev = array("i", bytes(4 * (num_blocks + 1)))
        self.next[sentinel] = self.prev[sentinel] = sentinel

    def __len__(self) -> int:
        return len(self.unhashed) + self.num_blocks - self.next_fresh + self.num_linked

    def pop_head(self) -> int:
        if self.unhashed:
            return self.unhashed.pop()
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        if not self.num_linked:
            raise RuntimeError("no free KV block")
        block_id = self.next[self.num_blocks]
        self.remove(block_id)
        return block_id

    def push_head_unhashed(self, block_id: int) -> None:
        self.unhashed.append(block_id)

    def push_tail(self, block_id: int) -> None:
        sentinel = self.num_blocks
        last = self.prev[sentinel]
        self.next[last] = block_id
        self.prev[block_id] = last
        self.next[block_id] = sentinel
        self.prev[sentinel] = block_id
        self.num_linked += 1

    def remove(self, block_id: int) -> None:
        """Unlink a block of the hashed run (a revived cache hit)."""
        before, after = self.prev[block_id], self.next[block_id]
        self.next[before] = after
        self.prev[after] = before
        self.num_linked -= 1

    def ordered(self) -> list[int]:
        """Every free block id, head first (for inspection and tests; O(num free))."""
        block_ids = self.unhashed[::-1] + list(range(self.next_fresh, self.num_blocks))
        block_id = self.next[self.num_blocks]
        while block_id != self.num_blocks:
            block_ids.append(block_id)
            block_id = self.next[block_id]
        return block_ids


@dataclass(slots=True)
class KvCacheEvents:
    """How the set of cached block hashes changed since the previous drain: each hash once, at its last change.

    `block_hashes[i]` is in the cache now if `cached[i]` is 1 (stored), out of it if 0 (removed): a hash stored
    then evicted within one drain is reported removed only, one evicted then stored again stored only. Bytes,
    not lists of ints: the changes cross a process boundary every step, and bytes pickle at memcpy speed.
    """

    block_hashes: bytes  # uint64 [N], native byte order (array("Q"))
    cached: bytes  # uint8 [N], 1 or 0

    def __bool__(self) -> bool:
        return bool(self.cached)

    def changes(self) -> dict[int, int]:
        """Hash -> 1 (stored) or 0 (removed)."""
        hashes = array("Q")
        hashes.frombytes(self.block_hashes)
        return dict(zip(hashes, self.cached))

    @property
    def stored_block_hashes(self) -> list[int]:
        return [block_hash for block_hash, cached in self.changes().items() if cached]

    @property
    def removed_block_hashes(self) -> list[int]:
        return [block_hash for block_hash, cached in self.changes().items() if not cached]


class BlockManager:
    """Hands out KV blocks to sequences and finds cached prefixes.

    Per block id: `ref_counts` (sequences holding it), `block_hashes` (set once its KV is computed and it is
    full; kept while it waits free, so it can be revived) and `block_keys` (what that hash digests: the
    collision guard). NOTE: the free queue is ordered oldest first: blocks are taken for new data from its
    head, and a freed block goes to its tail (or to its head when it holds nothing cacheable), so the least
    recently used cached blocks are evicted first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.hash_to_block_id: dict[int, int] = {}
        self._free = _FreeQueue(num_blocks)
        self._events: dict[int, bool] | None = None  # hash -> in the cache after its last change; None: not recording

    @property
    def num_total_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_counts) - len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be reused) first. O(num free blocks): for inspection only."""
        return self._free.ordered()

    def record_events(self, enabled: bool) -> None:
        """Start (from now on) or stop recording cache events; stopping drops the undrained ones."""
        if not enabled:
            self._events = None
        elif self._events is None:
            self._events = {}

    def take_events(self) -> KvCacheEvents | None:
        """The events recorded since the last call (None when not recording)."""
        events = self._events
        if events is None:
            return None
        self._events = {}
        return KvCacheEvents(array("Q", events).tobytes(), bytes(events.values()))

    def cached_block_hashes(self) -> array:
        """Every hash in the prefix cache now (a subscriber's snapshot): uint64 [num cached]."""
        return array("Q", self.hash_to_block_id)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that `seq` could reuse now (its last token is never among them).

        NOTE: at least one token is always computed, in a block of its own, so the step yields logits.
        A sequence that needs its prompt's log-probabilities reuses nothing: it needs every position's logits.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        block_ids: list[int] = []
        for index in range((len(seq.token_ids) - 1) // self.block_size):
            self._extend_hash_chain(seq, index + 1)
            block_id = self.hash_to_block_id.get(seq.block_hashes[index])
            if block_id is None or self.block_keys[block_id] != seq.block_keys[index]:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, seq: Sequence, cached_block_ids: list[int]) -> bool:
        """Whether `seq` can get its whole block table, reusing `cached_block_ids` (from cached_prefix).

        A hit on a block that sits in the free queue takes that block out of it, so it counts as used.
        """
        num_revived = sum(1 for block_id in cached_block_ids if self.ref_counts[block_id] == 0)
        num_new = seq.num_blocks(self.block_size) - len(cached_block_ids)
        return num_new + num_revived <= len(self._free)

    def allocate(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Give `seq` its whole block table: the prefix hits `cached_block_ids`, then new blocks.

        NOTE: `cached_block_ids` must come from cached_prefix(seq) with no block manager call in between
        (the scheduler does both within one schedule step), and can_allocate must have said yes.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        ref_counts = self.ref_counts
        for block_id in cached_block_ids:
            if ref_counts[block_id] == 0:
                self._free.remove(block_id)
            ref_counts[block_id] += 1
        num_new = seq.num_blocks(self.block_size) - len(cached_block_ids)
        seq.block_table = cached_block_ids + [self._take_free_block() for _ in range(num_new)]
        seq.num_cached_tokens = len(cached_block_ids) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_prefix_hit_tokens = seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go back to the free queue, last block first."""
        ref_counts = self.ref_counts
        for block_id in reversed(seq.block_table):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] > 0:
                continue
            if self.block_hashes[block_id] is None:
                self._free.push_head_unhashed(block_id)
            else:
                self._free.push_tail(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token `seq` computes next (its last one) has a slot, taking a free block if needed."""
        return len(seq.block_table) * self.block_size >= len(seq.token_ids) or len(self._free) > 0

    def may_append(self, seq: Sequence) -> None:
        """Add a block to `seq` when its last token starts a new one."""
        if len(seq.block_table) * self.block_size < len(seq.token_ids):
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step's computed tokens filled (call before num_cached_tokens moves)."""
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        first = seq.num_cached_tokens // block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // block_size
        self._extend_hash_chain(seq, end)
        hash_to_block_id, events = self.hash_to_block_id, self._events
        for index in range(first, end):
            block_id = seq.block_table[index]
            block_hash = seq.block_hashes[index]
            # NOTE: a block computed twice (two sequences prefilling the same prefix in one step) finds its hash
            # already mapped to its twin: the twin keeps the entry and this block stays unhashed, so it is
            # reused first once freed instead of holding an LRU slot no lookup can reach.
            mapped_block_id = hash_to_block_id.get(block_hash)
            if mapped_block_id is None:
                hash_to_block_id[block_hash] = block_id
                if events is not None:
                    events[block_hash] = True
            elif mapped_block_id != block_id:
                continue
            self.block_hashes[block_id] = block_hash
            self.block_keys[block_id] = seq.block_keys[index]

    def _extend_hash_chain(self, seq: Sequence, num_blocks: int) -> None:
        """Hash `seq`'s leading full blocks up to `num_blocks`, each once per sequence (kept on it)."""
        block_size = self.block_size
        hashes, keys = seq.block_hashes, seq.block_keys
        for index in range(len(hashes), num_blocks):
            key = block_key(seq.token_ids[index * block_size:(index + 1) * block_size], hashes[-1] if hashes else None)
            keys.append(key)
            hashes.append(hash_block_key(key))

    def _take_free_block(self) -> int:
        """Take the least recently used free block for new data, evicting its cache entry."""
        block_id = self._free.pop_head()
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.hash_to_block_id[block_hash]  # every hashed block holds its hash's entry
            if self._events is not None:
                self._events[block_hash] = False
            self.block_hashes[block_id] = None
            self.block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id
