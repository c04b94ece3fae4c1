"""Block manager cache events: a subscriber replaying them always holds exactly the cached hashes."""

import random

import pytest

from services.common.block_hash import prompt_block_hashes
from services.engine.core.block_manager import BlockManager
from tests.unit.test_block_manager import admit, admit_and_compute, compute, make_seq

BLOCK_SIZE = 4


class Subscriber:
    """What a router does with the events: a snapshot, then every drained batch applied to a set."""

    def __init__(self, manager: BlockManager):
        manager.record_events(True)
        self.hashes = set(manager.cached_block_hashes())

    def apply(self, manager: BlockManager) -> None:
        events = manager.take_events()
        assert not set(events.stored_block_hashes) & set(events.removed_block_hashes)
        self.hashes -= set(events.removed_block_hashes)
        self.hashes |= set(events.stored_block_hashes)


def test_nothing_is_recorded_until_asked():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit_and_compute(manager, list(range(9)))
    assert manager.take_events() is None and manager._events is None
    assert sorted(manager.cached_block_hashes()) == sorted(prompt_block_hashes(list(range(9)), BLOCK_SIZE))


def test_computed_full_blocks_are_stored_and_evicted_ones_removed():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    manager.record_events(True)
    prompt = list(range(10))
    manager.deallocate(admit_and_compute(manager, prompt))
    events = manager.take_events()
    assert list(events.stored_block_hashes) == prompt_block_hashes(prompt, BLOCK_SIZE)
    assert not events.removed_block_hashes
    assert not manager.take_events(), "a drain empties the record"
    admit(manager, list(range(100, 112)))  # takes all three blocks: both cached ones are evicted
    events = manager.take_events()
    assert sorted(events.removed_block_hashes) == sorted(prompt_block_hashes(prompt, BLOCK_SIZE))
    assert not events.stored_block_hashes


def test_a_hash_stored_and_evicted_within_one_drain_is_reported_removed_only():
    manager = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    manager.record_events(True)
    manager.deallocate(admit_and_compute(manager, list(range(5))))
    admit(manager, list(range(100, 108)))
    events = manager.take_events()
    assert list(events.removed_block_hashes) == prompt_block_hashes(list(range(5)), BLOCK_SIZE)
    assert not events.stored_block_hashes


def test_a_recomputed_duplicate_is_no_event_and_reusing_it_removes_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    manager.record_events(True)
    prompt = list(range(5))
    [block_hash] = prompt_block_hashes(prompt, BLOCK_SIZE)
    first, second = admit(manager, prompt), admit(manager, prompt)  # neither hits: nothing computed yet
    compute(manager, first)
    compute(manager, second)  # the same hash again, in another block: that block stays unhashed
    assert list(manager.take_events().stored_block_hashes) == [block_hash]
    manager.deallocate(first)
    manager.deallocate(second)
    admit(manager, list(range(100, 112)))  # three blocks: the three unhashed ones, the duplicate among them
    assert not manager.take_events() and block_hash in manager.hash_to_block_id
    admit(manager, list(range(200, 204)))  # the cached block goes now
    assert list(manager.take_events().removed_block_hashes) == [block_hash]
    assert not manager.hash_to_block_id


def test_stopping_drops_the_record():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    manager.record_events(True)
    admit_and_compute(manager, list(range(9)))
    manager.record_events(False)
    manager.record_events(True)
    assert not manager.take_events()


@pytest.mark.parametrize("seed", range(12))
def test_replayed_events_always_equal_the_cached_hashes(seed):
    """Random admit / chunked compute / decode / free / preempt on a small cache with few distinct prompts, so
    hits, evictions, revivals and recomputed duplicates all happen; subscribers join at random moments."""
    rng = random.Random(seed)
    manager = BlockManager(num_blocks=rng.choice([6, 10, 16]), block_size=BLOCK_SIZE)
    prefixes = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live: list = []
    subscriber = None
    num_checks = num_twins = 0
    for _ in range(600):
        action = rng.random()
        if action < 0.3:
            if live and rng.random() < 0.3:  # a twin of a sequence not yet computed: both will compute its blocks
                tokens = list(rng.choice(live).token_ids)
            else:
                tokens = rng.choice(prefixes) + [rng.randrange(1, 4) for _ in range(rng.randrange(0, 6))]
            seq = make_seq(tokens)
            cached_block_ids = manager.cached_prefix(seq)
            if manager.can_allocate(seq, cached_block_ids):
                manager.allocate(seq, cached_block_ids)
                live.append(seq)
        elif action < 0.6 and live:
            seq = rng.choice(live)
            remaining = seq.num_tokens - seq.num_cached_tokens
            if remaining:
                compute(manager, seq, rng.randrange(1, remaining + 1))
            else:  # decode: one more token, in a new block when it starts one
                seq.token_ids.append(rng.randrange(1, 4))
                if manager.can_append(seq):
                    manager.may_append(seq)
                    compute(manager, seq)
                else:
                    seq.token_ids.pop()
        elif action < 0.8 and live:  # a finish, an abort or a preemption: the blocks go back, hashes kept
            manager.deallocate(live.pop(rng.randrange(len(live))))
        elif action < 0.9:
            if subscriber is None:
                subscriber = Subscriber(manager)
            else:
                subscriber.apply(manager)
                assert subscriber.hashes == set(manager.hash_to_block_id)
                num_checks += 1
        elif action < 0.93 and subscriber is not None:
            manager.record_events(False)
            subscriber = None
        assert all(block_hash is None or manager.hash_to_block_id[block_hash] == block_id
                   for block_id, block_hash in enumerate(manager.block_hashes)), "a hashed block without its entry"
        num_twins += any(seq.block_hashes[index] in manager.hash_to_block_id
                         and manager.hash_to_block_id[seq.block_hashes[index]] != block_id
                         for seq in live
                         for index, block_id in enumerate(seq.block_table[:seq.num_cached_tokens // BLOCK_SIZE]))
    assert num_checks > 20
    assert num_twins > 0, "the run never had a recomputed duplicate: make it cover one"
