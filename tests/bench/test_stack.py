"""The stack benchmark's pieces: CPU of a whole process tree, the load generator's process protocol against a
port-0 fake engine, how a phase is dealt over load processes, which worker flags reach the services, and the
report's structure and arithmetic. No timing assertions: CPU is read from the kernel's accounting."""

import os
import subprocess
import sys
import textwrap
from concurrent import futures

import grpc
import pytest

from bench import stack
from bench.proc_cpu import CpuMeter, largest_descendant, tree_cpu_s
from bench.serving_metrics import Stat
from bench.stack_procs import ENGINE, LoadPhase
from bench.stack_report import BOTH, DIRECT, OFFLINE, PathResult, StackReport, format_report
from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc

BUSY_CPU_S = 0.3
# The child burns BUSY_CPU_S of its own CPU after "go", says "done", then waits; the parent only relays lines.
_BUSY_CHILD = textwrap.dedent(f"""
    import sys, time
    sys.stdin.readline()
    start = time.process_time()
    while time.process_time() - start < {BUSY_CPU_S}:
        pass
    print("done", flush=True)
    sys.stdin.readline()
""")
_IDLE_PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    print(child.pid, flush=True)
    for line in sys.stdin:
        child.stdin.write(line)
        child.stdin.flush()
        if line.strip() == "go":
            print(child.stdout.readline().strip(), flush=True)
    child.stdin.close()
    child.wait()
