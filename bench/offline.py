"""Offline throughput, nano-vllm style: random token ids, uniform input/output lengths, ignore_eos, seeded.

    python bench/offline.py --compare-hf                 # the issue's CPU workload (64 seqs, 64-512 in, 64-256 out)
    python bench/offline.py --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024

Both sides count only the requested output tokens. With --compare-hf, transformers' batched `generate`
(same weights, fp32 on CPU, left-padded batches of up to --hf-batch-size requests, each batch generating until
its longest request's max_tokens) runs on the same requests in the same process; the ratio is printed last.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.serving.cli_args import add_engine_args, engine_args_from  # noqa: E402


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per sequence, from one seeded generator."""
    rng = random.Random(args.seed)
    workload = []
    for _ in range(args.num_seqs):
        num_input = rng.randint(args.min_input, args.max_input)
        num_output = rng.randint(args.min_output, args.max_output)
        prompt = [rng.randrange(10, min(vocab_size, 10_000)) for _ in range(num_input)]
        workload.append((prompt, num_output))
    return workload


def run_llmserve(llm: LLM, workload) -> tuple[float, int]:
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(out["token_ids"]) for out in outputs)
    expected = sum(n for _, n in workload)
    if num_tokens != expected:
        raise RuntimeError(f"llmserve produced {num_tokens} tokens, expected {expected}")
    return elapsed, num_tokens


def run_hf(model_path: str | None, workload, batch_size: int, device: str) -> tuple[float, int]:
    import torch

    from bench.hf_reference import load_hf_model

    model, pad_id = load_hf_model(model_path, device)
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
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-num-seqs")
    add_engine_args(parser)
    parser.set_defaults(max_num_seqs=64)
    args = parser.parse_args()

    llm = LLM(**_engine_kwargs(args))
    workload = make_workload(args, llm.runner.vocab_size)
    print(f"workload: {args.num_seqs} seqs, input {args.min_input}-{args.max_input}, "
          f"output {args.min_output}-{args.max_output}, {sum(len(p) for p, _ in workload)} prompt tokens, "
          f"{sum(n for _, n in workload)} output tokens")
    ours_s, ours_tokens = run_llmserve(llm, workload)
    ours_tps = ours_tokens / ours_s
    print(f"llmserve: {ours_tokens} tokens in {ours_s:.2f}s = {ours_tps:.1f} tok/s  stats={llm.stats()}")
    if not args.compare_hf:
        return
    hf_s, hf_tokens = run_hf(args.model, workload, args.hf_batch_size or args.max_num_seqs, str(llm.runner.device))
    hf_tps = hf_tokens / hf_s
    print(f"transformers: {hf_tokens} tokens in {hf_s:.2f}s = {hf_tps:.1f} tok/s")
    print(f"ratio llmserve/transformers: {ours_tps / hf_tps:.2f}x")


def _engine_kwargs(args) -> dict:
    engine_args = engine_args_from(args)
    return {name: getattr(engine_args, name) for name in engine_args.field_names()}


if __name__ == "__main__":
    main()
