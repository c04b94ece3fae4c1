"""Where an engine front's CPU per token goes on the GenerateBatch path, in one process, with no gRPC and no model.

    python bench/front_relay.py                        # 1, 64, 256 and 1,024 streams
    python bench/front_relay.py --streams 256 --steps 96 --repeats 5

A front (services.engine.serving.async_engine.AsyncEngine) is wired to one end of a pipe; N requests are
admitted through a BatchSession as a GenerateBatch call admits them, and --steps decode steps of N tokens are
fed in the form the core sends them (pickled StepOutputs, the last one finishing every request). Per phase it
reports CPU µs per token (time.process_time, best of --repeats):

- deliver: decode a step message and hand each token to its stream (AsyncEngine._dispatch);
- collect: take the call's ready outputs (BatchSession.collect);
- build / serialize: the GenerateBatchResponse of those outputs (convert.batch_responses) and its bytes;
- admit: per request, start its record and open it on the engine; encode: its AddRequest command's bytes
  (µs per request, and per token at --steps tokens per request).

This is the front's own Python, uncontended: bench/stack.py measures the service whole (gRPC, the event loop,
threads, the kernel) under load, where the same work costs more.
"""

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import sys
import time
from array import array
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "clients", "python")]

from services.common.metrics import RequestObserver  # noqa: E402
from services.engine.core.interfaces import EngineStats  # noqa: E402
from services.engine.core.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.sequence import FinishReason  # noqa: E402
from services.engine.serving.async_engine import AsyncEngine  # noqa: E402
from services.engine.serving.batch_session import BatchSession  # noqa: E402
from services.engine.serving.convert import batch_responses  # noqa: E402
from services.engine.serving.messages import FinishedRequest, StepOutputs, decode, encode  # noqa: E402

PHASES = ("deliver", "collect", "build", "serialize")
PROMPT_LEN = 64



class _Description:
    """The least of an EngineDescription an AsyncEngine reads."""

    num_total_blocks = 1 << 20


@dataclass
class RelayCost:
    """CPU µs per token of each phase, and per request of admission and command encoding."""

    num_streams: int
    per_token_us: dict[str, float]
    admit_us: float
    encode_us: float


def step_messages(num_streams: int, num_steps: int) -> list[bytes]:
    """The core's StepOutputs of `num_steps` decode steps for handles 0..num_streams-1, pickled; the last finishes all."""
    handles = array("q", range(num_streams))
    no_cache = array("q", [0] * num_streams)
    stats = EngineStats(num_streams, 0, 0, 0, 0, 0, 0, 0, 0)
    messages = []
    for step in range(num_steps):
        last = step == num_steps - 1
        finished = [FinishedRequest(h, FinishReason.LENGTH, PROMPT_LEN, num_steps, 0, None, 0.0, h, True)
                    for h in range(num_streams)] if last else []
        tokens = array("q", [1000 + step] * num_streams)
        messages.append(encode(StepOutputs(handles, tokens, no_cache, finished, stats, 0)))
    return messages


async def _measure_once(num_streams: int, num_steps: int) -> RelayCost:
    front_end, _core_end = mp.Pipe()
    engine = AsyncEngine(front_end, _Description())
    session = BatchSession(engine, RequestObserver(logging.getLogger("bench.front_relay")), lambda exc: "ERROR")
    sampling = SamplingParams(temperature=0.0, max_tokens=num_steps, ignore_eos=True)
    prompt = list(range(100, 100 + PROMPT_LEN))
    start = time.process_time()
    for i in range(num_streams):
        session.admit(session.start(f"request-{i:06d}"), prompt, sampling)
    admit_s = time.process_time() - start
    commands = []
    while not engine._commands.empty():  # what the writer thread would send: one message of every AddRequest
        commands.append(engine._commands.get())
    start = time.process_time()
    encode(commands)
    encode_s = time.process_time() - start
    spent = dict.fromkeys(PHASES, 0.0)
    for message in step_messages(num_streams, num_steps):
        t0 = time.process_time()
        engine._dispatch(decode(message))
        t1 = time.process_time()
        outputs = session.collect()
        t2 = time.process_time()
        responses = batch_responses(outputs)
        t3 = time.process_time()
        for response in responses:
            response.SerializeToString()
        t4 = time.process_time()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[phase] += seconds
    if session.requests:
        raise RuntimeError(f"{len(session.requests)} requests did not finish")
    front_end.close()
    num_tokens = num_streams * num_steps
    return RelayCost(num_streams, {phase: s * 1e6 / num_tokens for phase, s in spent.items()},
                     admit_s * 1e6 / num_streams, encode_s * 1e6 / num_streams)


def measure(num_streams: int, num_steps: int, repeats: int) -> RelayCost:
    """Each figure's best over `repeats` runs (a shared machine only ever adds time)."""
    runs = [asyncio.run(_measure_once(num_streams, num_steps)) for _ in range(repeats)]
    return RelayCost(num_streams, {phase: min(run.per_token_us[phase] for run in runs) for phase in PHASES},
                     min(run.admit_us for run in runs), min(run.encode_us for run in runs))


def table(costs: list[RelayCost], num_steps: int) -> str:
    lines = [f"engine front relay, CPU µs per token ({num_steps} tokens per request; admit/encode: µs per request)",
             f"{'streams':>8} " + " ".join(f"{phase:>9}" for phase in PHASES) + f" {'total':>9} {'admit':>9} {'encode':>9}"]
    for cost in costs:
        total = sum(cost.per_token_us.values())
        lines.append(f"{cost.num_streams:>8} " + " ".join(f"{cost.per_token_us[p]:>9.2f}" for p in PHASES)
                     + f" {total:>9.2f} {cost.admit_us:>9.1f} {cost.encode_us:>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[RelayCost]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,64,256,1024", help="comma-separated stream counts")
    parser.add_argument("--steps", type=int, default=48, help="decode steps (tokens per request)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    costs = [measure(int(n), args.steps, args.repeats) for n in args.streams.split(",")]
    print(table(costs, args.steps))
    return costs


if __name__ == "__main__":
    main()