""")


def test_a_trees_cpu_includes_its_busy_child():
    parent = subprocess.Popen([sys.executable, "-c", _IDLE_PARENT, _BUSY_CHILD], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        meter = CpuMeter({"tree": parent.pid, "child": child_pid})
        before_parent_only = sum(psutil_times(parent.pid))
        meter.start()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        spent = meter.stop()
        parent_only = sum(psutil_times(parent.pid)) - before_parent_only
    finally:
        parent.stdin.close()
        parent.wait(30)
    assert spent["tree"] >= BUSY_CPU_S - 0.05, "the child's CPU must be charged to its parent's tree"
    assert spent["child"] >= BUSY_CPU_S - 0.05
    assert parent_only < BUSY_CPU_S / 2, "the parent itself only relays lines"


def psutil_times(pid: int) -> tuple[float, float]:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


def test_a_reaped_childs_cpu_still_counts():
    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", _BUSY_CHILD], input="go\n\n", text=True, check=True, capture_output=True)
    assert tree_cpu_s(os.getpid()) - before >= BUSY_CPU_S - 0.05
    assert tree_cpu_s(2**22 + 7) == 0.0  # no such process: nothing, not an error


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    """Streams max_tokens ids, one per message, the last with FINISH_REASON_LENGTH."""

    def Generate(self, request, context):
        num_tokens = request.sampling.max_tokens
        for i in range(num_tokens):
            last = i == num_tokens - 1
            yield engine_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7 + i],
                                              finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)


@pytest.fixture
def fake_engine_target():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    engine_pb2_grpc.add_EngineServiceServicer_to_server(FakeEngine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_load_processes_run_a_phase_and_report_every_stream(fake_engine_target):
    args = stack.parse_args(["--client-procs", "2", "--connections", "3"])
    requests = [(f"r{i}", [11, 12, i + 13], 2 + i % 4) for i in range(10)]
    sampling = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True).SerializeToString()
    pool = stack.LoadPool(args.client_procs)
    try:
        phases = stack.split_phase(ENGINE, fake_engine_target, requests, 4, args, sampling)
        records, cpu_s = pool.run(phases, CpuMeter({"server": os.getpid()}))
    finally:
        pool.close()
    assert sorted(r.num_tokens for r in records) == sorted(n for _, _, n in requests)
    assert all(r.error is None and r.finish_reason == common_pb2.FINISH_REASON_LENGTH for r in records)
    assert set(cpu_s) == {"server", "client"} and cpu_s["client"] > 0


def test_a_phase_is_dealt_over_the_load_processes_whole():
    args = stack.parse_args(["--client-procs", "3", "--connections", "8"])
    requests = [(f"r{i}", [i], 4) for i in range(100)]
    phases = stack.split_phase(ENGINE, "t", requests, 64, args, b"")
    assert sorted(spec for p in phases for spec in p.requests) == sorted(requests)
    assert sum(p.concurrency for p in phases) == 64
    assert sum(p.num_connections for p in phases) == 8
    few = stack.split_phase(ENGINE, "t", requests[:2], 2, args, b"")  # fewer streams than processes
    assert [p.concurrency for p in few] == [1, 1] and all(isinstance(p, LoadPhase) for p in few)


def test_worker_flags_reach_the_services_only_when_given():
    assert stack.worker_configs(stack.parse_args([])) == [("default", ([], []))]
    assert stack.worker_configs(stack.parse_args(["--api-workers", "2"])) == [
        ("api 2", (["--api-workers", "2"], []))]
    assert stack.worker_configs(stack.parse_args(["--worker-counts", "1,2"])) == [
        ("workers 1", (["--api-workers", "1"], ["--workers", "1"])),
        ("workers 2", (["--api-workers", "2"], ["--workers", "2"]))]
    assert stack.worker_configs(stack.parse_args(["--workers", "1", "--engine-calls", "per-request,batched"])) == [
        ("tok 1 per-request", ([], ["--workers", "1", "--engine-calls", "per-request"])),
        ("tok 1 batched", ([], ["--workers", "1", "--engine-calls", "batched"]))]


def test_quick_mode_is_small_and_the_default_is_the_issues_workload():
    quick, default = stack.parse_args(["--quick"]), stack.parse_args([])
    assert quick.streams * quick.max_output < default.streams * default.max_output / 50
    assert (default.streams, default.num_seqs, default.ttft_streams) == (256, 512, 64)
    assert default.num_kvcache_blocks >= default.streams * (default.max_input + default.max_output) // 16


def _row(config: str, path: str, tokens_per_s: float, cpu: dict[str, float]) -> PathResult:
    stat = Stat(1.0, 2.0, 3.0)
    return PathResult(config, path, 256, 1000, 0, tokens_per_s, stat, stat, cpu)


def test_report_has_a_row_per_path_ratios_and_cpu_beyond_the_model():
    offline = _row("-", OFFLINE, 5000.0, {OFFLINE: 150.0})
    rows = [_row("workers 1", DIRECT, 4000.0, {"engine": 220.0, "tokenizer": 1.0, "client": 30.0}),
            _row("workers 1", BOTH, 2500.0, {"engine": 230.0, "tokenizer": 125.0, "client": 40.0}),
            _row("workers 2", BOTH, 3000.0, {"engine": 240.0, "tokenizer": 130.0, "client": 40.0})]
    added = {"p50_ms": 12.5, "num_pairs": 40, "via_p50_ms": 30.0, "direct_p50_ms": 17.0}
    report = StackReport("t", offline, rows, 64, {"workers 1": added}, {"workers 1": "TTFT probe ..."})
    assert [report.beyond_model_us(row) for row in rows] == [
        {"engine": 70.0}, {"engine": 80.0, "tokenizer": 125.0}, {"engine": 90.0, "tokenizer": 130.0}]
    as_dict = report.to_dict()
    assert as_dict["throughput_vs_offline"] == [0.8, 0.5, 0.6]
    assert len(as_dict["rows"]) == 3 and as_dict["offline"]["cpu_us_per_token"] == {OFFLINE: 150.0}
    text = format_report(report)
    assert "throughput / offline (workers 1): engine direct 0.80, through both 0.50" in text
    assert "throughput / offline (workers 2): through both 0.60" in text
    assert "engine 80.0 µs (12.5k tok/s per core); tokenizer 125.0 µs (8.0k tok/s per core)" in text
    assert "tokenizer-added TTFT p50 at 64 streams (workers 1): 12.5 ms (paired" in text
    assert "workers 1: TTFT probe ..." in text
    table_rows = [line.split()[:3] for line in text.splitlines() if line.startswith(("- ", "workers")) and "|" in line]
    assert table_rows == [["-", "offline", "5000"], ["workers", "1", "engine"], ["workers", "1", "through"],
                          ["workers", "2", "through"]]


def test_the_engine_split_charges_the_fronts_everything_but_the_core():
    offline = _row("-", OFFLINE, 5000.0, {OFFLINE: 150.0})
    row = _row("batched", BOTH, 2500.0, {"engine": 230.0, "engine core": 190.0, "tokenizer": 125.0})
    report = StackReport("t", offline, [row], 0)
    assert report.beyond_model_us(row) == {"engine": 80.0, "engine fronts": 40.0, "engine core": 40.0,
                                           "tokenizer": 125.0}


def test_the_engine_core_is_the_descendant_holding_the_most_memory():
    parent_script = textwrap.dedent("""
        import subprocess, sys
        small = "import sys; sys.stdin.readline()"
        big = "import sys; block = bytearray(64 << 20); block[::4096] = b'x' * (16 << 10); print(1, flush=True); " \\
              "sys.stdin.readline()"
        children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                    for code in (small, big, small)]
        children[1].stdout.readline()
        print(" ".join(str(child.pid) for child in children), flush=True)
        sys.stdin.readline()
        for child in children:
            child.stdin.close()
            child.wait()
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        small, big, _ = (int(pid) for pid in parent.stdout.readline().split())
        assert largest_descendant(parent.pid) == big
        assert largest_descendant(small) is None
    finally:
        parent.stdin.close()
        parent.wait(30)
