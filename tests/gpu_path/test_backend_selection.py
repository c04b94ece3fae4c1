"""Attention backend selection with flash-attn's block-size constraint, by monkeypatching importability."""

import logging

import pytest

import services.engine.layers.attention_backends.select as select
from services.engine.layers.attention_backends.select import (
    FLASH_ATTN_BLOCK_MULTIPLE, get_backend, resolve_backend_name, supports_cuda_graphs)


@pytest.fixture
def flash_installed(monkeypatch):
    monkeypatch.setattr(select, "_flash_attn_available", lambda: True)


@pytest.fixture
def flash_missing(monkeypatch):
    monkeypatch.setattr(select, "_flash_attn_available", lambda: False)


def test_auto_uses_flash_attn_on_cuda_with_a_multiple_of_256(flash_installed):
    assert resolve_backend_name("auto", "cuda", 256) == "flash-attn"
    assert resolve_backend_name("auto", "cuda:1", 512) == "flash-attn"


def test_auto_falls_back_to_triton_with_a_warning_for_other_block_sizes(flash_installed, caplog):
    with caplog.at_level(logging.WARNING, logger=select.__name__):
        assert resolve_backend_name("auto", "cuda", 16) == "triton"
    assert "multiple of 256" in caplog.text and "triton" in caplog.text


@pytest.mark.parametrize("kernel_builds, cpu_backend", [(True, "cpu"), (False, "torch")])
def test_auto_without_flash_attn_is_triton_on_cuda_and_torch_on_cpu(flash_missing, caplog, monkeypatch,
                                                                     kernel_builds, cpu_backend):
    monkeypatch.setattr(select, "_cpu_kernel_available", lambda: kernel_builds)
    with caplog.at_level(logging.WARNING, logger=select.__name__):
        assert resolve_backend_name("auto", "cuda", 16) == "triton"
    assert caplog.text == ""
    assert resolve_backend_name("auto", "cpu", 256) == cpu_backend


@pytest.mark.parametrize("kernel_builds, cpu_backend", [(True, "cpu"), (False, "torch")])
def test_auto_on_cpu_never_picks_flash_attn_even_when_installed(flash_installed, monkeypatch, kernel_builds,
                                                                cpu_backend):
    monkeypatch.setattr(select, "_cpu_kernel_available", lambda: kernel_builds)
    assert resolve_backend_name("auto", "cpu", 256) == cpu_backend


def test_explicit_flash_attn_with_a_bad_block_size_is_a_clear_error(flash_installed):
    with pytest.raises(ValueError, match="multiple of 256.*got 16"):
        resolve_backend_name("flash-attn", "cuda", 16)
    assert resolve_backend_name("flash", "cuda", 256) == "flash-attn"


def test_explicit_flash_attn_needs_cuda_and_the_package(flash_missing, monkeypatch):
    with pytest.raises(ValueError, match="does not import"):
        resolve_backend_name("flash-attn", "cuda", 256)
    monkeypatch.setattr(select, "_flash_attn_available", lambda: True)
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend_name("flash-attn", "cpu", 256)


def test_get_backend_builds_the_fallback(flash_installed, monkeypatch):
    assert get_backend("auto", "cuda", 16).name == "triton"
    monkeypatch.setattr(select, "_cpu_kernel_available", lambda: False)
    assert get_backend("auto", "cpu", 16).name == "torch"


def test_block_multiple_matches_the_flash_attn_backend_module():
    from services.engine.layers.attention_backends.flash_attn import FLASH_ATTN_PAGE_MULTIPLE

    assert FLASH_ATTN_BLOCK_MULTIPLE == FLASH_ATTN_PAGE_MULTIPLE


def test_only_graph_safe_backends_are_captured():
    assert supports_cuda_graphs(get_backend("triton", "cpu"))
    assert not supports_cuda_graphs(get_backend("torch", "cpu"))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("xformers", "cuda", 16)
