"""Which `--quantization` a runner may use: checked against the device, the tensor-parallel size and the
checkpoint before anything loads (the kernels themselves live in layers/quantization.py)."""

import torch

from services.engine.config import QUANTIZATIONS


def resolve_quantization(name: str, device: torch.device, tp_size: int, is_gguf: bool = True) -> str:
    """Validate `--quantization` for this device, tensor-parallel size and checkpoint; the name, unchanged."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if name == "gguf" and not is_gguf:
        raise ValueError("quantization 'gguf' needs a .gguf model (it keeps the file's Q4_1 tensors); "
                         "use --quantization int8")
    if name != "none" and device.type != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only (torch's CPU int8/int4 kernels); "
                         f"use --quantization none on {device}")
    if name != "none" and tp_size > 1:
        raise ValueError(f"quantization {name!r} is not supported with tensor_parallel_size {tp_size}; "
                         "use --quantization none")
    return name
