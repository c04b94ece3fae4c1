"""How long a refused client should wait: the time the engine takes to admit its current queue.

A request refused because the waiting queue is full (QueueFullError -> RESOURCE_EXHAUSTED with RetryInfo)
is told to come back when the queue should have drained: `num_queued` sequences at the recent rate at which
the scheduler admits sequences (starts their prefill). The rate is measured over the last `window`
admissions and the time since the oldest of them, so a stalled engine (no admissions lately) asks for
longer waits. With no admission yet, DEFAULT_DELAY_S. Clamped to [MIN_DELAY_S, MAX_DELAY_S].
"""

from collections import deque


class AdmissionRate:
    """Admission times of the last `window` sequences, and the retry delay they imply."""

    DEFAULT_DELAY_S = 1.0
    MIN_DELAY_S = 0.05
    MAX_DELAY_S = 30.0

    def __init__(self, window: int = 32):
        self._times: deque[float] = deque(maxlen=window)

    def record(self, num_admitted: int, now: float) -> None:
        """`num_admitted` sequences were admitted at `now` (monotonic seconds)."""
        for _ in range(min(num_admitted, self._times.maxlen)):
            self._times.append(now)

    def retry_delay_s(self, num_queued: int, now: float) -> float:
        """Seconds until `num_queued` more sequences should have been admitted at the recent rate."""
        if not self._times:
            return self.DEFAULT_DELAY_S
        elapsed = now - self._times[0]
        if elapsed <= 0:
            return self.MIN_DELAY_S
        delay = num_queued * elapsed / len(self._times)
        return min(self.MAX_DELAY_S, max(self.MIN_DELAY_S, delay))
