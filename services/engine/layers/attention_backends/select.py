"""Choose an attention backend by name for a device and KV block size.

"auto": flash-attn when it imports on CUDA and the block size suits it, else Triton on CUDA; on the CPU the
"cpu" backend (the torch reference with a compiled paged decode kernel) when that kernel builds, else the
torch reference. flash-attn 2 reads a paged KV cache only in pages of a multiple of 256 tokens, so "auto"
with another block size falls back to Triton (with a warning), and an explicit "flash-attn" with such a
block size is refused.
"""

import functools
import logging

import torch

from services.engine.layers.attention_backends.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flash-attn")
_ALIASES = {"flash": "flash-attn", "flash_attn": "flash-attn", "flashattn": "flash-attn"}
# Same as attention_backends.flash_attn.FLASH_ATTN_PAGE_MULTIPLE (not imported: that module loads triton).
FLASH_ATTN_BLOCK_MULTIPLE = 256
# Backends whose decode launch depends on no host-side per-step value, so a captured CUDA graph stays valid.
CUDA_GRAPH_BACKENDS = ("triton", "flash-attn")


def canonical_backend_name(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return name


def resolve_backend_name(name: str, device: torch.device | str, block_size: int | None = None) -> str:
    """The backend to use; block_size None means "not known yet" (no block-size check)."""
    name = canonical_backend_name(name)
    is_cuda = torch.device(device).type == "cuda"
    fits_flash = block_size is None or block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    if name == "flash-attn":
        _check_explicit_flash(is_cuda, fits_flash, block_size)
        return name
    if name != "auto":
        return name
    if not is_cuda:
        return "cpu" if _cpu_kernel_available() else "torch"
    if _flash_attn_available():
        if fits_flash:
            return "flash-attn"
        logger.warning("flash-attn is installed but needs a KV block size that is a multiple of %d (got %d); "
                       "using the triton attention backend. Pass --kvcache-block-size 256 to use flash-attn.",
                       FLASH_ATTN_BLOCK_MULTIPLE, block_size)
    return "triton"


def _check_explicit_flash(is_cuda: bool, fits_flash: bool, block_size: int | None) -> None:
    if not is_cuda:
        raise ValueError("the flash-attn attention backend needs a CUDA device; use 'auto', 'torch' or 'triton'")
    if not _flash_attn_available():
        raise ValueError("attention backend 'flash-attn' was requested but flash_attn does not import; install "
                         "flash-attn (pip install 'llmserve[gpu]') or use 'auto' or 'triton'")
    if not fits_flash:
        raise ValueError(f"the flash-attn attention backend needs a KV block size that is a multiple of "
                         f"{FLASH_ATTN_BLOCK_MULTIPLE} (flash-attn's paged KV requirement), got {block_size}; "
                         f"pass --kvcache-block-size 256 or use the 'triton' backend")


def _cpu_kernel_available() -> bool:
    from services.engine.layers.attention_backends.cpu import CpuBackend

    return CpuBackend.available()


def _flash_attn_available() -> bool:
    """flash-attn's paged functions import (a broken or CUDA-mismatched install counts as absent)."""
    return _flash_attn_imports()


@functools.cache
def _flash_attn_imports() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or an OSError / RuntimeError from a mismatched build
        return False
    return True


def supports_cuda_graphs(backend: AttentionBackend) -> bool:
    return backend.name in CUDA_GRAPH_BACKENDS


def get_backend(name: str, device: torch.device | str, block_size: int | None = None) -> AttentionBackend:
    """An attention backend instance; the Triton and flash-attn modules are imported only when chosen."""
    resolved = resolve_backend_name(name, device, block_size)
    if resolved == "torch":
        from services.engine.layers.attention_backends.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if resolved == "cpu":
        from services.engine.layers.attention_backends.cpu import CpuBackend

        return CpuBackend()
    if resolved == "triton":
        from services.engine.layers.attention_backends.triton import TritonBackend

        return TritonBackend()
    from services.engine.layers.attention_backends.flash_attn import FlashAttnBackend

    return FlashAttnBackend()
