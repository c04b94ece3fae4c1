"""bench/routing.py's workload and report: each round asks for every prefix once, phases never share a prefix,
and the ratio line divides the right totals."""

import random
from collections import Counter

from bench.routing import make_phase, parse_args, report


def test_each_round_asks_for_every_prefix_once_with_unique_suffixes():
    args = parse_args(["--num-prefixes", "5", "--prefix-len", "32", "--suffix-len", "4", "--rounds", "3"])
    prompts = make_phase(args, 40_000, random.Random(0))
    assert len(prompts) == 15 and all(len(p) == 36 and p[0] == 40_000 for p in prompts)
    for start in range(0, 15, 5):
        assert len({tuple(p[:32]) for p in prompts[start:start + 5]}) == 5
    assert max(Counter(tuple(p[:32]) for p in prompts).values()) == 3
    assert len({tuple(p[32:]) for p in prompts}) == 15
    other = make_phase(args, 39_999, random.Random(0))
    assert not {tuple(p[:32]) for p in prompts} & {tuple(p[:32]) for p in other}


def test_the_report_prints_prefix_over_round_robin():
    args = parse_args([])
    rows = [{"policy": "round-robin", "cached": 100, "prompt": 400, "per_engine": [(50, 200), (50, 200)],
             "ttft_p50": 80.0, "ttft_p99": 200.0},
            {"policy": "prefix", "cached": 190, "prompt": 400, "per_engine": [(90, 200), (100, 200)],
             "ttft_p50": 60.0, "ttft_p99": 150.0}]
    text = report(rows, args)
    assert text.splitlines()[-1] == "prefix / round-robin: cached prompt tokens 1.90x, TTFT p50 0.75x"
    assert "47.5%" in text and "90/200, 100/200" in text
