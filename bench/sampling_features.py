"""What logprobs and penalties cost per decode step, against the plain sampler measured in the same run.

    python bench/sampling_features.py                        # sampler stage: 64 rows, vocab 49152, 256-token contexts
    python bench/sampling_features.py --model /tmp/tiny      # also whole offline decode steps (bench/tiny_model.py)

Part 1 times the sampling stage alone (StepSampler.sample + bringing ids and logprobs to the host) on random
logits [rows, V], each row a sequence of `--context` tokens that grows by its sampled token every step. Part 2
(with --model) times whole engine steps of the offline LLM: `rows` requests of `--context` prompt tokens decoding
`--steps` tokens each (ignore_eos); per-step time = decode wall time / steps. Configurations alternate within
each repeat and the median is reported, so load from other processes hits all of them alike.
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

BASE = dict(temperature=0.7)  # no top-p: its full sort would dwarf what is measured here
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)
CONFIGS = {  # name -> (params of every row, params of row 0 when they differ)
    "plain": (BASE, None),
    "logprobs=5 all rows": (BASE | dict(num_logprobs=5), None),
    "logprobs=20 all rows": (BASE | dict(num_logprobs=20), None),
    "penalties all rows": (BASE | PENALTIES, None),
    "penalties+logprobs=5 all": (BASE | PENALTIES | dict(num_logprobs=5), None),
    "1 row of 64 asks both": (BASE, BASE | PENALTIES | dict(num_logprobs=5)),
}


def _params(config: str, row: int) -> SamplingParams:
    every, first = CONFIGS[config]
    return SamplingParams(**(first if row == 0 and first is not None else every), max_tokens=4096)


def _seqs(config: str, rows: int, context: int, vocab: int) -> list[Sequence]:
    generator = torch.Generator().manual_seed(0)
    return [Sequence(seq_id=row, request_id=f"r{row}", token_ids=torch.randint(0, vocab, (context,),
                                                                               generator=generator).tolist(),
                     sampling=_params(config, row), num_prompt_tokens=context // 2) for row in range(rows)]


def bench_sampler(args) -> dict[str, float]:
    from services.engine.runner.sampling_step import StepSampler

    device = torch.device("cpu")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)) * 3  # [B, V]
    states = {name: (StepSampler(0, args.vocab, device), _seqs(name, args.rows, args.context, args.vocab))
              for name in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats + 2):
        for name, (sampler, seqs) in states.items():
            started = time.perf_counter()
            ids, logprobs = sampler.sample(logits.clone(), seqs, eos_token_ids=[])
            host_ids = ids.tolist()
            if logprobs is not None:
                logprobs.to_host()
            elapsed = time.perf_counter() - started
            for seq, token_id in zip(seqs, host_ids):
                seq.append_token(token_id)
            if repeat >= 2:  # the first two fill penalty slots and warm the allocator
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_engine(args) -> dict[str, float]:
    from services.engine import LLM

    llm = LLM(args.model, max_num_seqs=args.rows, max_model_len=args.context + args.steps + 8)
    prompts = [torch.randint(10, 10_000, (args.context,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.rows)]
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args.engine_repeats + 1):
        for name in CONFIGS:
            params = []
            for row in range(args.rows):
                p = _params(name, row)
                p.max_tokens, p.ignore_eos = 1, True
                params.append(p)
            llm.generate(prompts, params, use_tqdm=False)  # prefill (the prefix cache keeps it for the next run)
            for p in params:
                p.max_tokens = args.steps + 1
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            if repeat >= 1:
                times[name].append(elapsed / args.steps)
    return {name: statistics.median(values) for name, values in times.items()}


def report(title: str, medians: dict[str, float]) -> None:
    plain = medians["plain"]
    print(title)
    for name, seconds in medians.items():
        print(f"  {name:<26} {seconds * 1e3:8.3f} ms/step   x{seconds / plain:.2f} of plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", default=None, help="a checkpoint for part 2 (e.g. bench/tiny_model.py's)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per engine run (part 2)")
    parser.add_argument("--engine-repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report(f"sampler stage, {args.rows} rows, vocab {args.vocab}, {args.context}-token contexts, "
           f"{torch.get_num_threads()} threads (median of {args.repeats}):", bench_sampler(args))
    if args.model:
        report(f"whole offline decode steps, {args.rows} requests, {args.context}-token prompts, {args.steps} steps "
               f"(median of {args.engine_repeats}):", bench_engine(args))


if __name__ == "__main__":
    main()
