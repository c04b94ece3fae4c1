"""The sampler's cost per step on CPU: inverse-CDF (one uniform per row) against the exponential race it
replaced (B x V exponentials, a torch.Generator per seeded row), measured in the same run.

    OMP_NUM_THREADS=1 python bench/sampler.py                       # B in 1/8/64/256, V=49152, 1 and 2 threads
    python bench/sampler.py --rows 256 --threads 2 --repeats 5

A step = building the sampling batch from the sequences + sampling (what StepSampler does after the logits
stage), at temperature 0.8 with (a) no filter, (b) top_p 0.9, (c) every row seeded (no filter). Reported: the
median ms per step of each, wall-clock and process CPU time (the latter is what a loaded, shared machine
distorts least; with 2 threads it sums both), old and new alternating so a burst of load hits both alike,
and the ratios new/old. The old sampler is a private copy of the replaced code, kept here only as the competitor.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.engine.core.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.sequence import Sequence  # noqa: E402
from services.engine.runner.sampler import Sampler  # noqa: E402
from services.engine.runner.sampling_batch import make_sampling_batch  # noqa: E402

CPU = torch.device("cpu")
VOCAB = 49152
SCENARIOS = {
    "plain": lambda row: SamplingParams(temperature=0.8),
    "top_p 0.9": lambda row: SamplingParams(temperature=0.8, top_p=0.9),
    "seeded": lambda row: SamplingParams(temperature=0.8, seed=1000 + row),
}


# ---- The competitor: the exponential-race sampler as it was before the inverse-CDF rewrite. ----

@dataclass(slots=True)
class _OldBatch:
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    seeded_rows: list[tuple[int, int, int]]  # (row, seed, sample index)


def _old_batch(seqs: list[Sequence], vocab_size: int) -> _OldBatch:
    params = [seq.sampling for seq in seqs]
    greedy = [p.is_greedy for p in params]
    sampled = [p for p, g in zip(params, greedy) if not g]
    return _OldBatch(
        temperatures=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
        top_ks=torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]),
        top_ps=torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params]),
        min_ps=torch.tensor([p.min_p for p in params]),
        is_greedy=torch.tensor(greedy),
        use_top_k=any(0 < p.top_k < vocab_size for p in sampled),
        use_top_p=any(p.top_p < 1.0 for p in sampled),
        use_min_p=any(p.min_p > 0.0 for p in sampled),
        seeded_rows=[(row, seq.sampling.seed, seq.num_completion_tokens)
                     for row, (seq, g) in enumerate(zip(seqs, greedy)) if not g and seq.sampling.seed is not None])


class _OldSampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, batch: _OldBatch) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)  # [B]
        probs = Sampler.filtered_probs(logits.float(), batch)  # the filter code is unchanged
        q = -torch.rand(probs.shape, generator=self.generator).log_()  # [B, V]
        for row, seed, sample_index in batch.seeded_rows:
            generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + sample_index) & ((1 << 63) - 1))
            q[row] = -torch.rand(probs.shape[1], generator=generator).log_()
        return torch.where(batch.is_greedy, greedy_ids, (probs / q).argmax(dim=-1))


# ---- The measurement. ----

def _seqs(num_rows: int, scenario: str) -> list[Sequence]:
    return [Sequence(seq_id=row, request_id=f"r{row}", token_ids=[1, 2, 3, 7, 7], sampling=SCENARIOS[scenario](row),
                     num_prompt_tokens=3) for row in range(num_rows)]


def _time_step(step) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(num_rows: int, scenario: str, repeats: int) -> list[float]:
    """Median ms per step for one configuration: [old wall, new wall, old CPU, new CPU]."""
    seqs = _seqs(num_rows, scenario)
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(num_rows)) * 3  # [B, V]
    old, new = _OldSampler(0), Sampler(0, CPU)

    def old_step():
        return old.sample(logits, _old_batch(seqs, VOCAB))

    def new_step():
        return new.sample(logits, make_sampling_batch(seqs, VOCAB, CPU))

    for _ in range(3):  # warm-up (the allocator settles on reusing the [B, V] buffers)
        old_step(), new_step()
    old_times, new_times = [], []
    for _ in range(repeats):  # alternate, so a burst of load on a shared machine hits both
        old_times.append(_time_step(old_step))
        new_times.append(_time_step(new_step))
    return [statistics.median(t[kind] for t in times) * 1e3 for kind in (0, 1) for times in (old_times, new_times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=None, help="steps timed per configuration (default: by B)")
    args = parser.parse_args()
    print(f"V={VOCAB}, temperature 0.8, CPU, torch {torch.__version__}; median ms per step, wall-clock and "
          "process CPU (all threads)")
    print(f"{'threads':>7} {'B':>4} {'scenario':>10} {'old wall':>9} {'new wall':>9} {'new/old':>8} "
          f"{'old cpu':>9} {'new cpu':>9} {'new/old':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for num_rows in args.rows:
            repeats = args.repeats or max(5, min(100, 2000 // num_rows))
            for scenario in SCENARIOS:
                old_wall, new_wall, old_cpu, new_cpu = measure(num_rows, scenario, repeats)
                print(f"{threads:>7} {num_rows:>4} {scenario:>10} {old_wall:>9.2f} {new_wall:>9.2f} "
                      f"{new_wall / old_wall:>8.2f} {old_cpu:>9.2f} {new_cpu:>9.2f} {new_cpu / old_cpu:>8.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
