"""Which weight format wins on this CPU: fp32 vs bf16 vs torch's int8 weight-only matmul vs torch's int4
group-32 matmul (the GGUF Q4_1 layout), at the embedded model's shapes (SmolLM2-135M: hidden 576, MLP 1536,
vocabulary 49152) and decode/prefill batch sizes.

    python bench/cpu_matmul.py                 # torch's default thread count
    python bench/cpu_matmul.py --threads 2 --batches 1,2,4,8,16,64

The engine's `--dtype auto` picks bf16 on CPUs with AMX or AVX512-BF16 (services/engine/runner/model_runner.py
`cpu_has_fast_bf16`); `--quantization int8` uses the int8 kernel for calls of few rows
(services/engine/layers/quantization.py). This prints the evidence for the machine it runs on, as a ratio
against fp32 F.linear measured in the same run, per shape. Each quantized column times what the engine runs:
fp32 activations in, the cast to the kernel's activation dtype and back included.

- int8: `_weight_int8pack_mm`, per-output-channel scales, bf16 activations (fp32 ones are ~12x slower).
- int4 / int4-f32: `_weight_int4pack_mm_for_cpu`, groups of 32 along K with a scale and a zero each
  (w = (q - 8) * scale + zero, exactly Q4_1's w = d * q + m with zero = m + 8d), bf16 / fp32 activations
  (fp32 activations ran 0.02-0.4x fp32 F.linear on an AVX2 EPYC, so they are off by default).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.layers.quantization import Int4Weight, Int8Weight  # noqa: E402

LAYERS = {"qkv 576->960": (576, 960), "o_proj 576->576": (576, 576), "mlp gate/up 576->3072": (576, 3072),
          "mlp down 1536->576": (1536, 576), "lm_head 576->49152": (576, 49152)}
GROUP = 32


def _time_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` milliseconds per function, the functions interleaved so noise hits them alike."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def _q4_1_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-32 asymmetric 4-bit of weight [N, K] as Q4_1 stores it: q [N, K] in 0..15, d and m [N, K/32],
    w ~ d * q + m (what loader.gguf_int4 reads from a file's bytes)."""
    n, k = weight.shape
    groups = weight.view(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/32]
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(n, k)
    return q, scale, low


def _layer_fns(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """One closure per format computing x [M, K] @ weight [N, K]^T -> fp32 [M, N]; int8 and int4 are the
    engine's own quantized weights (layers/quantization.py), casts included."""
    weight_bf16 = weight.bfloat16()
    int8 = Int8Weight(weight)
    int4 = Int4Weight(*_q4_1_parts(weight))
    scale_zeros_f32 = int4.scale_zeros.float()
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    return {
        "fp32": lambda: torch.nn.functional.linear(x, weight),
        "bf16": lambda: torch.nn.functional.linear(x.bfloat16(), weight_bf16).float(),
        "int8": lambda: int8.matmul(x),
        "int4-f32": lambda: int4_mm(x, int4.packed, GROUP, scale_zeros_f32),
        "int4": lambda: int4.matmul(x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batches", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--formats", default="bf16,int8,int4", help="among bf16, int8, int4, int4-f32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = torch.cpu.get_capabilities()
    print(f"cpu {flags.get('cpu_name')}, {torch.get_num_threads()} threads, amx_bf16={flags.get('amx_bf16')}, "
          f"avx512_bf16={flags.get('avx512_bf16')}, avx2={flags.get('avx2')}")
    columns = args.formats.split(",")
    print("| layer | M | fp32 ms | " + " | ".join(f"{c} ms (x fp32)" for c in columns) + " |")
    print("|---" * (3 + len(columns)) + "|")
    generator = torch.Generator().manual_seed(0)
    for name, (k, n) in LAYERS.items():
        weight = torch.randn(n, k, generator=generator) * 0.02  # [N, K]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, generator=generator)  # [M, K]
            with torch.inference_mode():
                fns = _layer_fns(x, weight)
                ms = _time_ms({c: fns[c] for c in ["fp32", *columns]}, args.repeats)
            cells = " | ".join(f"{ms[c]:.3f} ({ms['fp32'] / ms[c]:.2f}x)" for c in columns)
            print(f"| {name} | {m} | {ms['fp32']:.3f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
