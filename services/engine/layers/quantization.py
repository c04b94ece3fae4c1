"""Weight-only quantization on CPU for calls of few rows: `--quantization int8` (torch's `_weight_int8pack_mm`)
and `--quantization gguf` (a GGUF's Q4_1 tensors in torch's int4 pack, `_weight_int4pack_mm_for_cpu`).

Every projection (Linear and its parallel subclasses) and the LM head keep their full-precision weight and
get a quantized copy at load time (`quantized` attribute: an Int8Weight quantized per output row, or with gguf an
Int4Weight from the file's bytes where the file stores the tensor as Q4_1). `linear()` is the one rule: a
call with at most QUANTIZED_MAX_ROWS rows (decode steps of small batches, the LM head on a few sampled rows) runs
the quantized kernel, any larger call runs F.linear on the full-precision weight, where the kernels lose.

Both kernels run on bf16 activations with bf16 scales (their fp32-activation paths are 2.5-50x slower than
fp32 F.linear on AVX2), so the input is cast to bf16 and the result back to the input's dtype.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# Most rows of one call that take the quantized kernel (int8 or int4). bench/cpu_matmul.py --threads 1 on a
# 2-core AVX2 EPYC (SmolLM2-135M shapes; int8 time as a speed-up over fp32 F.linear, same run):
#   rows   qkv 576->960  o 576->576  gate/up 576->3072  down 1536->576  lm_head 576->49152
#   1      1.18x         0.74x       1.54x              1.13x           1.80x
#   4      1.99x         2.02x       2.81x              1.78x           3.41x
#   8      1.33x         1.19x       1.84x              1.31x           1.36x
#   16     1.12x         0.97x       1.31x              0.98x           1.03x
#   64     0.59x         0.74x       0.76x              0.64x           0.57x
# int4 group-32 (bf16 activations), same run: 1 row 1.05x 0.67x 2.67x 0.81x 3.44x; 8 rows 1.18x 1.11x 2.68x
# 1.29x 1.94x; 16 rows 1.10x 0.98x 1.30x 0.90x 1.71x; 64 rows 0.54x 0.71x 0.78x 0.51x 1.08x.
# So both up to 8 rows (the gain at 16 is within noise, the loss at 64 is not). End to end, batch-1 decode
# (bench/decode_latency.py, 1 thread): fp32 107.8 ms/token, int8 73.7, gguf 56.1.
QUANTIZED_MAX_ROWS = 8


class Int8Weight:
    """A weight [N, K] quantized per output row: int8 values [N, K] and bf16 scales [N], W ~ q * scale.

    `calls` counts the products it computed (tests read it to tell which kernel ran)."""

    def __init__(self, weight: torch.Tensor):
        full = weight.detach().float()  # [N, K]
        # The kernel multiplies by bf16 scales, so round them first and quantize against the rounded ones.
        scales = (full.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)  # [N]
        self.qweight = (full / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales
        self.calls = 0

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] the int8 kernel multiplies by."""
        return self.qweight.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ dequantized()^T [M, N], in x's dtype."""
        self.calls += 1
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)


class Int4Weight:
    """A weight [N, K] in groups of 32 along K, each with a scale and a zero: w = (q - 8) * scale + zero, q in
    0..15, in torch's CPU int4 pack (GGUF Q4_1's w = d * q + m is scale = d, zero = m + 8d). Scales and zeros
    are kept in bf16, the kernel's dtype with bf16 activations (fp32 ones run 0.02-0.4x fp32 F.linear).
    Same interface as Int8Weight."""

    GROUP = 32

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        # q [N, K] in 0..15; d, m [N, K/32] (Q4_1's per-block scale and minimum)
        self.in_features = q.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scale_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1)  # [K/32, N, 2]
        self.scale_zeros = scale_zeros.to(torch.bfloat16).contiguous()
        self.calls = 0

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] the int4 kernel multiplies by (one-hot rows pick each column out exactly)."""
        eye = torch.eye(self.in_features)  # [K, K]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(eye, self.packed, self.GROUP, self.scale_zeros.float()).t().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ dequantized()^T [M, N], in x's dtype."""
        self.calls += 1
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x.to(torch.bfloat16), self.packed, self.GROUP, self.scale_zeros).to(x.dtype)


QuantizedWeight = Int8Weight | Int4Weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           quantized: QuantizedWeight | None) -> torch.Tensor:
    """F.linear(x [..., K], weight [N, K], bias) -> [..., N], by the quantized copy's kernel when `quantized` is set and
    x has at most QUANTIZED_MAX_ROWS rows, else by the full-precision weight."""
    if quantized is None or x.numel() > QUANTIZED_MAX_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    y = quantized.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)  # [..., N]
    return y if bias is None else y + bias


def quantize_model(model: nn.Module, quantization: str, q4_parts: dict | None = None) -> int:
    """After loading: give every module with a `quantized` slot (the linear layers, the LM head) its quantized copy.
    With "gguf", `q4_parts` (loader.gguf_int4.gguf_q4_1_projections) holds the file's Q4_1 projections: those
    modules get an Int4Weight from them, every other one an Int8Weight. Returns how many modules got a copy."""
    if quantization == "none":
        return 0
    count = 0
    for name, module in model.named_modules():
        if not hasattr(module, "quantized") or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        shards = (q4_parts or {}).get(name, {})
        if shards and len(shards) == len(getattr(module, "output_sizes", [None])):
            q, d, m = (torch.from_numpy(np.concatenate([shards[i][j] for i in sorted(shards)])) for j in range(3))
            module.quantized = Int4Weight(q, d, m)
        else:
            module.quantized = Int8Weight(module.weight)
        count += 1
    return count
