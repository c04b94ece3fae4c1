"""Which engine replica serves a request: round-robin, least-load, or prefix-cache aware. Pure logic, no gRPC.

The prefix rule (`--routing prefix`, the default), for the replicas that are ready:

1. A replica's load is max(this process's streams open on it, running + waiting in its latest LoadReport).
   The first is exact and fresh for this process; the second also counts other tokenizer processes' streams.
2. Eligible replicas: those with load <= min_load + LOAD_SLACK_REQUESTS + LOAD_SLACK_FRACTION * min_load,
   min_load being the least load of all. The least loaded replica is always eligible.
3. Among the eligible, the one whose prefix cache holds the longest run of the prompt's leading full blocks
   wins; equal runs (no hit anywhere included) go to the least loaded, and equal loads to a rotating cursor.
4. The chosen replica's index expects the prompt's blocks at once (PENDING_TTL_S, until its KV events confirm
   or evict them), so a burst of requests sharing a new prefix follows the first one instead of scattering
   before the engine has even computed it.

A replica's index is fed by its engine's SubscribeKvEvents stream: a snapshot, then stored/removed block
hashes, chained as services.common.block_hash.prompt_block_hashes chains a prompt's blocks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.block_hash import prompt_block_hashes

# A replica within this many requests of the least loaded one may take a request for its cached prefix...
# NOTE: generous on purpose: a continuous-batching engine decodes its streams in one batch, so a few more of
# them cost each far less than recomputing a long prefix elsewhere (which also evicts that replica's own
# prefixes). In bench/routing.py a slack of 4 sent ~10% of requests away from their prefix; 16 kept them.
LOAD_SLACK_REQUESTS = 16
# ...plus this fraction of the least load, so the allowance grows with the load (at 32 streams: 16 + 16).
LOAD_SLACK_FRACTION = 0.5
# How long blocks a request was just routed with count as cached there without the engine's word for it.
PENDING_TTL_S = 10.0
_PRUNE_PENDING_AT = 8192


class Routing(enum.StrEnum):
    """The --routing policies."""

    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    PREFIX = "prefix"


class PrefixIndex:
    """The block hashes one replica holds in its prefix cache, as its KV events say, plus recently routed ones."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.stored: set[int] = set()
        self._pending: dict[int, float] = {}  # block hash -> until when it counts
        self._clock = clock

    def apply(self, snapshot: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """One KV event: a snapshot replaces what was stored; later events add and remove hashes."""
        if snapshot:
            self.stored = set(stored)
        else:
            self.stored.update(stored)
        for block_hash in removed:
            self.stored.discard(block_hash)
            self._pending.pop(block_hash, None)

    def expect(self, hashes: Sequence[int]) -> None:
        """Count `hashes` as cached for PENDING_TTL_S: a request carrying them was just sent to this replica."""
        now = self._clock()
        if len(self._pending) >= _PRUNE_PENDING_AT:
            self._pending = {h: until for h, until in self._pending.items() if until > now}
        until = now + PENDING_TTL_S
        for block_hash in hashes:
            if block_hash not in self.stored:
                self._pending[block_hash] = until

    def clear(self) -> None:
        """Forget everything (the replica went away: its cache did too, or will be resent as a snapshot)."""
        self.stored = set()
        self._pending = {}

    def match(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` this replica holds (stored, or pending and not expired)."""
        now = None
        for count, block_hash in enumerate(hashes):
            if block_hash in self.stored:
                continue
            until = self._pending.get(block_hash)
            if until is None:
                return count
            if now is None:
                now = self._clock()
            if until <= now:
                return count
        return len(hashes)


@dataclass(slots=True, eq=False)
class Replica:
    """One engine replica as the router sees it (the pool owns the connection that feeds these fields)."""

    address: str
    ready: bool = False
    num_in_flight: int = 0  # this process's streams open on it
    num_reported: int = 0  # running + waiting in its latest LoadReport
    index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> int:
        return max(self.num_in_flight, self.num_reported)


def load_slack(min_load: int) -> float:
    """How far above the least load a replica may be and still take a request for its cached prefix."""
    return LOAD_SLACK_REQUESTS + LOAD_SLACK_FRACTION * min_load


class Router:
    """Picks a replica per request under one Routing policy; keeps the rotating cursor for ties."""

    def __init__(self, policy: Routing, block_size: int = 0):
        self.policy = policy
        self.block_size = block_size  # tokens per KV block of the replicas (from GetEngineInfo); 0 = unknown
        self._cursor = 0

    def choose(self, candidates: Sequence[Replica], prompt_ids: Sequence[int]) -> Replica:
        """The replica for a prompt, among `candidates` (ready ones, in a stable order; at least one)."""
        if len(candidates) == 1:
            return candidates[0]
        self._cursor += 1
        if self.policy is Routing.ROUND_ROBIN:
            return candidates[self._cursor % len(candidates)]
        if self.policy is Routing.LEAST_LOAD or self.block_size <= 0:
            return self._least_loaded(candidates)
        hashes = prompt_block_hashes(prompt_ids, self.block_size)
        chosen = self._longest_prefix(candidates, hashes) if hashes else self._least_loaded(candidates)
        chosen.index.expect(hashes)
        return chosen

    def _rotated(self, candidates: Sequence[Replica]) -> list[Replica]:
        start = self._cursor % len(candidates)
        return [*candidates[start:], *candidates[:start]]

    def _least_loaded(self, candidates: Sequence[Replica]) -> Replica:
        return min(self._rotated(candidates), key=lambda replica: replica.load)

    def _longest_prefix(self, candidates: Sequence[Replica], hashes: Sequence[int]) -> Replica:
        min_load = min(replica.load for replica in candidates)
        limit = min_load + load_slack(min_load)
        eligible = [replica for replica in self._rotated(candidates) if replica.load <= limit]
        # max() keeps the first of equals: the longest match, then the least load, then the rotation's order.
        return max(eligible, key=lambda replica: (replica.index.match(hashes), -replica.load))
