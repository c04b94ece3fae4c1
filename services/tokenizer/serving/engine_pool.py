"""Every engine replica behind `--engine`: targets resolved (and re-resolved) to addresses, one EngineClient per
address, each watched on its own, and a Router choosing among the ready ones per request.

A target is an address used as it is (an IP literal, or a gRPC target with a scheme such as unix:) or a DNS
name that resolves to every replica: a Kubernetes headless Service, a compose service scaled with
`--scale engine=N`. Names are resolved again every `resolve_interval_s`; an address that appears gets a client
and a watch, one that disappears stops taking requests and its channel closes once its streams end (a pod
leaves DNS when it starts draining: its streams still finish). A failed lookup keeps the addresses it had.
The service is ready while at least one replica is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from services.common.errors import UnavailableError
from services.tokenizer.serving.engine_client import EngineClient, KvEventsEnded, watch_engine
from services.tokenizer.serving.metrics import record_routing
from services.tokenizer.routing import Replica, Router, Routing
from services.tokenizer.routing_targets import EngineTarget, Resolver, resolve_with_getaddrinfo

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0
KV_RESUBSCRIBE_S = 1.0  # after a KV event stream ends while the replica still looks ready
KV_LAGGED_RESUBSCRIBE_S = 0.05  # after the engine dropped us for reading too slowly
KV_UNIMPLEMENTED_RETRY_S = 30.0  # an engine build without SubscribeKvEvents: ask again this rarely
# The longest a call waits for the start-up checks (each bounded by EngineClient.check's 2 s timeout) when it
# arrives before they are done: past it, the call fails as it would without the wait.
FIRST_CHECKS_WAIT_S = 5.0


@dataclass(slots=True, eq=False)
class Member:
    """A replica in the pool: what the router sees, the client that talks to it, and its background tasks."""

    replica: Replica
    client: EngineClient
    tasks: list[asyncio.Task] = field(default_factory=list)
    retired: bool = False  # gone from DNS: takes no new requests, closes once its streams end
    checked: bool = False  # its watch has had a first answer (or failure) from the engine

    @property
    def address(self) -> str:
        return self.replica.address


class SingleEngine:
    """The pool's interface over one EngineClient whose owner watches it (the wiring from before the pool, which
    tools and tests still use): ready while the client is, no routing."""

    def __init__(self, client: EngineClient):
        self.member = Member(Replica(client.target), client)

    def require_info(self):
        return self.member.client.require_info()

    async def settled_info(self):
        return self.require_info()  # the owner checked the client before serving

    def pick(self, prompt_ids: Sequence[int], exclude: Sequence[Member] = ()) -> Member | None:
        if exclude or not self.member.client.ready.is_set():
            return None
        self.member.replica.num_in_flight += 1
        return self.member

    def release(self, member: Member) -> None:
        member.replica.num_in_flight -= 1


class EnginePool:
    """The replicas behind --engine, kept current, and the choice of one per request.

    connect(address, fingerprint) makes a replica's client (EngineClient; tests pass their own), resolve(host,
    port) a name's addresses. on_ready(ready) is awaited whenever "at least one replica is ready" flips.
    """

    def __init__(self, targets: Sequence[EngineTarget], fingerprint: str, routing: Routing = Routing.PREFIX,
                 on_ready: Callable[[bool], Awaitable[None]] | None = None,
                 connect: Callable[[str, str], EngineClient] = EngineClient,
                 resolve: Resolver = resolve_with_getaddrinfo, resolve_interval_s: float = RESOLVE_INTERVAL_S,
                 watch_interval_s: float = 1.0):
        self.targets = list(targets)
        self.fingerprint = fingerprint
        self.router = Router(routing)
        self.members: dict[str, Member] = {}
        self._on_ready = on_ready
        self._connect, self._resolve = connect, resolve
        self._resolve_interval_s, self._watch_interval_s = resolve_interval_s, watch_interval_s
        self._addresses: dict[EngineTarget, list[str]] = {t: [] if t.resolvable else [t.address] for t in targets}
        # NOTE: one fixed address needs no index and no load: the router never compares replicas (the hot path).
        can_be_several = len(self.targets) > 1 or self.targets[0].resolvable
        self._follow_kv = routing is Routing.PREFIX and can_be_several
        self._poll_load = routing is not Routing.ROUND_ROBIN and can_be_several
        self._ready: list[Member] = []  # the ready members, in address order: the router's candidates
        self._is_ready = False
        self._settled = asyncio.Event()  # a replica is ready, or every one known has had its first check
        self._resolver: asyncio.Task | None = None

    async def start(self) -> None:
        """Resolve once, connect to every address, and keep resolving names in the background."""
        await self._refresh()
        if any(target.resolvable for target in self.targets):
            self._resolver = asyncio.create_task(self._keep_resolving())

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for member in list(self.members.values()):
            await self._drop(member)

    def require_info(self):
        """GetEngineInfo of a ready replica (the replicas serve one model); UnavailableError when none is."""
        for member in self._ready:
            if member.client.info is not None:
                return member.client.info
        raise UnavailableError(f"no engine replica is available ({self._describe()})")

    async def settled_info(self):
        """require_info, once the start-up checks have settled: the port opens before the first GetEngineInfo
        has come back (and with --workers the kernel hands a starting worker connections at once), so a call in
        those few milliseconds waits for them instead of failing UNAVAILABLE while the engine is up. Only at
        start-up: once settled, a replica that goes away fails calls at once, so clients can retry elsewhere."""
        if not self._settled.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), FIRST_CHECKS_WAIT_S)
        return self.require_info()

    def pick(self, prompt_ids: Sequence[int], exclude: Sequence[Member] = ()) -> Member | None:
        """The replica for a prompt (counted as one more stream on it until release()); None when every ready
        one is in `exclude` or none is ready."""
        candidates = self._ready if not exclude else [m for m in self._ready if m not in exclude]
        if not candidates:
            return None
        if len(candidates) == 1:
            member = candidates[0]
        else:
            replicas = [member.replica for member in candidates]
            member = candidates[replicas.index(self.router.choose(replicas, prompt_ids))]
        member.replica.num_in_flight += 1
        record_routing(self.router.policy.value, member.address)
        return member

    def release(self, member: Member) -> None:
        member.replica.num_in_flight -= 1
        if member.retired and member.replica.num_in_flight == 0:
            asyncio.get_running_loop().create_task(member.client.close())

    def _describe(self) -> str:
        if not self.members:
            return "no address resolved for " + ", ".join(t.address for t in self.targets)
        return ", ".join(f"{m.address} {'ready' if m.replica.ready else 'not ready'}" for m in self.members.values())

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self._resolve_interval_s)
            await self._refresh()

    async def _refresh(self) -> None:
        for target in self.targets:
            if target.resolvable:
                try:
                    self._addresses[target] = await self._resolve(target.address, target.port)
                except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
                    logger.warning("resolving engine %s failed (%s); keeping %s", target.address, exc,
                                   self._addresses[target] or "no address")
        wanted = {address for addresses in self._addresses.values() for address in addresses}
        for address in sorted(wanted - self.members.keys()):
            self._add(address)
        for address in sorted(self.members.keys() - wanted):
            await self._retire(self.members[address])
        await self._update_ready()

    def _add(self, address: str) -> None:
        member = Member(Replica(address), self._connect(address, self.fingerprint))
        self.members[address] = member
        logger.info("engine replica %s added", address)
        member.tasks.append(asyncio.create_task(watch_engine(
            member.client, lambda ready: self._set_ready(member, ready), self._watch_interval_s)))
        if self._follow_kv:
            member.tasks.append(asyncio.create_task(self._follow_kv_events(member)))
        if self._poll_load:
            member.tasks.append(asyncio.create_task(self._poll_load_of(member)))

    async def _retire(self, member: Member) -> None:
        logger.info("engine replica %s left DNS: no new requests, %d in flight", member.address,
                    member.replica.num_in_flight)
        del self.members[member.address]
        member.retired, member.replica.ready = True, False
        self._ready = [ready for ready in self._ready if ready is not member]
        for task in member.tasks:
            task.cancel()
        if member.replica.num_in_flight == 0:
            await member.client.close()

    async def _drop(self, member: Member) -> None:
        for task in member.tasks:
            task.cancel()
        self.members.pop(member.address, None)
        await member.client.close()

    async def _set_ready(self, member: Member, ready: bool) -> None:
        if member.retired:
            return
        member.checked = True
        member.replica.ready = ready
        if not ready:
            member.replica.num_reported = 0  # (its index goes when its KV event stream ends)
        elif self.router.block_size == 0 and member.client.info is not None:
            self.router.block_size = member.client.info.block_size
        await self._update_ready()

    async def _update_ready(self) -> None:
        self._ready = [member for _, member in sorted(self.members.items()) if member.replica.ready]
        is_ready = bool(self._ready)
        if is_ready or all(member.checked for member in self.members.values()):
            self._settled.set()
        if is_ready != self._is_ready:
            self._is_ready = is_ready
            if self._on_ready is not None:
                await self._on_ready(is_ready)

    async def _poll_load_of(self, member: Member) -> None:
        """GetLoad once per watch interval (KV events carry a load too, but none comes while nothing changes)."""
        while True:
            await member.client.ready.wait()
            member.replica.num_reported = await member.client.num_queued() or 0
            await asyncio.sleep(self._watch_interval_s)

    async def _follow_kv_events(self, member: Member) -> None:
        """Keep the replica's prefix index in step with its SubscribeKvEvents stream, resubscribing after a
        reconnect (the first message is a snapshot, so nothing missed in between stays wrong)."""
        replica = member.replica

        def on_event(snapshot: bool, stored, removed, queued: int | None) -> None:
            replica.index.apply(snapshot, stored, removed)
            if queued is not None:
                replica.num_reported = queued
            if snapshot:
                logger.info("engine %s: KV events followed, snapshot of %d cached blocks", member.address,
                            len(stored))

        while True:
            await member.client.ready.wait()
            try:
                await member.client.follow_kv_events(on_event)
            except KvEventsEnded as ended:
                logger.info("engine %s: %s", member.address, ended)
                if ended.lagged:  # the next snapshot replaces the index: keep routing by this one meanwhile
                    await asyncio.sleep(KV_LAGGED_RESUBSCRIBE_S)
                    continue
                replica.index.clear()
                if ended.unimplemented:
                    logger.warning("engine %s has no SubscribeKvEvents: routing to it by load only", member.address)
                await asyncio.sleep(KV_UNIMPLEMENTED_RETRY_S if ended.unimplemented else KV_RESUBSCRIBE_S)
