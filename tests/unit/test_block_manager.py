"""Block manager: hash chain, ref counts, LRU free queue, revival, collision guard, caching off."""

import itertools
import random
from collections import OrderedDict

import pytest
import xxhash

from services.engine.core import block_manager as block_manager_module
from services.common.block_hash import hash_block_tokens, prompt_block_hashes
from services.engine.core.block_manager import BlockManager, _FreeQueue
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import Sequence

BLOCK_SIZE = 4
_seq_ids = itertools.count()


def make_seq(token_ids: list[int]) -> Sequence:
    seq_id = next(_seq_ids)
    return Sequence(seq_id, f"req-{seq_id}", list(token_ids), SamplingParams())


def compute(manager: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a step does to a sequence: its next `num_tokens` (default: all the rest) get KV and are hashed."""
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens if num_tokens is None else num_tokens
    manager.hash_blocks(seq)
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0


def admit(manager: BlockManager, token_ids: list[int]) -> Sequence:
    seq = make_seq(token_ids)
    cached_block_ids = manager.cached_prefix(seq)
    assert manager.can_allocate(seq, cached_block_ids)
    manager.allocate(seq, cached_block_ids)
    return seq


def fits(manager: BlockManager, token_ids: list[int]) -> tuple[bool, int]:
    """(can_allocate, number of prefix-cache hits) for a new sequence of these tokens."""
    seq = make_seq(token_ids)
    cached_block_ids = manager.cached_prefix(seq)
    return manager.can_allocate(seq, cached_block_ids), len(cached_block_ids)


def admit_and_compute(manager: BlockManager, token_ids: list[int]) -> Sequence:
    seq = admit(manager, token_ids)
    compute(manager, seq)
    return seq


def test_same_prefix_and_tokens_give_same_hash():
    first = hash_block_tokens([1, 2, 3, 4], None)
    assert hash_block_tokens([1, 2, 3, 4], None) == first
    assert hash_block_tokens([5, 6, 7, 8], first) == hash_block_tokens([5, 6, 7, 8], hash_block_tokens([1, 2, 3, 4], None))
    assert hash_block_tokens([1, 2, 3, 5], None) != first


def test_hash_follows_the_documented_byte_layout():
    """engine.proto tells other-language subscribers this exact rule: xxh64 of parent LE u64 + LE int32 ids."""
    import struct

    import xxhash

    first = xxhash.xxh64_intdigest(struct.pack("<4i", 1, 2, 3, 4))
    assert hash_block_tokens([1, 2, 3, 4], None) == first
    assert hash_block_tokens([5, 6, 7, 8], first) == xxhash.xxh64_intdigest(struct.pack("<Q4i", first, 5, 6, 7, 8))


def test_router_prompt_hashes_equal_the_engines_cached_block_hashes():
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    seq = admit_and_compute(manager, prompt)
    cached = [manager.block_hashes[block_id] for block_id in seq.block_table[:2]]
    assert prompt_block_hashes(prompt, 4) == cached
    assert prompt_block_hashes(prompt[:8], 4) == cached
    assert prompt_block_hashes(prompt[:7], 4) == cached[:1]
    assert prompt_block_hashes(prompt[:3], 4) == []


def test_same_tokens_after_different_prefix_hash_differently():
    after_a = hash_block_tokens([5, 6, 7, 8], hash_block_tokens([1, 2, 3, 4], None))
    after_b = hash_block_tokens([5, 6, 7, 8], hash_block_tokens([1, 2, 3, 9], None))
    assert after_a != after_b
    assert hash_block_tokens([5, 6, 7, 8], None) not in (after_a, after_b)


def test_allocate_gives_distinct_blocks_for_every_token():
    manager = BlockManager(8, BLOCK_SIZE)
    seq = admit(manager, list(range(10)))
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert seq.num_cached_tokens == 0
    assert manager.num_free_blocks == 5
    assert manager.num_used_blocks == 3


def test_shared_prefix_blocks_are_ref_counted():
    manager = BlockManager(8, BLOCK_SIZE)
    first = admit_and_compute(manager, list(range(10)))
    second = admit(manager, list(range(8)) + [50, 51])
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert second.num_cached_tokens == 8
    assert second.num_prefix_hit_tokens == 8
    assert [manager.ref_counts[b] for b in first.block_table[:2]] == [2, 2]
    assert manager.num_used_blocks == 4

    manager.deallocate(first)
    assert [manager.ref_counts[b] for b in second.block_table] == [1, 1, 1]
    assert manager.num_used_blocks == 3
    manager.deallocate(second)
    assert manager.num_used_blocks == 0
    assert second.block_table == [] and second.num_cached_tokens == 0


def test_hit_on_block_in_use_needs_no_free_block():
    manager = BlockManager(3, BLOCK_SIZE)
    admit_and_compute(manager, list(range(8)) + [9])
    assert manager.num_free_blocks == 0
    # Two prefix hits on blocks the first sequence holds, and a third block that cannot be had.
    assert not fits(manager, list(range(8)) + [70])[0]
    manager2 = BlockManager(4, BLOCK_SIZE)
    admit_and_compute(manager2, list(range(8)) + [9])
    assert fits(manager2, list(range(8)) + [70]) == (True, 2)


def test_hit_on_free_cached_block_consumes_it():
    manager = BlockManager(4, BLOCK_SIZE)
    manager.deallocate(admit_and_compute(manager, list(range(9))))
    admit(manager, [90])
    assert manager.num_free_blocks == 3
    # Two hits that sit in the free queue plus two new blocks: four, but only three are free.
    assert not fits(manager, list(range(8)) + [60, 61, 62, 63, 64])[0]
    assert fits(manager, list(range(8)) + [60]) == (True, 2)


def test_fresh_blocks_are_taken_in_id_order():
    manager = BlockManager(4, BLOCK_SIZE)
    assert admit(manager, list(range(5))).block_table == [0, 1]
    assert admit(manager, [7]).block_table == [2]


def test_free_queue_evicts_least_recently_freed_first():
    manager = BlockManager(4, BLOCK_SIZE)
    old = admit_and_compute(manager, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    new = admit_and_compute(manager, [5, 5, 5, 5])
    manager.deallocate(old)
    manager.deallocate(new)
    # old's unhashed last block at the head, then old's hashed blocks last-first, then new's block.
    assert manager.free_block_ids() == [2, 1, 0, 3]
    taker = admit(manager, [8, 8, 8, 8, 8, 8, 8, 8, 8])
    assert taker.block_table == [2, 1, 0]
    assert manager.cached_prefix(make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3])) == []
    assert manager.cached_prefix(make_seq([5, 5, 5, 5, 6])) == [3]


def test_prefix_later_blocks_are_evicted_before_earlier_ones():
    manager = BlockManager(4, BLOCK_SIZE)
    prompt = list(range(12)) + [99]
    seq = admit_and_compute(manager, prompt)
    block_ids = list(seq.block_table)
    manager.deallocate(seq)
    admit(manager, [50])  # takes the unhashed block
    admit(manager, [51])  # evicts the prefix's third block, not its first
    assert manager.cached_prefix(make_seq(prompt)) == block_ids[:2]


def test_unhashed_blocks_are_reused_before_cached_ones():
    manager = BlockManager(2, BLOCK_SIZE)
    cached = admit_and_compute(manager, [4, 4, 4, 4])
    partial = admit_and_compute(manager, [6])
    partial_block_ids = list(partial.block_table)
    manager.deallocate(cached)
    manager.deallocate(partial)
    assert admit(manager, [7]).block_table == partial_block_ids
    assert manager.cached_prefix(make_seq([4, 4, 4, 4, 5])) == [0]


def test_freed_block_is_revived_by_a_later_hit():
    manager = BlockManager(4, BLOCK_SIZE)
    first = admit_and_compute(manager, list(range(9)))
    cached_blocks = first.block_table[:2]
    manager.deallocate(first)
    assert manager.num_free_blocks == 4

    second = admit(manager, list(range(9)))
    assert second.block_table[:2] == cached_blocks
    assert second.num_cached_tokens == 8
    assert [manager.ref_counts[b] for b in cached_blocks] == [1, 1]
    assert not set(second.block_table) & set(manager.free_block_ids())
    assert manager.num_free_blocks == 1


def test_reused_block_loses_its_cache_entry():
    manager = BlockManager(2, BLOCK_SIZE)
    manager.deallocate(admit_and_compute(manager, [3, 3, 3, 3]))
    manager.deallocate(admit(manager, [7, 7, 7, 7, 7]))
    assert manager.hash_to_block_id == {}
    assert fits(manager, [3, 3, 3, 3, 3]) == (True, 0)


def test_a_duplicate_block_stays_unhashed_and_is_reused_before_its_cached_twin():
    manager = BlockManager(3, BLOCK_SIZE)
    first = admit(manager, [1, 1, 1, 1])
    second = admit(manager, [1, 1, 1, 1])  # no hit: first's block is not computed yet
    compute(manager, first)
    compute(manager, second)
    [cached_block_id], [duplicate_block_id] = first.block_table, second.block_table
    assert manager.block_hashes[duplicate_block_id] is None
    manager.deallocate(first)
    manager.deallocate(second)
    assert admit(manager, [5]).block_table == [duplicate_block_id]
    admit(manager, [6])  # the never-used block: the cached twin is still last in line
    assert manager.cached_prefix(make_seq([1, 1, 1, 1, 9])) == [cached_block_id]


def test_hash_collision_with_other_tokens_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_key", lambda key: 42)
    manager = BlockManager(8, BLOCK_SIZE)
    admit_and_compute(manager, [1, 2, 3, 4, 5])
    assert fits(manager, [1, 2, 3, 4, 6]) == (True, 1)
    colliding = admit(manager, [9, 9, 9, 9, 5])
    assert colliding.num_cached_tokens == 0
    assert manager.ref_counts[colliding.block_table[0]] == 1


def test_caching_disabled_never_hits_nor_hashes():
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    first = admit_and_compute(manager, list(range(9)))
    assert manager.hash_to_block_id == {}
    assert fits(manager, list(range(9))) == (True, 0)
    second = admit(manager, list(range(9)))
    assert not set(second.block_table) & set(first.block_table)
    assert second.num_cached_tokens == 0 and second.num_prefix_hit_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_block():
    manager = BlockManager(8, BLOCK_SIZE)
    first = admit_and_compute(manager, list(range(8)))
    second = admit(manager, list(range(8)))
    assert second.num_cached_tokens == 4
    assert second.block_table[0] == first.block_table[0]
    assert second.block_table[1] != first.block_table[1]
    assert manager.ref_counts[second.block_table[1]] == 1


def test_prompt_with_cached_full_blocks_computes_one_token_in_a_new_block():
    manager = BlockManager(8, BLOCK_SIZE)
    first = admit_and_compute(manager, list(range(8)) + [30])
    second = admit(manager, list(range(8)) + [31])
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table


def test_same_prompt_admitted_before_compute_does_not_hit():
    manager = BlockManager(8, BLOCK_SIZE)
    first = admit(manager, list(range(9)))
    second = admit(manager, list(range(9)))
    assert second.num_cached_tokens == 0
    assert not set(first.block_table) & set(second.block_table)
    compute(manager, first)
    compute(manager, second)
    assert admit(manager, list(range(9))).num_cached_tokens == 8


def test_chunks_and_generated_tokens_are_hashed_once_full():
    manager = BlockManager(8, BLOCK_SIZE)
    seq = admit(manager, [10, 11, 12, 13, 14, 15])
    compute(manager, seq, 5)
    assert len(manager.hash_to_block_id) == 1
    compute(manager, seq, 1)
    assert len(manager.hash_to_block_id) == 1
    seq.append_token(16)
    compute(manager, seq, 1)
    seq.append_token(17)
    assert len(manager.hash_to_block_id) == 1  # token 17 is sampled but its KV is not computed yet
    compute(manager, seq, 1)
    assert len(manager.hash_to_block_id) == 2
    assert admit(manager, list(range(10, 18)) + [40]).num_cached_tokens == 8


def test_append_needs_a_block_only_when_the_token_starts_one():
    manager = BlockManager(2, BLOCK_SIZE)
    seq = admit_and_compute(manager, [1, 2, 3, 4])
    seq.append_token(5)
    admit(manager, [9])
    assert manager.num_free_blocks == 0
    assert not manager.can_append(seq)

    manager2 = BlockManager(2, BLOCK_SIZE)
    seq2 = admit_and_compute(manager2, [1, 2, 3, 4, 5])
    seq2.append_token(6)
    assert manager2.num_free_blocks == 0
    assert manager2.can_append(seq2)
    manager2.may_append(seq2)
    assert len(seq2.block_table) == 2


def test_may_append_takes_a_block_at_a_block_start():
    manager = BlockManager(3, BLOCK_SIZE)
    seq = admit_and_compute(manager, [1, 2, 3, 4])
    seq.append_token(5)
    assert manager.can_append(seq)
    manager.may_append(seq)
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == 1


def test_can_allocate_is_false_without_enough_free_blocks():
    manager = BlockManager(2, BLOCK_SIZE)
    assert not fits(manager, list(range(9)))[0]
    assert fits(manager, list(range(8))) == (True, 0)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_bad_geometry_is_rejected(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_collision_guard_checks_the_parent_hash(monkeypatch):
    # A hash that ignores the parent: only the stored key (parent hash + tokens) can tell the blocks apart.
    monkeypatch.setattr(block_manager_module, "hash_block_key",
                        lambda key: xxhash.xxh64_intdigest(key[-4 * BLOCK_SIZE:]))
    manager = BlockManager(8, BLOCK_SIZE)
    admit_and_compute(manager, [1, 1, 1, 1, 5, 6, 7, 8, 0])
    admit_and_compute(manager, [9, 9, 9, 9, 0])
    assert fits(manager, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == (True, 1)
    assert fits(manager, [1, 1, 1, 1, 5, 6, 7, 8, 0]) == (True, 2)


@pytest.mark.parametrize("seed", range(5))
def test_free_queue_matches_an_ordered_dict_model(seed):
    """Random takes, frees (hashed to the tail, unhashed to the head) and revivals, against OrderedDict."""
    rng = random.Random(seed)
    num_blocks = 12
    queue, model = _FreeQueue(num_blocks), OrderedDict.fromkeys(range(num_blocks))
    held: list[int] = []
    hashed_free: set[int] = set()
    for _ in range(400):
        action = rng.randrange(3)
        if action == 0 and model:
            block_id = queue.pop_head()
            assert block_id == model.popitem(last=False)[0]
            hashed_free.discard(block_id)
            held.append(block_id)
        elif action == 1 and held:
            block_id = held.pop(rng.randrange(len(held)))
            model[block_id] = None
            if rng.random() < 0.5:
                queue.push_tail(block_id)
                hashed_free.add(block_id)
            else:
                queue.push_head_unhashed(block_id)
                model.move_to_end(block_id, last=False)
        elif action == 2 and hashed_free:
            block_id = rng.choice(sorted(hashed_free))
            queue.remove(block_id)
            del model[block_id]
            hashed_free.discard(block_id)
            held.append(block_id)
        assert queue.ordered() == list(model) and len(queue) == len(model)


def test_a_large_manager_is_flat():
    manager = BlockManager(1_000_000, BLOCK_SIZE)
    assert manager.num_free_blocks == 1_000_000 and manager.free_block_ids()[:3] == [0, 1, 2]
    assert admit(manager, list(range(9))).block_table == [0, 1, 2]
    assert manager.num_used_blocks == 3


def test_each_block_of_a_sequence_is_hashed_once(monkeypatch):
    manager = BlockManager(8, BLOCK_SIZE)
    admit_and_compute(manager, list(range(9)))
    calls = []
    original = block_manager_module.hash_block_key
    monkeypatch.setattr(block_manager_module, "hash_block_key", lambda key: calls.append(key) or original(key))
    seq = admit(manager, list(range(8)) + [50, 51, 52, 53, 54])
    assert seq.num_cached_tokens == 8
    assert len(calls) == 3  # probe: two hits and one miss; allocate hashes nothing
    manager.cached_prefix(seq)  # probed again (a waiting head that could not be admitted)
    compute(manager, seq)  # registers the third block under the hash the probe computed
    assert len(calls) == 3
    assert fits(manager, list(range(8)) + [50, 51, 52, 53, 99]) == (True, 3)
