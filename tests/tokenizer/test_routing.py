"""The routing policies (services/tokenizer/routing.py): exact boundaries of the load slack, longest prefix,
ties, the prefix index's events and pending entries. Pure logic: no gRPC, a fake clock."""

import pytest

from services.common.block_hash import prompt_block_hashes
from services.tokenizer.routing import (
    LOAD_SLACK_FRACTION,
    LOAD_SLACK_REQUESTS,
    PENDING_TTL_S,
    PrefixIndex,
    Replica,
    Router,
    Routing,
    load_slack,
)

BLOCK = 4
PROMPT = list(range(100, 116))  # 4 full blocks
HASHES = prompt_block_hashes(PROMPT, BLOCK)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replicas(*loads: int, clock=None) -> list[Replica]:
    made = [Replica(f"10.0.0.{i}:1", ready=True, num_in_flight=load) for i, load in enumerate(loads)]
    if clock is not None:
        for replica in made:
            replica.index = PrefixIndex(clock)
    return made


def holding(replica: Replica, num_blocks: int) -> Replica:
    replica.index.apply(True, HASHES[:num_blocks], [])
    return replica


def test_the_slack_constants_are_the_documented_ones():
    assert (LOAD_SLACK_REQUESTS, LOAD_SLACK_FRACTION) == (16, 0.5)
    assert load_slack(0) == 16 and load_slack(10) == 21


@pytest.mark.parametrize("min_load, holder_load, goes_to_holder", [
    (0, 16, True), (0, 17, False),      # slack 16 at no load: == is still within (<=), one more is not
    (10, 31, True), (10, 32, False),    # slack 16 + 0.5 * 10 = 21
    (3, 20, True), (3, 21, False),      # slack 16 + 1.5: 20.5 allows 20, not 21
])
def test_a_prefix_holder_wins_only_within_the_load_slack(min_load, holder_load, goes_to_holder):
    idle, holder = replicas(min_load, holder_load)
    holding(holder, 4)
    chosen = Router(Routing.PREFIX, BLOCK).choose([idle, holder], PROMPT)
    assert chosen is (holder if goes_to_holder else idle)


def test_the_longest_cached_prefix_wins():
    short, longest, middle = (holding(r, n) for r, n in zip(replicas(0, 2, 1), (1, 3, 2)))
    assert Router(Routing.PREFIX, BLOCK).choose([short, longest, middle], PROMPT) is longest


def test_an_overloaded_longest_holder_leaves_the_next_longest_within_slack():
    idle, overloaded, shorter = replicas(0, 17, 3)
    holding(overloaded, 4)
    holding(shorter, 2)
    assert Router(Routing.PREFIX, BLOCK).choose([idle, overloaded, shorter], PROMPT) is shorter


def test_equal_prefixes_go_to_the_least_loaded():
    a, b = replicas(3, 1)
    holding(a, 2)
    holding(b, 2)
    assert Router(Routing.PREFIX, BLOCK).choose([a, b], PROMPT) is b


def test_no_hit_goes_to_the_least_loaded_and_equal_loads_rotate():
    busy, idle1, idle2 = replicas(2, 0, 0)
    router = Router(Routing.PREFIX, BLOCK)
    # NOTE: each choice expects its blocks on the chosen replica; use distinct prompts so none hits.
    first = router.choose([busy, idle1, idle2], [1, 2, 3, 4, 5])
    second = router.choose([busy, idle1, idle2], [9, 9, 9, 9, 9])
    assert {first, second} == {idle1, idle2}


def test_a_prompt_shorter_than_a_block_goes_by_load():
    a, b = replicas(1, 0)
    holding(a, 4)
    assert Router(Routing.PREFIX, BLOCK).choose([a, b], PROMPT[:BLOCK - 1]) is b


def test_a_routed_prompt_is_expected_on_its_replica_until_the_ttl():
    clock = Clock()
    a, b = replicas(0, 0, clock=clock)
    router = Router(Routing.PREFIX, BLOCK)
    first = router.choose([a, b], PROMPT)
    first.num_in_flight = 1  # the other is now less loaded, yet within the slack
    assert router.choose([a, b], PROMPT) is first
    clock.now += PENDING_TTL_S  # expired: no longer a hit, so least load
    assert router.choose([a, b], PROMPT) is not first


def test_round_robin_cycles_whatever_the_load_or_cache():
    a, b, c = replicas(9, 0, 0)
    holding(b, 4)
    router = Router(Routing.ROUND_ROBIN, BLOCK)
    assert [router.choose([a, b, c], PROMPT) for _ in range(6)] == [b, c, a, b, c, a]


def test_least_load_ignores_the_cache():
    a, b = replicas(1, 0)
    holding(a, 4)
    assert Router(Routing.LEAST_LOAD, BLOCK).choose([a, b], PROMPT) is b


def test_load_is_the_larger_of_own_streams_and_the_engines_report():
    replica = Replica("x", num_in_flight=3, num_reported=5)
    assert replica.load == 5
    replica.num_reported = 1
    assert replica.load == 3


def test_a_single_candidate_is_chosen_without_hashing():
    only = Replica("x", ready=True)
    assert Router(Routing.PREFIX, BLOCK).choose([only], PROMPT) is only
    assert only.index.match(HASHES) == 0  # nothing expected: the one-replica path does no index work


def test_index_snapshot_replaces_and_events_add_and_remove():
    index = PrefixIndex()
    index.apply(False, [11, 12], [])
    index.apply(True, HASHES[:2], [])  # a snapshot voids 11 and 12
    assert index.stored == set(HASHES[:2])
    index.apply(False, HASHES[2:], [HASHES[1]])
    assert index.match(HASHES) == 1  # the chain breaks at the removed second block
    index.apply(False, [HASHES[1]], [])
    assert index.match(HASHES) == 4


def test_an_eviction_ends_a_pending_expectation():
    clock = Clock()
    index = PrefixIndex(clock)
    index.expect(HASHES)
    assert index.match(HASHES) == 4
    index.apply(False, [], [HASHES[2]])
    assert index.match(HASHES) == 2
    index.clear()
    assert index.match(HASHES) == 0
