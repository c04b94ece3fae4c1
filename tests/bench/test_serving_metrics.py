"""The serving benchmark's arithmetic on fabricated timestamps: TTFT, TPOT, ITL, e2e, percentiles, failures."""

import pytest

from bench.serving_metrics import (FINISH_REASON_LENGTH, RequestRecord, final_report, format_table, itls_s,
                                   percentile, summarize, tpot_s, ttft_s)

FINISH_REASON_STOP = 2


def record(start: float, events: list[tuple[float, int]], end: float, expected: int | None = None,
           finish_reason: int = FINISH_REASON_LENGTH, error: str | None = None, cached: int = 0) -> RequestRecord:
    num_tokens = sum(count for _, count in events)
    return RequestRecord(num_expected_tokens=num_tokens if expected is None else expected, start_s=start, end_s=end,
                         token_events=list(events), finish_reason=finish_reason, error=error,
                         num_cached_tokens=cached)


def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97 * (4 - 3)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_one_request_ttft_tpot_itl():
    # 5 tokens: 1 at +0.2 s, 1 at +0.25 s, 2 together at +0.65 s, 1 at +0.7 s; stream closes at +0.75 s.
    rec = record(10.0, [(10.2, 1), (10.25, 1), (10.65, 2), (10.7, 1)], 10.75)
    assert rec.num_tokens == 5
    assert ttft_s(rec) == pytest.approx(0.2)
    assert tpot_s(rec) == pytest.approx((0.75 - 0.2) / 4)
    assert itls_s(rec) == pytest.approx([0.05, 0.2, 0.2, 0.05])  # the 0.4 s gap is shared by its 2 tokens
    assert sum(itls_s(rec)) == pytest.approx(10.7 - 10.2)


def test_single_token_request_has_no_tpot_or_itl():
    rec = record(0.0, [(0.3, 1)], 0.31)
    assert tpot_s(rec) is None
    assert itls_s(rec) == []


def test_summary_percentiles_across_requests_and_pooled_itl():
    records = [
        record(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], 0.3, cached=16),  # ttft 100, tpot 100, itl 100 100
        record(0.5, [(0.8, 1), (1.0, 1)], 1.0, cached=32),  # ttft 300, tpot 200, itl 200
        record(1.0, [(1.2, 1), (1.25, 2)], 1.3),  # ttft 200, tpot 50, itl 25 25
    ]
    summary = summarize(records, wall_s=2.0)
    assert (summary.num_requests, summary.num_failed, summary.num_output_tokens) == (3, 0, 8)
    assert summary.num_cached_tokens == 48
    assert summary.output_tokens_per_s == pytest.approx(4.0)
    assert summary.requests_per_s == pytest.approx(1.5)
    assert summary.ttft.mean_ms == pytest.approx(200.0)
    assert summary.ttft.p50_ms == pytest.approx(200.0)
    assert summary.ttft.p99_ms == pytest.approx(200.0 + 0.98 * 100.0)
    assert summary.tpot.p50_ms == pytest.approx(100.0)
    assert summary.tpot.mean_ms == pytest.approx(350.0 / 3)
    # pooled ITLs sorted: 25 25 100 100 200 -> p50 100, p99 at rank 3.96: 100 + 0.96 * 100
    assert summary.itl.p50_ms == pytest.approx(100.0)
    assert summary.itl.p99_ms == pytest.approx(196.0)
    assert summary.itl.mean_ms == pytest.approx(90.0)
    assert summary.e2e.p50_ms == pytest.approx(300.0)
    assert summary.e2e.mean_ms == pytest.approx(((0.3 + 0.5 + 0.3) / 3) * 1000.0)


def test_failures_are_counted_and_left_out_of_the_stats():
    good = record(0.0, [(0.1, 1), (0.3, 1)], 0.3)
    records = [
        good,
        record(0.0, [(0.05, 1)], 0.1, expected=2),  # short
        record(0.0, [(0.05, 1), (0.06, 1), (0.07, 1)], 0.1, expected=2),  # too long
        record(0.0, [(0.05, 1), (0.06, 1)], 0.1, finish_reason=FINISH_REASON_STOP),
        record(0.0, [], 0.1, expected=2, finish_reason=0, error="UNAVAILABLE: engine down"),
    ]
    summary = summarize(records, wall_s=1.0)
    assert summary.num_failed == 4
    assert summary.num_output_tokens == 2
    assert summary.requests_per_s == pytest.approx(1.0)
    assert summary.ttft.p99_ms == pytest.approx(100.0)
    assert summary.itl.mean_ms == pytest.approx(200.0)
    reasons = "\n".join(summary.failures)
    assert "request 1: got 1 tokens, expected 2" in reasons
    assert "request 2: got 3 tokens, expected 2" in reasons
    assert "request 3: finish_reason 2" in reasons
    assert "request 4: UNAVAILABLE: engine down" in reasons


def test_all_failed_summary_has_no_stats_and_renders():
    summary = summarize([record(0.0, [], 0.1, expected=3, finish_reason=0, error="CANCELLED: x")], wall_s=0.5)
    assert summary.ttft is None and summary.itl is None and summary.output_tokens_per_s == 0.0
    ok = summarize([record(0.0, [(0.1, 1), (0.2, 1)], 0.2, cached=16)], wall_s=0.5)
    table = format_table("concurrency 1", {"via tokenizer": ok, "engine direct": summary})
    lines = table.splitlines()
    assert lines[0] == "== concurrency 1 =="
    ttft_line = next(line for line in lines if line.startswith("TTFT"))
    assert "100.0" in ttft_line and "n/a" in ttft_line
    cells = {line.split("|")[0].strip(): [cell.strip() for cell in line.split("|")[1:]] for line in lines[3:]}
    assert cells["ok / failed"] == ["1 / 0", "0 / 1"]
    assert cells["cached prompt tok"] == ["16", "0"]
    assert cells["output tok/s"] == ["4.0", "0.0"]
    assert cells["TTFT"] == ["100.0    100.0    100.0", "n/a"]
    assert len({len(line) for line in lines[1:]}) == 1  # every row lines up


def test_final_report_ratio_and_ttft_overhead_come_from_the_first_mode_and_end_the_report():
    served = summarize([record(0.0, [(0.25, 1), (0.5, 1)], 0.5), record(0.0, [(0.35, 1), (0.5, 1)], 0.5)], 1.0)
    direct = summarize([record(0.0, [(0.1, 1), (0.5, 1)], 0.5), record(0.0, [(0.2, 1), (0.5, 1)], 0.5)], 1.0)
    later = summarize([record(0.0, [(0.9, 1)], 1.0, expected=2)], 1.0)
    text, num_failed = final_report([(("concurrency", 2), served, direct), (("rate", 0.5), later, None)], 8.0)
    lines = text.splitlines()
    assert num_failed == 1
    assert "== concurrency 2 ==" in lines and "== Poisson request rate 0.5/s ==" in lines
    assert "  via tokenizer FAILED request 0: got 1 tokens, expected 2" in lines
    assert lines[-2:] == ["served/offline throughput ratio: 0.50",  # 4 served tok/s over 8 offline
                          "tokenizer-service TTFT overhead p50: 150.0 ms"]  # p50 300 ms vs 150 ms
    text, _ = final_report([(("concurrency", 2), served, None)], 2.0)
    assert text.splitlines()[-2:] == ["served/offline throughput ratio: 2.00",
                                      "tokenizer-service TTFT overhead p50: n/a"]
