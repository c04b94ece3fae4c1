"""Offline throughput, nano-vllm style: random token ids, uniform input/output lengths, ignore_eos, seeded.

    python bench/offline.py --compare-hf                 # the issue's CPU workload (64 seqs, 64-512 in, 64-256 out)
    python bench/offline.py --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024
    python bench/offline.py --shapes all                 # every shape of SHAPES against transformers, one table
    python bench/offline.py --shapes b1-long-out,b32-short --dtype bfloat16

Both sides count only the requested output tokens. With --compare-hf, transformers' batched `generate`
(same weights, fp32 on CPU, left-padded batches of up to --hf-batch-size requests, each batch generating until
its longest request's max_tokens) runs on the same requests in the same process; the ratio is printed last.
"""

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hf_reference import load_hf_model  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.serving.cli_args import add_engine_args, engine_args_from  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A workload: how many sequences, and the ranges their prompt and output lengths are drawn from."""

    num_seqs: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int


# Short and long prompts and outputs at 1, 8, 32 and 64 sequences; each axis changes alone somewhere.
SHAPES = {
    "b1-long-out": Shape(1, 16, 32, 128, 128),
    "b1-long-in": Shape(1, 512, 512, 32, 32),
    "b8-short": Shape(8, 16, 64, 16, 32),
    "b8-long": Shape(8, 256, 512, 128, 256),
    "b32-short": Shape(32, 16, 64, 16, 32),
    "b32-long-out": Shape(32, 16, 64, 128, 256),
    "b32-long-in": Shape(32, 256, 512, 16, 32),
    "b64-mixed": Shape(64, 64, 512, 64, 256),
}


def make_workload(shape, vocab_size: int, seed: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per sequence, from one seeded generator. `shape`: a Shape, or any
    object with its fields (the parsed arguments; their `seed` unless `seed` is given)."""
    rng = random.Random(shape.seed if seed is None else seed)
    workload = []
    for _ in range(shape.num_seqs):
        num_input = rng.randint(shape.min_input, shape.max_input)
        num_output = rng.randint(shape.min_output, shape.max_output)
        prompt = [rng.randrange(10, min(vocab_size, 10_000)) for _ in range(num_input)]
        workload.append((prompt, num_output))
    return workload


def run_llmserve(llm: LLM, workload, progress: bool = True) -> tuple[float, int]:
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(out["token_ids"]) for out in outputs)
    expected = sum(n for _, n in workload)
    if num_tokens != expected:
        raise RuntimeError(f"llmserve produced {num_tokens} tokens, expected {expected}")
    return elapsed, num_tokens


def run_hf(model, pad_id: int, workload, batch_size: int, device: str, progress: bool = True) -> tuple[float, int]:
    import torch

    start = time.perf_counter()
    num_tokens = 0
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        longest_prompt = max(len(p) for p, _ in batch)
        longest_output = max(n for _, n in batch)
        input_ids = torch.full((len(batch), longest_prompt), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (prompt, _) in enumerate(batch):
            input_ids[row, longest_prompt - len(prompt):] = torch.tensor(prompt)
            mask[row, longest_prompt - len(prompt):] = 1
        with torch.inference_mode():
            model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=True,
                           temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=longest_output,
                           min_new_tokens=longest_output, pad_token_id=pad_id)
        num_tokens += sum(n for _, n in batch)
        if progress:
                print(f"  hf batch {first // batch_size + 1}: {len(batch)} seqs, {time.perf_counter() - start:.1f}s",
                  flush=True)
    return time.perf_counter() - start, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated names, or 'all', from: {', '.join(SHAPES)} (implies --compare-hf)")
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-num-seqs")
    add_engine_args(parser)
    parser.set_defaults(max_num_seqs=64)
    args = parser.parse_args()

    llm = LLM(**_engine_kwargs(args))
    print(f"llmserve dtype {llm.runner.dtype}, quantization {llm.runner.quantization}, transformers fp32")
    if args.shapes:
        run_shapes(args, llm, list(SHAPES) if args.shapes == "all" else args.shapes.split(","))
        return
    shape = Shape(args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output)
    workload = make_workload(shape, llm.runner.vocab_size, args.seed)
    print(f"workload: {args.num_seqs} seqs, input {args.min_input}-{args.max_input}, "
          f"output {args.min_output}-{args.max_output}, {sum(len(p) for p, _ in workload)} prompt tokens, "
          f"{sum(n for _, n in workload)} output tokens")
    ours_s, ours_tokens = run_llmserve(llm, workload)
    ours_tps = ours_tokens / ours_s
    print(f"llmserve: {ours_tokens} tokens in {ours_s:.2f}s = {ours_tps:.1f} tok/s  stats={llm.stats()}")
    if not args.compare_hf:
        return
    model, pad_id = load_hf_model(args.model, str(llm.runner.device))
    hf_s, hf_tokens = run_hf(model, pad_id, workload, args.hf_batch_size or args.max_num_seqs,
                             str(llm.runner.device))
    hf_tps = hf_tokens / hf_s
    print(f"transformers: {hf_tokens} tokens in {hf_s:.2f}s = {hf_tps:.1f} tok/s")
    print(f"ratio llmserve/transformers: {ours_tps / hf_tps:.2f}x")


def run_shapes(args, llm: LLM, names: list[str]) -> None:
    """Each named shape through both engines in turn (same requests, same process), then one table."""
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    model, pad_id = load_hf_model(args.model, str(llm.runner.device))
    run_hf(model, pad_id, [([1, 2, 3], 4)], 1, str(llm.runner.device), progress=False)  # warm-up, as ours has
    rows = []
    for name in names:
        shape = SHAPES[name]
        workload = make_workload(shape, llm.runner.vocab_size, args.seed)
        ours_s, tokens = run_llmserve(llm, workload, progress=False)
        hf_s, _ = run_hf(model, pad_id, workload, args.hf_batch_size or args.max_num_seqs,
                         str(llm.runner.device), progress=False)
        rows.append((name, shape, tokens / ours_s, tokens / hf_s))
        print(f"{name}: llmserve {tokens / ours_s:.1f} tok/s, transformers {tokens / hf_s:.1f} tok/s", flush=True)
    print("\n| shape | seqs | input | output | llmserve tok/s | transformers tok/s | ratio |\n|---|---|---|---|---|---|---|")
    for name, shape, ours, theirs in rows:
        print(f"| {name} | {shape.num_seqs} | {shape.min_input}-{shape.max_input} | "
              f"{shape.min_output}-{shape.max_output} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


def _engine_kwargs(args) -> dict:
    engine_args = engine_args_from(args)
    return {name: getattr(engine_args, name) for name in engine_args.field_names()}


if __name__ == "__main__":
    main()
