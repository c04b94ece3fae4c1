"""Host time per engine step with a null runner: everything but the forward pass.

    OMP_NUM_THREADS=1 python bench/step_host_time.py                 # 64/256/1024 seqs x 128/2048 tokens
    OMP_NUM_THREADS=1 python bench/step_host_time.py --seqs 256 --context 128 --blocks 3100000
    OMP_NUM_THREADS=1 python bench/step_host_time.py --kv-events   # each config with KV-cache events off, then on

The real EngineCore, scheduler and block manager run; the runner does the model runner's real input
preparation (block tables, positions, slot mapping, context lens, the sampling batch, tensors on --device)
and then "samples" a fixed non-EOS token instead of running the model. Reported per decode step, in ms of
this thread's CPU time (so other processes on a shared machine do not inflate it): schedule, input
preparation (the runner's execute), postprocess, the rest of EngineCore.step (outputs) and the total; and
the total in wall-clock time. --blocks also times building a block manager of that many blocks (and its
memory). --kv-events measures each configuration twice: with nobody subscribed to KV-cache events, then with the
core recording them and taking and pickling them after every step as the CoreLoop does for a subscribed front
(`events` column, included in the total), and prints the ratio of the totals.
"""

import argparse
import gc
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.engine.core.block_manager import BlockManager  # noqa: E402
from services.engine.core.config import SchedulerConfig  # noqa: E402
from services.engine.core.engine import EngineCore  # noqa: E402
from services.engine.core.interfaces import SchedulerOutput  # noqa: E402
from services.engine.core.sampling_params import SamplingParams  # noqa: E402
from services.engine.runner.inputs import StepInputBuilder  # noqa: E402
from services.engine.runner.sampling_batch import make_sampling_batch  # noqa: E402

EOS_TOKEN_ID = 0
SAMPLED_TOKEN_ID = 7
VOCAB_SIZE = 32000
BLOCK_SIZE = 16


class NullRunner:
    """The model runner's host-side work for a step, then a fixed token for every sampled sequence."""

    def __init__(self, max_model_len: int, max_num_seqs: int, device: torch.device):
        self.device = device
        self.inputs = StepInputBuilder(BLOCK_SIZE, -(-max_model_len // BLOCK_SIZE), max_num_seqs, device)

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        step = self.inputs.build(batch)
        model_inputs = self.inputs.to_model_inputs(step)
        self.inputs.inputs_enqueued()
        sampled_seqs = [batch.seqs[i] for i in step.sample_seq_indices]
        make_sampling_batch(sampled_seqs, VOCAB_SIZE, self.device)
        del model_inputs
        results: list[int | None] = [None] * len(batch.seqs)
        for i in step.sample_seq_indices:
            results[i] = SAMPLED_TOKEN_ID
        return results


class Timers:
    """Wraps a bound method so each call adds its CPU time (this thread's) to a per-step bucket."""

    def __init__(self):
        self.current: dict[str, float] = {}

    def wrap(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.thread_time() - start
        return timed


def build_engine(num_seqs: int, context: int, num_steps: int, device: torch.device) -> EngineCore:
    max_model_len = context + num_steps + BLOCK_SIZE
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(num_seqs, 65536),
                             max_model_len=max_model_len, block_size=BLOCK_SIZE,
                             num_kvcache_blocks=num_seqs * -(-max_model_len // BLOCK_SIZE) + 16)
    return EngineCore(config, NullRunner(max_model_len, num_seqs, device), [EOS_TOKEN_ID], VOCAB_SIZE)


def measure(num_seqs: int, context: int, num_steps: int, warmup: int, device: torch.device,
            kv_events: bool = False) -> dict[str, float]:
    """Median ms per decode step of each phase, with num_seqs sequences of about `context` tokens running."""
    engine = build_engine(num_seqs, context, num_steps + warmup, device)
    engine.record_kv_events(kv_events)
    sampling = SamplingParams(temperature=0.0, max_tokens=num_steps + warmup + 8, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [1 + (i * 7919 + j) % (VOCAB_SIZE - 1) for j in range(context)]
        engine.add_request(f"r{i}", prompt, sampling)
    while engine.scheduler.waiting:
        engine.step()
    timers = Timers()
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine.runner.execute = timers.wrap("input_prep", engine.runner.execute)
    engine.scheduler.postprocess = timers.wrap("postprocess", engine.scheduler.postprocess)
    samples: dict[str, list[float]] = {}
    gc.collect()
    for index in range(warmup + num_steps):
        timers.current = {}
        start, start_wall = time.thread_time(), time.perf_counter()
        engine.step()
        if kv_events:
            events_start = time.thread_time()
            events = engine.take_kv_events()
            pickle.dumps((events.block_hashes, events.cached) if events else None, protocol=pickle.HIGHEST_PROTOCOL)
            timers.current["events"] = time.thread_time() - events_start
        timers.current["total"] = time.thread_time() - start
        timers.current["wall"] = time.perf_counter() - start_wall
        if len(engine.scheduler.running) != num_seqs:
            raise RuntimeError("a sequence left the running set during the measurement")
        if index >= warmup:
            for name, seconds in timers.current.items():
                samples.setdefault(name, []).append(seconds * 1e3)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result.setdefault("events", 0.0)
    result["outputs"] = (result["total"] - result["schedule"] - result["input_prep"] - result["postprocess"]
                         - result["events"])
    return result


def block_manager_creation(num_blocks: int) -> tuple[float, float]:
    """Seconds to build a block manager of num_blocks, and the resident memory it added (MiB)."""
    gc.collect()
    rss_before = _rss_bytes()
    start = time.perf_counter()
    manager = BlockManager(num_blocks, BLOCK_SIZE)
    seconds = time.perf_counter() - start
    rss_after = _rss_bytes()
    del manager
    return seconds, (rss_after - rss_before) / 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=0, help="also time a block manager of this many blocks")
    parser.add_argument("--kv-events", action="store_true", help="each configuration without, then with KV events")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if args.blocks:
        seconds, mib = block_manager_creation(args.blocks)
        print(f"block manager of {args.blocks:,} blocks: {seconds:.3f} s to build, +{mib:.0f} MiB resident")
    print(f"null runner on {device}, block size {BLOCK_SIZE}; median ms per decode step over {args.steps} steps"
          " (CPU time of this thread; wall: elapsed)")
    print(f"{'seqs':>6} {'context':>8} {'kv':>3} {'schedule':>9} {'inputs':>8} {'postproc':>9} {'outputs':>8}"
          f" {'events':>7} {'total':>8} {'us/seq':>7} {'wall':>8}")
    for num_seqs in args.seqs:
        for context in args.context:
            totals = []
            for kv_events in (False, True) if args.kv_events else (False,):
                r = measure(num_seqs, context, args.steps, args.warmup, device, kv_events)
                totals.append(r["total"])
                print(f"{num_seqs:>6} {context:>8} {'on' if kv_events else 'off':>3} {r['schedule']:>9.3f} "
                      f"{r['input_prep']:>8.3f} {r['postprocess']:>9.3f} {r['outputs']:>8.3f} {r['events']:>7.3f} "
                      f"{r['total']:>8.3f} {r['total'] * 1e3 / num_seqs:>7.2f} {r['wall']:>8.3f}", flush=True)
            if len(totals) == 2:
                print(f"{'':>19} on/off total: {totals[1] / totals[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
