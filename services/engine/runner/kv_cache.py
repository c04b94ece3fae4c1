"""Paged KV cache: how many blocks fit (GPU memory profiling included), allocation, and binding per-layer
views to the model."""

import contextlib
from dataclasses import dataclass

import torch

from services.engine.layers.attention import Attention
from services.engine.runner.cuda_graphs import graph_batch_sizes, measure_cuda_graph_bytes
from services.engine.runner.inputs import StepInputs, dummy_prefill
from services.engine.runner.sampler import Sampler
from services.engine.runner.sampling_step import worst_case_feature_memory
from services.engine.runner.sampling_batch import worst_case_sampling_batch

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class GpuMemorySnapshot:
    """Device memory after a profiling forward at full batch size.

    used_bytes: total - free as the driver reports it (every process, our weights included).
    peak_bytes / current_bytes: torch's allocated peak during profiling and allocation now; the
    difference is the activation memory a real step needs on top of what is held now.
    """

    total_bytes: int
    used_bytes: int
    peak_bytes: int
    current_bytes: int


def kv_cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype_size: int) -> int:
    """Bytes of one block across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size


def read_gpu_memory(device: torch.device) -> GpuMemorySnapshot:
    """The driver's and torch's view of device memory now (call after a profiling step, cache emptied)."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return GpuMemorySnapshot(total_bytes=total, used_bytes=total - free,
                             peak_bytes=stats["allocated_bytes.all.peak"],
                             current_bytes=stats["allocated_bytes.all.current"])


def gpu_kv_budget_bytes(gpu: GpuMemorySnapshot, gpu_memory_utilization: float, cuda_graph_bytes: int = 0) -> int:
    """total * utilization - used - (peak - current) - CUDA graph memory: what the utilization target leaves
    for the KV cache once everything in use now, the activations of a full step and the captured decode
    graphs (their memory pools and static buffers, captured after the cache exists) are accounted for."""
    activations = max(0, gpu.peak_bytes - gpu.current_bytes)
    return int(gpu.total_bytes * gpu_memory_utilization) - gpu.used_bytes - activations - cuda_graph_bytes


def compute_num_kvcache_blocks(block_bytes: int, *, num_blocks: int | None = None,
                               memory_bytes: int | None = None, gpu: GpuMemorySnapshot | None = None,
                               gpu_memory_utilization: float = 0.9, cuda_graph_bytes: int = 0,
                               cpu_default_bytes: int = CPU_DEFAULT_KV_CACHE_BYTES) -> int:
    """Number of KV blocks: explicit count, else explicit bytes, else GPU headroom (gpu_kv_budget_bytes),
    else the CPU default."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if num_blocks is not None:
        result = num_blocks
    elif memory_bytes is not None:
        result = memory_bytes // block_bytes
    elif gpu is not None:
        result = gpu_kv_budget_bytes(gpu, gpu_memory_utilization, cuda_graph_bytes) // block_bytes
    else:
        result = cpu_default_bytes // block_bytes
    if result < 1:
        raise ValueError(f"no room for a single KV cache block ({block_bytes} bytes); lower the model size, "
                         f"raise gpu_memory_utilization or pass num_kvcache_blocks")
    return result


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, Hkv, D], zeroed so padded reads never see NaNs."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def bind_kv_cache(layers: list[Attention], kv_cache: torch.Tensor) -> None:
    """Give each attention layer its views: layer i gets kv_cache[i, 0] (K) and kv_cache[i, 1] (V)."""
    if len(layers) != kv_cache.shape[0]:
        raise ValueError(f"{len(layers)} attention layers but a cache for {kv_cache.shape[0]}")
    for i, layer in enumerate(layers):
        layer.k_cache = kv_cache[i, 0]
        layer.v_cache = kv_cache[i, 1]


@contextlib.contextmanager
def unbound_kv_cache(layers: list[Attention]):
    """Layers without a cache for the duration (nothing is stored; prefill reads the new K/V only)."""
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    try:
        yield
    finally:
        for layer, (k_cache, v_cache) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k_cache, v_cache


def size_kv_cache(runner, use_graphs: bool) -> int:
    """KV blocks for a ModelRunner whose model is loaded and whose cache is not allocated yet.

    On CUDA without an explicit size: profile a full prefill and a full decode step (with sampling), and,
    when CUDA graphs will be captured, measure their memory, both against a one-block temporary cache.
    """
    layers = runner.model.attention_layers()
    args = runner.args
    block_bytes = kv_cache_block_bytes(len(layers), runner.block_size, layers[0].num_kv_heads, layers[0].head_dim,
                                       runner.dtype.itemsize)
    gpu, graph_bytes = None, 0
    if runner.device.type == "cuda" and args.num_kvcache_blocks is None and args.kv_cache_memory_bytes is None:
        temporary = allocate_kv_cache(len(layers), 1, runner.block_size, layers[0].num_kv_heads,
                                      layers[0].head_dim, runner.dtype, runner.device)
        bind_kv_cache(layers, temporary)
        with torch.inference_mode():
            gpu = profile_gpu_memory(runner)
            if use_graphs:
                graph_bytes = measure_cuda_graph_bytes(runner.model, graph_batch_sizes(args.max_num_seqs),
                                                       runner.max_blocks_per_seq, runner.block_size, runner.device)
        for layer in layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        del temporary
        torch.cuda.empty_cache()
    return compute_num_kvcache_blocks(
        block_bytes, num_blocks=args.num_kvcache_blocks, memory_bytes=args.kv_cache_memory_bytes, gpu=gpu,
        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graph_bytes=graph_bytes)


def dummy_decode(num_seqs: int) -> StepInputs:
    """A decode step of num_seqs rows that each store to and read slot 0 of block 0 (profiling)."""
    return StepInputs(False, torch.zeros(3, num_seqs, dtype=torch.int64), torch.zeros(num_seqs, 1, dtype=torch.int32),
                      [1] * num_seqs, list(range(num_seqs)), context_lens=torch.ones(num_seqs, dtype=torch.int32))


def profile_gpu_memory(runner) -> GpuMemorySnapshot:
    """Peak activations of the largest steps the scheduler can issue: a prefill of max_num_batched_tokens
    (no cache) and a decode of max_num_seqs rows with every sampling filter on (one-block cache bound), with room
    for logprobs and penalty state on every row."""
    device, args = runner.device, runner.args
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(args.max_num_batched_tokens, args.max_num_seqs * runner.max_model_len)
    with unbound_kv_cache(runner.model.attention_layers()):
        runner.compute_logits(dummy_prefill(num_tokens, runner.max_model_len))
    logits = runner.compute_logits(dummy_decode(args.max_num_seqs))  # [max_num_seqs, V]
    features = worst_case_feature_memory(args.max_num_seqs, runner.vocab_size, device)  # logprobs, penalties
    Sampler(0, device).sample(logits, worst_case_sampling_batch(args.max_num_seqs, runner.vocab_size, device))
    del logits, features
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return read_gpu_memory(device)
