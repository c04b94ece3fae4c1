"""Which weight format wins on this CPU: fp32 vs bf16 vs torch's int8 weight-only matmul, at the embedded
model's shapes (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152) and decode/prefill batch sizes.

    python bench/cpu_matmul.py                 # torch's default thread count
    python bench/cpu_matmul.py --threads 2 --batches 1,8,64,256

The engine's `--dtype auto` picks bf16 on CPUs with AMX or AVX512-BF16 (services/engine/runner/model_runner.py
`cpu_has_fast_bf16`); this prints the evidence for the machine it runs on, as a ratio against fp32 per shape.
int8 is torch's `_weight_int8pack_mm` (per-output-channel scales, bf16 activations on most builds' fast path).
"""

import argparse
import time

import torch

LAYERS = {"qkv 576->960": (576, 960), "mlp up 576->3072": (576, 3072), "mlp down 1536->576": (1536, 576),
          "lm_head 576->49152": (576, 49152)}


def _time_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of weight [N, K]: (int8 [N, K], scales [N])."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = torch.cpu.get_capabilities()
    print(f"cpu {flags.get('cpu_name')}, {torch.get_num_threads()} threads, amx_bf16={flags.get('amx_bf16')}, "
          f"avx512_bf16={flags.get('avx512_bf16')}, avx2={flags.get('avx2')}")
    print("| layer | batch | fp32 ms | bf16 ms (x fp32) | int8 weight-only ms (x fp32) |\n|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, (k, n) in LAYERS.items():
        weight = torch.randn(n, k, generator=generator) * 0.02  # [N, K]
        weight_bf16 = weight.bfloat16()
        weight_int8, scales = _int8_weight(weight)
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, generator=generator)  # [M, K]
            x_bf16 = x.bfloat16()
            with torch.inference_mode():
                fp32 = _time_ms(lambda: torch.nn.functional.linear(x, weight), args.repeats)
                bf16 = _time_ms(lambda: torch.nn.functional.linear(x_bf16, weight_bf16), args.repeats)
                int8 = _time_ms(lambda: torch._weight_int8pack_mm(x_bf16, weight_int8, scales.bfloat16()),
                                args.repeats)
            print(f"| {name} | {m} | {fp32:.3f} | {bf16:.3f} ({fp32 / bf16:.2f}x) | {int8:.3f} ({fp32 / int8:.2f}x) |",
                  flush=True)


if __name__ == "__main__":
    main()
