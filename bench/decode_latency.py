"""Batch-1 decode speed: one prompt, N new tokens, greedy; llmserve against transformers in one run.

    python bench/decode_latency.py --prompt-len 128 --new-tokens 128
    python bench/decode_latency.py --dtypes float32,bfloat16      # each dtype of ours, one transformers baseline
    OMP_NUM_THREADS=2 python bench/decode_latency.py --quantizations none,int8 --new-tokens 64 --repeats 3
Time per output token excludes the prefill (measured as the time to the first token and subtracted). Every
configuration (each dtype x quantization of ours, and transformers) is loaded first, then the repeats
alternate between them so that noise from other processes lands on all alike; the median is printed.
"""

import argparse
import statistics
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
    parser.add_argument("--quantizations", default=None,
                        help="comma-separated quantizations to measure with each dtype (default: --quantization)")
    add_engine_args(parser)
    args = parser.parse_args()
    engine_args = engine_args_from(args)
    kwargs = {name: getattr(engine_args, name) for name in engine_args.field_names()}
    prompt = [(7 * i + 11) % 5000 + 10 for i in range(args.prompt_len)]
    runs = {}
    for dtype in (args.dtypes.split(",") if args.dtypes else [kwargs["dtype"]]):
        for quantization in (args.quantizations.split(",") if args.quantizations else [kwargs["quantization"]]):
            llm = LLM(**(kwargs | {"dtype": dtype, "quantization": quantization}))
            name = f"llmserve {dtype} ({llm.runner.dtype}), quantization {quantization}"
            runs[name] = (lambda llm=llm: ours_decode_ms(llm, prompt, args.new_tokens))
            device = str(llm.runner.device)
    model, _ = load_hf_model(args.model, device)
    runs["transformers fp32"] = lambda: hf_decode_ms(model, prompt, args.new_tokens)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(run())
    theirs = statistics.median(times["transformers fp32"])
    for name, samples in times.items():
        ms = statistics.median(samples)
        print(f"{name} batch-1 decode: {ms:.2f} ms/token ({1e3 / ms:.1f} tok/s), {theirs / ms:.2f}x transformers' "
              f"speed (median of {len(samples)}; each: {', '.join(f'{t:.2f}' for t in samples)})")


if __name__ == "__main__":
    main()
