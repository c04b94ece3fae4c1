"""Top-p on CPU: each row's TOP_P_CANDIDATES most likely tokens (the sampler's default) against sorting the whole
vocabulary (what it did before, and still does for a row whose survivors do not fit among the candidates),
alternating in the same run.

    python bench/top_p.py                      # B in 1/8/32/256, V=49152, torch on 2 threads
    python bench/top_p.py --rows 1 8 --threads 1 --repeats 20

Timed: Sampler.filtered_probs (temperature, top-k, top-p, min-p) on [B, V] logits of two shapes: "peaked", a
language model's usual shape (a few strong tokens over a long tail: top-p keeps tens of tokens), and "flat"
(plain randn: top-p 0.9 needs thousands of tokens, so rows without top-k fall back to the full sort and the
candidates are pure overhead: where this loses). Scenarios: the embedded model's defaults (temperature 0.2, top_p 0.9),
temperature 0.8 top_p 0.9, and temperature 1.0 top_p 0.95 with top_k 50. Median ms per call and the ratio.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.engine.core.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.sequence import Sequence  # noqa: E402
from services.engine.runner import sampler as sampler_module  # noqa: E402
from services.engine.runner.sampler import Sampler  # noqa: E402
from services.engine.runner.sampling_batch import make_sampling_batch  # noqa: E402

CPU = torch.device("cpu")
VOCAB = 49152
SCENARIOS = {
    "t0.2 p0.9": SamplingParams(temperature=0.2, top_p=0.9),
    "t0.8 p0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "t1 k50 p.95": SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
}


def logits_of(shape: str, num_rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_rows)
    if shape == "flat":
        return torch.randn(num_rows, VOCAB, generator=generator)  # [B, V]
    logits = torch.randn(num_rows, VOCAB, generator=generator) * 2.5  # [B, V]
    logits[:, :16] += 8.0 + 4.0 * torch.rand(num_rows, 16, generator=generator)
    return logits


def _median_ms(call, repeats: int, candidates: int) -> float:
    sampler_module.TOP_P_CANDIDATES = candidates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(shape: str, num_rows: int, params: SamplingParams, repeats: int) -> tuple[float, float]:
    """(full sort ms, candidates ms), median per call, alternating in rounds of 3."""
    seqs = [Sequence(seq_id=row, request_id=f"r{row}", token_ids=[1, 2, 3], sampling=params, num_prompt_tokens=3)
            for row in range(num_rows)]
    batch = make_sampling_batch(seqs, VOCAB, CPU)
    logits = logits_of(shape, num_rows)
    default = sampler_module.TOP_P_CANDIDATES

    def call():
        return Sampler.filtered_probs(logits, batch)

    try:
        _median_ms(call, 2, VOCAB + 1), _median_ms(call, 2, default)  # warm-up
        full, candidates = [], []
        for _ in range(max(1, repeats // 3)):
            full.append(_median_ms(call, 3, VOCAB + 1))
            candidates.append(_median_ms(call, 3, default))
        return statistics.median(full), statistics.median(candidates)
    finally:
        sampler_module.TOP_P_CANDIDATES = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="calls timed per configuration (default: by B)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"V={VOCAB}, CPU, {args.threads} torch threads, {sampler_module.TOP_P_CANDIDATES} candidates; "
          "median ms per filtered_probs call")
    print(f"{'shape':>7} {'B':>4} {'scenario':>12} {'full sort':>10} {'candidates':>11} {'speed-up':>9}")
    for shape in ("peaked", "flat"):
        for num_rows in args.rows:
            repeats = args.repeats or max(6, min(30, 600 // num_rows))
            for name, params in SCENARIOS.items():
                full, candidates = measure(shape, num_rows, params, repeats)
                print(f"{shape:>7} {num_rows:>4} {name:>12} {full:>10.2f} {candidates:>11.2f} "
                      f"{full / candidates:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
