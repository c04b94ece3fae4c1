"""Choose an attention backend by name for a device."""

import importlib.util

import torch

from services.engine.layers.attention_backends.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flash-attn")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """"auto" -> flash-attn if importable on CUDA, else triton on CUDA, else torch."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "torch"
    if _flash_attn_available():
        return "flash-attn"
    return "triton"


def _flash_attn_available() -> bool:
    """flash-attn is installed and we have a backend module wrapping it."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    return importlib.util.find_spec(f"{__package__}.flash_attn") is not None


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """An attention backend instance; the Triton and flash-attn modules are imported only when chosen."""
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from services.engine.layers.attention_backends.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if resolved == "triton":
        from services.engine.layers.attention_backends.triton import TritonBackend

        return TritonBackend()
    from services.engine.layers.attention_backends.flash_attn import FlashAttnBackend

    return FlashAttnBackend()
