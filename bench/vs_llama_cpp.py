"""llmserve against llama.cpp on the embedded SmolLM2 GGUF, in one run: batch-1 decode and single-sequence
workloads (llama-cpp-python serves one sequence per model), plus llmserve's batched throughput on the same
workload for scale.

    PYTHONPATH=/tmp/llama_cpp_site python bench/vs_llama_cpp.py --threads 2
    PYTHONPATH=/tmp/llama_cpp_site python bench/vs_llama_cpp.py --threads 2 --quantizations none,gguf

Needs llama-cpp-python (bench/llama_cpp_ref.py says how to install it); exits with a message without it.
llama.cpp runs the file's own Q4_1 weights; llmserve dequantizes them to --dtype, and with --quantization gguf
also keeps them 4-bit for steps of few rows. Both use --threads threads; each llmserve configuration is measured
against llama.cpp again, right after it, so load from other processes hits both alike.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_cpp_ref  # noqa: E402
from bench.decode_latency import ours_decode_ms  # noqa: E402
from bench.offline import SHAPES, make_workload, run_llmserve  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402
from services.engine import LLM  # noqa: E402

SEQUENTIAL_SHAPES = ("b1-long-out", "b1-long-in", "b8-short")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantizations", default="none", help="comma-separated llmserve --quantization values")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not llama_cpp_ref.available():
        sys.exit("llama-cpp-python is not importable; see bench/llama_cpp_ref.py for how to install it")
    import torch

    torch.set_num_threads(args.threads)
    gguf = default_model_path()
    theirs = llama_cpp_ref.load(gguf, args.threads, context_len=1024)
    prompt = [(7 * i + 11) % 5000 + 10 for i in range(args.prompt_len)]
    for quantization in args.quantizations.split(","):
        ours = LLM(gguf, dtype=args.dtype, quantization=quantization, max_model_len=1024, num_kvcache_blocks=1024)
        ours_ms = min(ours_decode_ms(ours, prompt, args.new_tokens) for _ in range(args.repeats))
        theirs_ms = min(llama_cpp_ref.decode_ms(theirs, prompt, args.new_tokens) for _ in range(args.repeats))
        print(f"llmserve {ours.runner.dtype} --quantization {quantization} vs llama.cpp Q4_1, {args.threads} threads")
        print(f"batch-1 decode ({args.prompt_len}-token prompt): llmserve {ours_ms:.2f} ms/token, llama.cpp "
              f"{theirs_ms:.2f} ms/token: llmserve at {theirs_ms / ours_ms:.2f}x llama.cpp's speed")
        print(f"{'shape':<12} {'llmserve tok/s':>15} {'llama.cpp tok/s':>16} {'ratio':>6}")
        for name in SEQUENTIAL_SHAPES:
            workload = make_workload(SHAPES[name], ours.runner.vocab_size, seed=0)
            ours_s, tokens = run_llmserve(ours, workload, progress=False)
            theirs_s, _ = llama_cpp_ref.run_workload(theirs, workload)
            print(f"{name:<12} {tokens / ours_s:>15.1f} {tokens / theirs_s:>16.1f} {theirs_s / ours_s:>5.2f}x")
        del ours

if __name__ == "__main__":
    main()
