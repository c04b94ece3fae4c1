"""Batch-1 decode speed: one prompt, N new tokens, greedy; llmserve against transformers in one run.

    python bench/decode_latency.py --prompt-len 128 --new-tokens 128
    python bench/decode_latency.py --dtypes float32,bfloat16      # each dtype of ours, one transformers baseline
Time per output token excludes the prefill (measured as the time to the first token and subtracted).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hf_reference import load_hf_model  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.serving.cli_args import add_engine_args, engine_args_from  # noqa: E402


def ours_decode_ms(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], many, use_tqdm=False)
    total = time.perf_counter() - start
    return (total - first) / (new_tokens - 1) * 1e3


def hf_decode_ms(model, prompt: list[int], new_tokens: int) -> float:
    import torch

    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n)
        return time.perf_counter() - start

    run(2)
    first = run(1)
    total = run(new_tokens)
    return (total - first) / (new_tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated dtypes to measure llmserve with, one after the other (default: --dtype)")
    add_engine_args(parser)
    args = parser.parse_args()
    engine_args = engine_args_from(args)
    kwargs = {name: getattr(engine_args, name) for name in engine_args.field_names()}
    prompt = [(7 * i + 11) % 5000 + 10 for i in range(args.prompt_len)]
    rows = []
    for dtype in (args.dtypes.split(",") if args.dtypes else [kwargs["dtype"]]):
        llm = LLM(**(kwargs | {"dtype": dtype}))
        ours = min(ours_decode_ms(llm, prompt, args.new_tokens) for _ in range(args.repeats))
        rows.append((f"llmserve {dtype} ({llm.runner.dtype})", ours))
        device = str(llm.runner.device)
        del llm
    model, _ = load_hf_model(args.model, device)
    theirs = min(hf_decode_ms(model, prompt, args.new_tokens) for _ in range(args.repeats))
    for name, ms in rows:
        print(f"{name} batch-1 decode: {ms:.2f} ms/token ({1e3 / ms:.1f} tok/s), "
              f"{theirs / ms:.2f}x transformers' speed")
    print(f"transformers fp32 batch-1 decode: {theirs:.2f} ms/token ({1e3 / theirs:.1f} tok/s)")


if __name__ == "__main__":
    main()
