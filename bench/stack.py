"""Stack benchmark: what the serving path costs beyond the model, with a near-zero-compute model.

    python bench/stack.py                          # 256 greedy streams on the tiny Llama (bench/tiny_model.py)
    python bench/stack.py --streams 64
    python bench/stack.py --worker-counts 1,2      # a row set per count: --api-workers N / --workers N
    python bench/stack.py --quick                  # smoke run: 16 streams, short requests

One run measures the same seeded workload (random-token prompts, ignore_eos, temperature 0) three ways:
offline `LLM.generate` in its own process, the engine service called directly, and through both services
(token-id prompts to the tokenizer service, which detokenizes the stream). The services run as subprocesses on
free ports with torch single-threaded; the load comes from --client-procs processes of this benchmark's own
(bench/stack_procs.py), so no load generator's CPU is charged to a service. Per phase it reports throughput,
TTFT and ITL, and CPU µs per streamed token of each service's whole process tree (bench/proc_cpu.py); the
table ends with the ratios to offline and each service's CPU per token beyond the model (bench/stack_report.py).
Per configuration it also reports the tokenizer-added TTFT p50 at --ttft-streams streams: bench/serving.py's
paired probe (1-token requests via the tokenizer and straight to the engine, alternating, so drift cancels)
running beside a load of that many streams through both services; and, with --ttft-probe PAIRS, the same probe
unloaded. --api-workers / --workers are passed only when given. Kernel CPU accounting has 10 ms ticks: keep
phases long enough (the default's are tens of thousands of tokens) for µs per token to mean something.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "clients/python")]

import grpc  # noqa: E402

from bench.proc_cpu import CpuMeter, largest_descendant  # noqa: E402
from bench.serving import ENGINE_SERVICE, TEXTGEN_SERVICE, Service, engine_argv, salted, sampling_for  # noqa: E402
from bench.serving import paired_ttfts, ttft_probe  # noqa: E402
from bench.serving_metrics import percentile, summarize  # noqa: E402
from bench.stack_procs import ENGINE, TEXTGEN, LoadPhase, OfflineRun, load_main, offline_main  # noqa: E402
from bench.stack_report import (BOTH, CLIENT, DIRECT, ENGINE_CORE, OFFLINE, TOKENIZER, PathResult, StackReport,  # noqa: E402
                                format_report, per_token_us, served_result)
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc  # noqa: E402
from services.engine.serving.cli_args import add_engine_args, engine_args_from  # noqa: E402

THREADS = 1
_T0 = time.monotonic()
_MP = mp.get_context("spawn")


class LoadError(Exception):
    """A load generator failed; the pool cannot go on (the others may wait for a "go" that never comes)."""


class LoadPool:
    """The load-generating processes; run() hands each its share of a phase and meters the services meanwhile."""

    def __init__(self, num_procs: int):
        self._conns, self._procs = [], []
        for _ in range(num_procs):
            conn, child_conn = _MP.Pipe()
            proc = _MP.Process(target=load_main, args=(child_conn,), name="stack-load", daemon=True)
            proc.start()
            self._conns.append(conn)
            self._procs.append(proc)

    def run(self, phases: list[LoadPhase], meter: CpuMeter, on_go=None) -> tuple[list, dict[str, float]]:
        """(all request records, CPU seconds per metered tree plus CLIENT: the load generators' own).

        on_go: called once the load has been released (e.g. to start a probe beside it).
        """
        for conn, phase in zip(self._conns, phases):
            conn.send(phase)
        for conn in self._conns[:len(phases)]:
            if (answer := conn.recv()) != "ready":
                raise LoadError(answer)
        meter.start()
        for conn in self._conns[:len(phases)]:
            conn.send("go")
        if on_go is not None:
            on_go()
        results = [conn.recv() for conn in self._conns[:len(phases)]]
        if failed := [result for result in results if isinstance(result, str)]:
            raise LoadError(failed[0])
        cpu_s = meter.stop() | {CLIENT: sum(result.cpu_s for result in results)}
        return [record for result in results for record in result.records], cpu_s

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            conn.send(None)
            proc.join(10)


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def split_phase(path: str, target: str, requests: list, concurrency: int, args, sampling: bytes) -> list[LoadPhase]:
    """The phase dealt round-robin over the load processes (requests, streams and connections alike)."""
    num_procs = min(args.client_procs, concurrency)
    return [LoadPhase(path, target, requests[k::num_procs], sampling, len(range(k, concurrency, num_procs)),
                      max(1, len(range(k, args.connections, num_procs)))) for k in range(num_procs)]


class ProbeBesideLoad:
    """bench/serving.py's paired TTFT probe (via the tokenizer vs straight to the engine), run in a thread of
    this process for as long as a load phase runs: what the tokenizer service adds to TTFT under that load."""

    def __init__(self, workload, target: str, engine_target: str, info):
        self._done = threading.Event()
        self._result: list = []
        probe = paired_ttfts(0, workload, target, engine_target, info, first_id=5000, until=self._done)
        self._thread = threading.Thread(target=lambda: self._result.append(asyncio.run(probe)), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        """{"p50_ms": paired difference p50, "num_pairs", "via_p50_ms", "direct_p50_ms"}; {} if no pair ran."""
        self._done.set()
        self._thread.join()
        via_ms, direct_ms, gaps = self._result[0] if self._result else ([], [], [])
        if not gaps:
            return {}
        return {"p50_ms": percentile(gaps, 50), "num_pairs": len(gaps), "via_p50_ms": percentile(via_ms, 50),
                "direct_p50_ms": percentile(direct_ms, 50)}


class OfflineProcess:
    """LLM.generate of the workload in its own process: it loads and warms up while the services start (so
    startups overlap), then runs on measure(); its CPU per token is the model's own cost."""

    def __init__(self, args, workload):
        warm = salted(workload, 9)[:min(len(workload), args.streams)]
        run = OfflineRun(args.model, engine_kwargs(args), warm, [p for p, _ in workload], [n for _, n in workload],
                         THREADS)
        self._expected = sum(n for _, n in workload)
        self._num_streams = args.streams
        self._conn, child_conn = _MP.Pipe()
        self._proc = _MP.Process(target=offline_main, args=(child_conn, run), name="stack-offline", daemon=True)
        self._proc.start()

    def measure(self) -> PathResult:
        try:
            if self._conn.recv() != "ready":
                raise RuntimeError("the offline process did not get ready")
            meter = CpuMeter({OFFLINE: self._proc.pid})
            meter.start()
            self._conn.send("go")
            num_tokens, elapsed = self._conn.recv()
            cpu_s = meter.stop()
            log(f"offline: {num_tokens} tokens in {elapsed:.1f}s")
        finally:
            self._proc.join(30)
        if num_tokens != self._expected:
            raise RuntimeError(f"offline produced {num_tokens} tokens, expected {self._expected}")
        return PathResult("-", OFFLINE, self._num_streams, num_tokens, 0, num_tokens / elapsed,
                          cpu_us_per_token=per_token_us(cpu_s, num_tokens))


def start_services(args, label: str, extra: tuple[list[str], list[str]], started: list[Service]) -> tuple:
    """(engine, its target, tokenizer, its target), each SERVING; appends each to `started` as it starts."""
    if args.metrics:  # what serving /metrics (and recording every request into it) costs
        extra = ([*extra[0], "--metrics-port", str(free_port())], [*extra[1], "--metrics-port", str(free_port())])
    engine = Service("engine", [*engine_argv(engine_args_from(args)), *extra[0]], THREADS)
    started.append(engine)
    engine_target = engine.wait_ready(ENGINE_SERVICE)
    log(f"{label}: engine service ready")
    tokenizer = Service("tokenizer", ["--engine", engine_target, "--model", args.model, *extra[1]], THREADS)
    started.append(tokenizer)
    target = tokenizer.wait_ready(TEXTGEN_SERVICE)
    log(f"{label}: tokenizer service ready")
    return engine, engine_target, tokenizer, target


def run_config(args, label: str, extra: tuple[list[str], list[str]], workload, pool: LoadPool,
               report: StackReport, offline: OfflineProcess) -> None:
    """Start both services with this configuration's flags, measure every served phase, stop them.

    The offline run is measured once, while the first configuration's services are up but idle.
    """
    started: list[Service] = []
    try:
        engine, engine_target, tokenizer, target = start_services(args, label, extra, started)
        if report.offline is None:
            report.offline = offline.measure()
        with grpc.insecure_channel(target) as channel:
            info = textgen_pb2_grpc.TextGenerationServiceStub(channel).GetModelInfo(textgen_pb2.GetModelInfoRequest())
        sampling = sampling_for(info.default_sampling, 0.0, 1).SerializeToString()
        processes = {ENGINE: engine.proc.pid, TOKENIZER: tokenizer.proc.pid}
        core_pid = largest_descendant(engine.proc.pid)
        if core_pid is not None:
            processes[ENGINE_CORE] = core_pid
        meter = CpuMeter(processes)
        salts = iter(range(info.vocab_size - 1, 0, -1))

        def phase(path: str, tag: str, concurrency: int, num_requests: int, num_tokens: int | None = None,
                  on_go=None):
            prompts = salted(workload, next(salts))
            requests = [(f"stack-{tag}-{i}", prompts[i], num_tokens or workload[i][1]) for i in range(num_requests)]
            phases = split_phase(path, engine_target if path == ENGINE else target, requests, concurrency, args,
                                 sampling)
            records, cpu_s = pool.run(phases, meter, on_go)
            log(f"{label}: {tag} done")
            return summarize(records, max(r.end_s for r in records) - min(r.start_s for r in records)), cpu_s

        warm, _ = phase(TEXTGEN, "warm-up", args.streams, min(args.streams, len(workload)), 2)
        if warm.num_failed:
            raise RuntimeError(f"warm-up failed: {warm.failures[:3]}")
        for path, name in ((ENGINE, DIRECT), (TEXTGEN, BOTH)):
            summary, cpu_s = phase(path, f"{name}-{args.streams}", args.streams, len(workload))
            report.rows.append(served_result(label, name, args.streams, summary, cpu_s))
        if args.ttft_streams:
            probe = ProbeBesideLoad(workload, target, engine_target, info)
            phase(TEXTGEN, f"ttft-load-{args.ttft_streams}", args.ttft_streams,
                  min(len(workload), 2 * args.ttft_streams), on_go=probe.start)
            report.ttft_added[label] = probe.stop()
        if args.ttft_probe:
            report.probes[label] = asyncio.run(ttft_probe(args.ttft_probe, workload, target, engine_target, info))
    finally:
        for service in reversed(started):
            service.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_configs(args) -> list[tuple[str, tuple[list[str], list[str]]]]:
    """(label, (extra engine flags, extra tokenizer flags)) per configuration to measure: each worker
    configuration once per --engine-calls mode (the mode named in the label when more than one is measured)."""
    modes = args.engine_calls.split(",")
    if len(modes) == 1 and modes[0] == "batched":
        return _worker_configs(args)
    return [(f"{label} {mode}", (engine_extra, [*tokenizer_extra, "--engine-calls", mode]))
            for label, (engine_extra, tokenizer_extra) in _worker_configs(args) for mode in modes]


def _worker_configs(args) -> list[tuple[str, tuple[list[str], list[str]]]]:
    interval = ["--stream-interval", str(args.stream_interval)] if args.stream_interval is not None else []
    suffix = f" si {args.stream_interval}" if interval else ""
    if args.worker_counts:
        return [(f"workers {n}{suffix}", (["--api-workers", str(n), *interval], ["--workers", str(n)]))
                for n in (int(v) for v in args.worker_counts.split(","))]
    engine_extra = ["--api-workers", str(args.api_workers)] if args.api_workers is not None else []
    tokenizer_extra = ["--workers", str(args.workers)] if args.workers is not None else []
    parts = [f"api {args.api_workers}" if engine_extra else "", f"tok {args.workers}" if tokenizer_extra else ""]
    label = (" ".join(p for p in parts if p) or "default") + suffix
    return [(label, (engine_extra + interval, tokenizer_extra))]


def engine_kwargs(args) -> dict:
    engine_args = engine_args_from(args)
    return {name: getattr(engine_args, name) for name in engine_args.field_names() if name != "model"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--streams", type=int, default=256, help="concurrent greedy streams")
    add("--num-requests", dest="num_seqs", type=int, default=None, help="default: 2 x --streams")
    add("--min-input", type=int, default=32)
    add("--max-input", type=int, default=128)
    add("--min-output", type=int, default=32)
    add("--max-output", type=int, default=64)
    add("--bench-seed", dest="seed", type=int, default=0, help="seed of the workload")
    add("--model-seed", type=int, default=0, help="seed of the tiny model written when --model is not given")
    add("--client-procs", type=int, default=2, help="load-generating processes")
    add("--connections", type=int, default=8, help="client connections per service (spread over front workers)")
    add("--worker-counts", default=None, help="comma-separated N: a configuration per N with both flags below")
    add("--api-workers", type=int, default=None, help="engine service --api-workers (passed only when given)")
    add("--workers", type=int, default=None, help="tokenizer service --workers (passed only when given)")
    add("--stream-interval", type=int, default=None, help="engine service --stream-interval (passed only when given)")
    add("--engine-calls", default="batched", metavar="MODE[,MODE]",
        help="tokenizer service --engine-calls: batched, per-request, or both to compare them in one run")
    add("--ttft-streams", type=int, default=64, help="streams of the load beside the TTFT probe (0: skip)")
    add("--ttft-probe", type=int, default=16, metavar="PAIRS", help="paired unloaded TTFT probe (0: skip)")
    add("--json", default=None, metavar="PATH", help="also write the report as JSON")
    add("--metrics", action="store_true", help="run both services with --metrics-port (free ports)")
    add("--quick", action="store_true", help="smoke run: 16 streams, 32 short requests")
    add_engine_args(parser)
    parser.set_defaults(num_kvcache_blocks=8192)
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.min_input, args.max_input, args.min_output, args.max_output = 16, 8, 32, 8, 16
        args.ttft_streams, args.ttft_probe = 8, 2
    args.num_seqs = args.num_seqs or 2 * args.streams
    return args


def main(argv: list[str] | None = None) -> StackReport:
    from bench.offline import make_workload
    from bench.tiny_model import TINY_LLAMA, write_tiny_model

    args = parse_args(argv)
    if not args.model:
        args.model = os.path.join(tempfile.gettempdir(), f"llmserve-bench-tiny-llama-seed{args.model_seed}")
        write_tiny_model(args.model, args.model_seed)
    os.environ.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))  # for the spawned offline run
    workload = make_workload(args, TINY_LLAMA["vocab_size"])
    title = (f"stack: {len(workload)} requests at {args.streams} streams, input {args.min_input}-{args.max_input}, "
             f"output {args.min_output}-{args.max_output} ({sum(n for _, n in workload)} tokens), greedy, ignore_eos; "
             f"model {os.path.basename(args.model)}; torch threads {THREADS}; {args.client_procs} load processes")
    print(title, flush=True)
    report = StackReport(title, None, [], args.ttft_streams)
    offline, pool = OfflineProcess(args, workload), LoadPool(args.client_procs)
    try:
        for label, extra in worker_configs(args):
            try:
                run_config(args, label, extra, workload, pool, report, offline)
            except RuntimeError as exc:  # e.g. a service that does not know a worker flag yet
                log(f"{label}: {exc}")
                lines = str(exc).splitlines()
                report.errors[label] = " ... ".join(dict.fromkeys([lines[0], lines[-1]]))
        if report.offline is None:
            report.offline = offline.measure()
    finally:
        pool.close()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return report


if __name__ == "__main__":
    if main().num_failed():
        sys.exit("some requests failed, or a configuration could not be measured")
