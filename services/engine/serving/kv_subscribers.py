"""A front's SubscribeKvEvents subscribers: the core's snapshot, then its per-step cache changes, coalesced.

Each subscriber gets a snapshot first (the core's answer to its KvEventsSubscribe), then every change the
core reports after it, on the same connection, so nothing is missed or counted twice: changes that arrive
before a subscriber's snapshot are already in it and are skipped. A reader takes everything pending at
once: while it is slow, changes merge into one dict (a hash's last change wins), so it gets fewer, larger
messages instead of falling further behind.

A subscriber whose pending changes outgrow a snapshot (`max_pending`, at least the cache's block count) is
ended with RESOURCE_EXHAUSTED (SubscriberLagError, retry at once): subscribing again costs one snapshot,
which is less than what it would have to catch up on, and its memory here stays bounded whatever its
client does. A mid-stream snapshot would save the reconnect, but engine.proto promises `snapshot` on a
subscription's first message only. No torch or grpc here.
"""

import asyncio
from array import array
from dataclasses import dataclass

from services.common.errors import QueueFullError
from services.engine.core.block_manager import KvCacheEvents
from services.engine.serving.messages import KvEventsSnapshot, StepOutputs


class SubscriberLagError(QueueFullError):
    """A KV-event subscriber fell too far behind; subscribing again gets a fresh snapshot."""


@dataclass(slots=True)
class KvEventBatch:
    """What a subscriber reads next: its snapshot (once, first), then the cache's changes since its last read.

    NOTE: `stored_block_hashes` and `removed_block_hashes` are disjoint (each hash's last change only).
    """

    snapshot: bool
    stored_block_hashes: list[int]
    removed_block_hashes: list[int]


class _Subscriber:
    __slots__ = ("snapshot", "synced", "changes", "load_changed", "error", "waiter")

    def __init__(self):
        self.snapshot: array | None = None  # the core's snapshot, until the reader takes it
        self.synced = False  # the snapshot has arrived: later changes are this subscriber's
        self.changes: dict[int, int] = {}  # hash -> 1 if cached after its last change, else 0; not yet read
        self.load_changed = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None

    def has_output(self) -> bool:
        return self.error is not None or self.snapshot is not None or bool(self.changes) or (
            self.synced and self.load_changed)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> KvEventBatch:
        changes, self.changes = self.changes, {}
        self.load_changed = False
        if self.snapshot is not None:
            hashes = set(self.snapshot)
            for block_hash, cached in changes.items():
                (hashes.add if cached else hashes.discard)(block_hash)
            self.snapshot = None
            return KvEventBatch(True, list(hashes), [])
        return KvEventBatch(False, [block_hash for block_hash, cached in changes.items() if cached],
                            [block_hash for block_hash, cached in changes.items() if not cached])


class KvSubscribers:
    """The subscribers of one front, fed on the event loop from the core's messages (AsyncEngine's reader)."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self._subscribers: dict[int, _Subscriber] = {}
        self._load_key: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return bool(self._subscribers)

    def add(self, subscriber_id: int) -> _Subscriber:
        subscriber = self._subscribers[subscriber_id] = _Subscriber()
        return subscriber

    def remove(self, subscriber_id: int) -> None:
        self._subscribers.pop(subscriber_id, None)

    async def next_batch(self, subscriber: _Subscriber, loop: asyncio.AbstractEventLoop) -> KvEventBatch:
        """Wait until the subscriber has something to read, then take all of it (raises its error, if any)."""
        if not subscriber.has_output():
            subscriber.waiter = loop.create_future()
            await subscriber.waiter
        if subscriber.error is not None:
            raise subscriber.error
        return subscriber.take()

    def on_snapshot(self, message: KvEventsSnapshot) -> None:
        subscriber = self._subscribers.get(message.subscriber_id)
        if subscriber is not None and subscriber.error is None:
            subscriber.snapshot, subscriber.synced, subscriber.changes = message.block_hashes, True, {}
            subscriber.wake()

    def on_step(self, message: StepOutputs) -> None:
        """Merge a step's cache changes into every synced subscriber; a change of load alone is news too."""
        load_key = (message.stats.num_running, message.stats.num_waiting)
        load_changed, self._load_key = load_key != self._load_key, load_key
        if message.kv_events is None and not load_changed:
            return
        events = KvCacheEvents(*message.kv_events).changes() if message.kv_events is not None else None
        for subscriber in self._subscribers.values():
            if not subscriber.synced or subscriber.error is not None:
                continue
            if events is not None:
                changes = subscriber.changes
                changes.update(events)
                if len(changes) > self.max_pending:
                    self._fail(subscriber, SubscriberLagError(
                        f"KV event subscriber fell {len(changes)} changes behind; subscribe again", retry_after_s=0.0))
                    continue
            subscriber.load_changed = subscriber.load_changed or load_changed
            subscriber.wake()

    def fail_all(self, error: BaseException) -> None:
        """End every subscription with `error` (the core is gone, or the service drains)."""
        for subscriber in self._subscribers.values():
            self._fail(subscriber, error)

    @staticmethod
    def _fail(subscriber: _Subscriber, error: BaseException) -> None:
        subscriber.error = error
        subscriber.snapshot, subscriber.changes = None, {}
        subscriber.wake()
