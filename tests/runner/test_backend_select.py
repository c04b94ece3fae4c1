"""Attention backend selection by name and device."""

import pytest

from services.engine.layers.attention_backends.select import get_backend, resolve_backend_name
from services.engine.layers.attention_backends.torch_ref import TorchRefBackend


def test_auto_on_cpu_is_the_compiled_kernel_backend_when_it_builds(monkeypatch):
    import services.engine.layers.attention_backends.select as select

    monkeypatch.setattr(select, "_cpu_kernel_available", lambda: True)
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert get_backend("auto", "cpu").name == "cpu"


def test_auto_on_cpu_falls_back_to_the_torch_reference_without_a_compiler(monkeypatch):
    import services.engine.layers.attention_backends.select as select

    monkeypatch.setattr(select, "_cpu_kernel_available", lambda: False)
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert isinstance(get_backend("auto", "cpu"), TorchRefBackend)


def test_auto_on_cuda_prefers_flash_attn_then_triton(monkeypatch):
    import services.engine.layers.attention_backends.select as select

    monkeypatch.setattr(select, "_flash_attn_available", lambda: True)
    assert resolve_backend_name("auto", "cuda") == "flash-attn"
    monkeypatch.setattr(select, "_flash_attn_available", lambda: False)
    assert resolve_backend_name("auto", "cuda") == "triton"


def test_explicit_names_are_kept_and_unknown_ones_refused():
    assert resolve_backend_name("triton", "cpu") == "triton"
    assert get_backend("torch", "cuda").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("xformers", "cpu")
