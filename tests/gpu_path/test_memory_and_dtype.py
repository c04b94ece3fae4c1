"""GPU sizing arithmetic (CUDA graph memory included) and device/dtype defaults, on CPU."""

import pytest
import torch

from services.engine.runner import model_runner
from services.engine.runner.kv_cache import GpuMemorySnapshot, compute_num_kvcache_blocks, gpu_kv_budget_bytes
from services.engine.runner.model_runner import resolve_device, resolve_dtype

GIB = 1 << 30
MIB = 1 << 20


def _snapshot() -> GpuMemorySnapshot:
    return GpuMemorySnapshot(total_bytes=100 * GIB, used_bytes=20 * GIB, peak_bytes=12 * GIB, current_bytes=10 * GIB)


def test_graph_memory_comes_out_of_the_kv_budget():
    # 100 * 0.9 - 20 in use - 2 of activations - 1.5 of graphs = 66.5 GiB
    assert gpu_kv_budget_bytes(_snapshot(), 0.9, cuda_graph_bytes=1536 * MIB) == int(66.5 * GIB)
    with_graphs = compute_num_kvcache_blocks(GIB // 4, gpu=_snapshot(), cuda_graph_bytes=1536 * MIB)
    without = compute_num_kvcache_blocks(GIB // 4, gpu=_snapshot())
    assert (with_graphs, without) == (266, 272)


def test_graph_memory_is_ignored_when_the_size_is_explicit():
    assert compute_num_kvcache_blocks(1000, num_blocks=9, gpu=_snapshot(), cuda_graph_bytes=10**12) == 9


def test_graphs_that_leave_no_room_raise():
    with pytest.raises(ValueError, match="KV cache block"):
        compute_num_kvcache_blocks(GIB, gpu=_snapshot(), cuda_graph_bytes=70 * GIB)


def test_utilization_out_of_range_is_refused():
    for bad in (0.0, -0.5, 1.2):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            compute_num_kvcache_blocks(1000, gpu=_snapshot(), gpu_memory_utilization=bad)


def test_auto_dtype_is_bf16_on_cuda_and_fp16_without_bf16(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", cuda) == torch.float16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16


_NO_BF16 = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False}


@pytest.mark.parametrize("capabilities, expected", [
    (_NO_BF16, torch.float32),
    (_NO_BF16 | {"avx512_bf16": True}, torch.bfloat16),
    (_NO_BF16 | {"amx_bf16": True, "amx_tile": True}, torch.bfloat16),
    (_NO_BF16 | {"amx_tile": True}, torch.float32),  # AMX without its bf16 unit (int8 only)
])
def test_auto_dtype_on_cpu_follows_the_cpus_bf16_units(monkeypatch, capabilities, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(capabilities))
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32  # an explicit dtype always wins


def test_tensor_parallel_ranks_get_their_own_gpu(monkeypatch):
    monkeypatch.setattr(model_runner.torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", rank=3, tp_size=4) == torch.device("cuda", 3)
    assert resolve_device("cpu", rank=1, tp_size=2) == torch.device("cpu")
    with pytest.raises(ValueError, match="needs 8 GPUs"):
        resolve_device("cuda", rank=0, tp_size=8)
