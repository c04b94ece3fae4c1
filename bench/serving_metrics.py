"""Serving-benchmark arithmetic, as vLLM's serving benchmark defines it: TTFT, TPOT, ITL, end-to-end latency.

All times are client-side `time.perf_counter()` seconds. A request's TTFT runs from sending it to the first
message that carries token ids; TPOT is (e2e - TTFT) / (output tokens - 1); each later message that carries
k tokens after a gap g contributes k inter-token latencies of g / k (so a request's ITLs add up to the time
from its first to its last token). TTFT, TPOT and e2e are percentiles over requests; ITL over all tokens.
"""

from dataclasses import dataclass, field

FINISH_REASON_LENGTH = 1  # llmserve.common.v1.FinishReason.FINISH_REASON_LENGTH
PERCENTILES = (50, 99)


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one streamed request.

    token_events: (arrival time, number of token ids) per message that carried token ids, in order.
    num_cached_tokens: prompt tokens the server took from its prefix cache (the last message's usage).
    error: the RPC failure, if the stream did not end with status OK.
    """

    num_expected_tokens: int
    start_s: float
    end_s: float = 0.0
    token_events: list[tuple[float, int]] = field(default_factory=list)
    finish_reason: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(count for _, count in self.token_events)


@dataclass(slots=True)
class Stat:
    """Mean and percentiles of one metric, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class Summary:
    """One load run's results: per-metric stats over the successful requests, throughput over the wall time."""

    num_requests: int
    num_failed: int
    num_output_tokens: int
    num_cached_tokens: int
    wall_s: float
    ttft: Stat | None
    tpot: Stat | None
    itl: Stat | None
    e2e: Stat | None
    failures: list[str] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return (self.num_requests - self.num_failed) / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stat_ms(values_s: list[float]) -> Stat | None:
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    return Stat(sum(ms) / len(ms), percentile(ms, PERCENTILES[0]), percentile(ms, PERCENTILES[1]))


def failure_reason(record: RequestRecord) -> str | None:
    """Why a request does not count as a success, or None: it must end OK with exactly its tokens, LENGTH."""
    if record.error is not None:
        return record.error
    if record.num_tokens != record.num_expected_tokens:
        return f"got {record.num_tokens} tokens, expected {record.num_expected_tokens}"
    if record.finish_reason != FINISH_REASON_LENGTH:
        return f"finish_reason {record.finish_reason}, expected FINISH_REASON_LENGTH"
    return None


def ttft_s(record: RequestRecord) -> float:
    return record.token_events[0][0] - record.start_s


def e2e_s(record: RequestRecord) -> float:
    return record.end_s - record.start_s


def tpot_s(record: RequestRecord) -> float | None:
    """(e2e - TTFT) / (output tokens - 1); None for a one-token request."""
    if record.num_tokens < 2:
        return None
    return (e2e_s(record) - ttft_s(record)) / (record.num_tokens - 1)


def itls_s(record: RequestRecord) -> list[float]:
    """One latency per token after the first message: the gap before its message over that message's tokens."""
    gaps = []
    for (previous, _), (current, count) in zip(record.token_events, record.token_events[1:]):
        gaps += [(current - previous) / count] * count
    return gaps


def summarize(records: list[RequestRecord], wall_s: float) -> Summary:
    """Stats over the requests that succeeded; failures are counted and their reasons kept."""
    ok, failures = [], []
    for index, record in enumerate(records):
        reason = failure_reason(record)
        if reason is None:
            ok.append(record)
        else:
            failures.append(f"request {index}: {reason}")
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    return Summary(
        num_requests=len(records), num_failed=len(failures), num_output_tokens=sum(r.num_tokens for r in ok),
        num_cached_tokens=sum(r.num_cached_tokens for r in records), wall_s=wall_s,
        ttft=stat_ms([ttft_s(r) for r in ok]), tpot=stat_ms(tpots), itl=stat_ms([gap for r in ok for gap in itls_s(r)]),
        e2e=stat_ms([e2e_s(r) for r in ok]), failures=failures)


def format_table(title: str, columns: dict[str, Summary]) -> str:
    """A compact text table: one row per metric, mean/p50/p99 per column (e.g. via tokenizer, engine direct)."""
    num_width = 8
    cell_width = 3 * num_width + 2
    lines = [f"== {title} ==", f"{'':<18}" + "".join(f"| {name:<{cell_width}} " for name in columns),
             f"{'(ms)':<18}" + "".join(f"| {'mean':>{num_width}} {'p50':>{num_width}} {'p99':>{num_width}} "
                                       for _ in columns)]
    for label, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e")):
        cells = []
        for summary in columns.values():
            value = getattr(summary, attr)
            cells.append(f"| {'n/a':>{cell_width}} " if value is None else
                         f"| {value.mean_ms:>{num_width}.1f} {value.p50_ms:>{num_width}.1f} "
                         f"{value.p99_ms:>{num_width}.1f} ")
        lines.append(f"{label:<18}" + "".join(cells))
    rows = (("output tok/s", lambda s: f"{s.output_tokens_per_s:.1f}"),
            ("requests/s", lambda s: f"{s.requests_per_s:.2f}"),
            ("wall s", lambda s: f"{s.wall_s:.2f}"),
            ("ok / failed", lambda s: f"{s.num_requests - s.num_failed} / {s.num_failed}"),
            ("cached prompt tok", lambda s: f"{s.num_cached_tokens}"))
    for label, render in rows:
        lines.append(f"{label:<18}" + "".join(f"| {render(s):>{cell_width}} " for s in columns.values()))
    return "\n".join(lines)


def mode_name(mode: tuple[str, float]) -> str:
    """("concurrency", 32) -> "concurrency 32"; ("rate", 4.0) -> "Poisson request rate 4/s"."""
    return f"concurrency {int(mode[1])}" if mode[0] == "concurrency" else f"Poisson request rate {mode[1]:g}/s"


def final_report(results: list[tuple[tuple[str, float], Summary, Summary | None]],
                 offline_tokens_per_s: float) -> tuple[str, int]:
    """(report text, number of failed requests) for (mode, via tokenizer, engine direct or None) per mode.

    A table per mode, then the offline comparison; the last two lines, the throughput ratio served/offline and
    the tokenizer service's added p50 TTFT, come from the first mode.
    """
    lines, num_failed = [], 0
    for mode, served, engine_only in results:
        columns = {"via tokenizer": served} | ({"engine direct": engine_only} if engine_only else {})
        lines.append(format_table(mode_name(mode), columns))
        for name, summary in columns.items():
            num_failed += summary.num_failed
            lines += [f"  {name} FAILED {failure}" for failure in summary.failures[:5]]
    mode, served, engine_only = results[0]
    overhead = (f"{served.ttft.p50_ms - engine_only.ttft.p50_ms:.1f} ms"
                if engine_only and served.ttft and engine_only.ttft else "n/a")
    lines += [f"offline LLM.generate: {offline_tokens_per_s:.1f} output tok/s; served ({mode_name(mode)}): "
              f"{served.output_tokens_per_s:.1f} output tok/s",
              f"served/offline throughput ratio: {served.output_tokens_per_s / offline_tokens_per_s:.2f}",
              f"tokenizer-service TTFT overhead p50: {overhead}"]
    return "\n".join(lines), num_failed
