"""Command-line flags for every EngineArgs field, shared by the engine service and the benchmarks."""

import argparse
import dataclasses
import types
import typing

from services.engine.config import QUANTIZATIONS, EngineArgs

_HELP = {
    "model": "HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "max_num_seqs": "most sequences in one step and running at once",
    "max_num_batched_tokens": "most tokens computed in one step (chunked prefill beyond it)",
    "max_model_len": "longest prompt + completion (default: the model's, capped at 4096)",
    "kvcache_block_size": "tokens per KV-cache block",
    "num_kvcache_blocks": "KV-cache size in blocks (overrides the byte budget)",
    "kv_cache_memory_bytes": "KV-cache size in bytes",
    "enable_prefix_caching": "reuse KV blocks of shared prefixes",
    "device": "auto, cpu or cuda[:N]",
    "dtype": "auto (bf16 on GPU and on CPUs with AMX or AVX512-BF16, else fp32), float32, bfloat16 or float16",
    "quantization": "none; int8: weight-only int8 matmuls for calls of at most 8 rows; gguf: the same with a .gguf "
                    "model's Q4_1 tensors kept 4-bit (CPU only)",
    "attention_backend": "auto (flash-attn, else triton on GPU; torch on CPU), torch, triton or flash-attn",
    "enforce_eager": "disable CUDA graphs for decode",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "tensor_parallel_size": "GPUs to shard the model over (one process each)",
    "distributed_port": "TCP port on 127.0.0.1 where tensor-parallel processes rendezvous (0: a free one)",
    "max_waiting": "most requests waiting to be admitted, preempted ones not counted; past it RESOURCE_EXHAUSTED (0 = unbounded)",
    "seed": "seed of unseeded sampling",
}
_CHOICES = {"quantization": QUANTIZATIONS}


def _base_type(annotation) -> type:
    if isinstance(annotation, str):
        annotation = eval(annotation, {"int": int, "str": str, "float": float, "bool": bool, "None": None})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one --flag per EngineArgs field (booleans as --flag / --no-flag)."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(field.type)
        help_text = f"{_HELP.get(field.name, field.name)} (default: {field.default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=field.default, choices=_CHOICES.get(field.name),
                               help=help_text)
    return parser


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(namespace, name) for name in EngineArgs.field_names()})
