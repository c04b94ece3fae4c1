"""The model runner: loads the model, owns the paged KV cache, runs one step and samples."""

import contextlib
import logging

import torch

from services.engine.config import EngineArgs
from services.engine.core.interfaces import SchedulerOutput
from services.engine.default_model import resolve_model_path
from services.engine.layers.attention_backends.select import get_backend
from services.engine.loader import load_model_config, load_weights
from services.engine.models.registry import get_model_class
from services.engine.runner.inputs import dummy_prefill, prepare_decode, prepare_prefill
from services.engine.runner.kv_cache import (
    GpuMemorySnapshot, allocate_kv_cache, bind_kv_cache, compute_num_kvcache_blocks, kv_cache_block_bytes)
from services.engine.runner.sampler import Sampler, make_sampling_batch

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": fp32 on CPU, bf16 on CUDA (fp16 where bf16 is unsupported)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    """core.interfaces.ModelRunner over a real model: `execute(batch)` -> one sampled id (or None) per sequence.

    Exposes what the engine core needs to be built: num_kvcache_blocks, max_model_len, vocab_size,
    eos_token_ids (from the checkpoint's config / generation config; the tokenizer's are added by the caller).
    """

    def __init__(self, args: EngineArgs, share_model_with: "ModelRunner | None" = None):
        """Load the model named by args, or reuse the already loaded model of `share_model_with` (same
        checkpoint, device and dtype) with a KV cache of this runner's own."""
        if args.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size other than 1 is not supported yet")
        self.args = args
        if share_model_with is None:
            self._load_model(args)
        else:
            self._share_model(share_model_with)
        self.sampler = Sampler(args.seed, self.device)
        self.num_kvcache_blocks = self._size_kv_cache()
        config = self.model_config
        self.kv_cache = allocate_kv_cache(
            config.num_hidden_layers, self.num_kvcache_blocks, self.block_size, config.num_key_value_heads,
            config.head_dim, self.dtype, self.device)  # [L, 2, num_blocks, block_size, Hkv, D]
        self._attention_layers = self.model.attention_layers()
        bind_kv_cache(self._attention_layers, self.kv_cache)
        logger.info("model %s (%s) on %s/%s, attention %s, %d KV blocks of %d tokens",
                    self.model_path, config.architecture, self.device, self.dtype, self.attention_backend.name,
                    self.num_kvcache_blocks, self.block_size)

    def _load_model(self, args: EngineArgs) -> None:
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.block_size = args.kvcache_block_size
        self.model_path = resolve_model_path(args.model)
        self.model_config = load_model_config(self.model_path)
        self.max_model_len = self._resolve_max_model_len(args.max_model_len)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.attention_backend = get_backend(args.attention_backend, self.device)
        model_class = get_model_class(self.model_config)
        with _default_dtype(self.dtype), self.device:
            self.model = model_class(self.model_config, max_positions=self.max_model_len,
                                     backend=self.attention_backend)
        load_weights(self.model, self.model_path)
        self.model.eval()

    def _share_model(self, other: "ModelRunner") -> None:
        for name in ("device", "dtype", "block_size", "model_path", "model_config", "max_model_len", "vocab_size",
                     "eos_token_ids", "attention_backend", "model"):
            setattr(self, name, getattr(other, name))

    def _resolve_max_model_len(self, requested: int | None) -> int:
        model_max = self.model_config.max_position_embeddings
        if requested is None:
            return min(model_max, DEFAULT_MAX_MODEL_LEN)
        if not 0 < requested <= model_max:
            raise ValueError(f"max_model_len {requested} must be in [1, {model_max}] for this model")
        return requested

    def _size_kv_cache(self) -> int:
        config = self.model_config
        block_bytes = kv_cache_block_bytes(config.num_hidden_layers, self.block_size, config.num_key_value_heads,
                                           config.head_dim, self.dtype.itemsize)
        gpu = None
        if self.device.type == "cuda" and self.args.num_kvcache_blocks is None \
                and self.args.kv_cache_memory_bytes is None:
            gpu = self._profile_gpu_memory()
        return compute_num_kvcache_blocks(
            block_bytes, num_blocks=self.args.num_kvcache_blocks, memory_bytes=self.args.kv_cache_memory_bytes,
            gpu=gpu, gpu_memory_utilization=self.args.gpu_memory_utilization)

    @torch.inference_mode()
    def _profile_gpu_memory(self) -> GpuMemorySnapshot:
        """Run a cache-less prefill at the full token budget and read the memory it needed."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.args.max_num_batched_tokens, self.args.max_num_seqs * self.max_model_len)
        inputs = dummy_prefill(num_tokens, self.max_model_len, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        num_rows = min(self.args.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_rows]).float()
        torch.cuda.synchronize(self.device)
        del hidden
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        return GpuMemorySnapshot(total_bytes=total, used_bytes=total - free,
                                 peak_bytes=stats["allocated_bytes.all.peak"],
                                 current_bytes=stats["allocated_bytes.all.current"])

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Compute the batch's tokens, then sample for each sequence whose whole token list is computed."""
        seqs = batch.seqs
        if not seqs:
            return []
        if self._attention_layers[0].k_cache.data_ptr() != self.kv_cache.data_ptr():
            bind_kv_cache(self._attention_layers, self.kv_cache)  # another runner shares this model
        prepare = prepare_prefill if batch.is_prefill else prepare_decode
        inputs = prepare(seqs, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [N, hidden]
        results: list[int | None] = [None] * len(seqs)
        if not inputs.sample_seq_indices:
            return results
        if batch.is_prefill:
            hidden = hidden.index_select(0, inputs.logits_indices)  # [S, hidden]
        logits = self.model.compute_logits(hidden)  # [S, V]
        sampled_seqs = [seqs[i] for i in inputs.sample_seq_indices]
        token_ids = self.sampler(logits, make_sampling_batch(sampled_seqs, self.vocab_size, self.device))
        for i, token_id in zip(inputs.sample_seq_indices, token_ids):
            results[i] = token_id
        return results
