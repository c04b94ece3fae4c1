"""The stack benchmark's results and their table: throughput, latency and CPU per token, per path and service.

CPU per token is a process tree's user + system CPU over a phase divided by the tokens streamed in it. The
offline run's CPU per token is the model's own work (plus the engine loop); what a service spends beyond it
is the stack's cost: the engine service's figure minus offline's, and all of the tokenizer service's (it runs
no model). One core can relay at most 1e6 / (µs beyond the model) tokens/s through a service.
"""

from dataclasses import asdict, dataclass, field

from bench.serving_metrics import Stat, Summary

OFFLINE, DIRECT, BOTH = "offline", "engine direct", "through both"
ENGINE, TOKENIZER, CLIENT = "engine", "tokenizer", "client"
ENGINE_CORE, ENGINE_FRONTS = "engine core", "engine fronts"  # the engine service split: its core process, the rest


@dataclass(slots=True)
class PathResult:
    """One measured path (OFFLINE, DIRECT or BOTH) of one service configuration (e.g. "workers 2").

    cpu_us_per_token: process name (ENGINE, TOKENIZER, CLIENT, or OFFLINE) -> CPU µs per streamed token.
    """

    config: str
    path: str
    num_streams: int
    num_tokens: int
    num_failed: int
    tokens_per_s: float
    ttft: Stat | None = None
    itl: Stat | None = None
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def per_token_us(cpu_s: dict[str, float], num_tokens: int) -> dict[str, float]:
    return {name: seconds * 1e6 / num_tokens if num_tokens else float("nan") for name, seconds in cpu_s.items()}


def served_result(config: str, path: str, num_streams: int, summary: Summary, cpu_s: dict[str, float]) -> PathResult:
    """A served phase's row: the client-side summary plus the CPU each process tree spent in the phase."""
    return PathResult(config, path, num_streams, summary.num_output_tokens, summary.num_failed,
                      summary.output_tokens_per_s, summary.ttft, summary.itl,
                      per_token_us(cpu_s, summary.num_output_tokens), summary.failures[:5])


@dataclass(slots=True)
class StackReport:
    """Everything one run measured, per configuration where it varies.

    ttft_added: what the tokenizer service adds to TTFT while ttft_streams streams run through both services
    (bench/stack.py's ProbeBesideLoad.stop()); probes: the paired unloaded probe's line (bench/serving.py);
    errors: why a configuration could not be measured. offline is None only until it has been measured.
    """

    title: str
    offline: PathResult | None
    rows: list[PathResult]
    ttft_streams: int = 0
    ttft_added: dict[str, dict[str, float]] = field(default_factory=dict)
    probes: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def offline_us(self) -> float:
        return self.offline.cpu_us_per_token[OFFLINE]

    def beyond_model_us(self, row: PathResult) -> dict[str, float]:
        """Per service in the row: CPU µs per token beyond the model's own work (see the module docstring)."""
        beyond = {}
        if ENGINE in row.cpu_us_per_token:
            beyond[ENGINE] = row.cpu_us_per_token[ENGINE] - self.offline_us()
        if ENGINE_CORE in row.cpu_us_per_token:  # measured apart: the fronts' relay, and the core beyond offline
            beyond[ENGINE_FRONTS] = row.cpu_us_per_token[ENGINE] - row.cpu_us_per_token[ENGINE_CORE]
            beyond[ENGINE_CORE] = row.cpu_us_per_token[ENGINE_CORE] - self.offline_us()
        if row.path == BOTH and TOKENIZER in row.cpu_us_per_token:
            beyond[TOKENIZER] = row.cpu_us_per_token[TOKENIZER]
        return beyond

    def to_dict(self) -> dict:
        return asdict(self) | {"beyond_model_us": [self.beyond_model_us(row) for row in self.rows],
                               "throughput_vs_offline": [row.tokens_per_s / self.offline.tokens_per_s
                                                         for row in self.rows]}

    def num_failed(self) -> int:
        """Failed requests, plus one per configuration that could not be measured."""
        return sum(row.num_failed for row in self.rows) + len(self.errors)


def _cell(stat: Stat | None, attr: str) -> str:
    return f"{getattr(stat, attr):8.1f}" if stat is not None else f"{'-':>8}"


def _cpu_cell(row: PathResult, name: str) -> str:
    value = row.cpu_us_per_token.get(name)
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def format_report(report: StackReport) -> str:
    """The final table, then the ratios, the CPU beyond the model and what one core could relay."""
    width = max([12, *(len(row.config) + 1 for row in report.rows)])  # the config column fits every label
    head = (f"{'config':<{width}}{'path':<15}{'tok/s':>9}{'x offline':>10}{'TTFT p50':>9}{'p99':>8}{'ITL p50':>9}"
            f"{'p99':>8} | CPU µs/token:{ENGINE:>9}{TOKENIZER:>10}{OFFLINE:>9}{CLIENT:>9}")
    lines = [f"== {report.title} ==", head]
    for row in [report.offline, *report.rows]:
        lines.append(f"{row.config:<{width}}{row.path:<15}{row.tokens_per_s:9.0f}"
                     f"{row.tokens_per_s / report.offline.tokens_per_s:10.2f}"
                     f"{_cell(row.ttft, 'p50_ms')[-9:]:>9}{_cell(row.ttft, 'p99_ms')}{_cell(row.itl, 'p50_ms'):>9}"
                     f"{_cell(row.itl, 'p99_ms')} | {'':12}" + "".join(
                         _cpu_cell(row, name) + " " for name in (ENGINE, TOKENIZER, OFFLINE, CLIENT)).rstrip())
        lines += [f"  FAILED {failure}" for failure in row.failures]
    lines.append("(ms for TTFT and ITL; tok/s = streamed output tokens per second of wall time)")
    lines.append(f"CPU µs per streamed token beyond the model (engine: minus offline's {report.offline_us():.1f}; "
                 f"tokenizer: all of it), and the most one core could relay (1e6 / µs):")
    for row in report.rows:
        parts = [f"{name} {us:.1f} µs ({1e6 / us / 1e3:.1f}k tok/s per core)" if us > 0 else f"{name} {us:.1f} µs"
                 for name, us in report.beyond_model_us(row).items()]
        lines.append(f"  {row.config:<{width}}{row.path:<15}" + "; ".join(parts))
    for config in dict.fromkeys(row.config for row in report.rows):
        ratios = {row.path: row.tokens_per_s / report.offline.tokens_per_s for row in report.rows
                  if row.config == config}
        lines.append(f"throughput / offline ({config}): " + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()))
    for config, added in report.ttft_added.items():
        lines.append(f"tokenizer-added TTFT p50 at {report.ttft_streams} streams ({config}): "
                     + (f"{added['p50_ms']:.1f} ms (paired 1-token probes beside the load through both services, "
                        f"{added['num_pairs']:.0f} pairs: via tokenizer p50 {added['via_p50_ms']:.1f} ms, engine "
                        f"direct p50 {added['direct_p50_ms']:.1f} ms)" if added else "no probe pair completed"))
    lines += [f"{config}: {probe}" for config, probe in report.probes.items()]
    lines += [f"{config}: NOT MEASURED: {error}" for config, error in report.errors.items()]
    return "\n".join(lines)
