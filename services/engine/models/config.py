"""The architecture facts our model code needs, independent of the checkpoint format."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama family, Qwen3).

    Filled by the loader from a Hugging Face config.json or from GGUF metadata. `architecture` is the
    registry key ("llama", "qwen3"). `rope_scaling` is None for plain RoPE, else a dict with at least
    "rope_type" ("linear" or "llama3") and that type's parameters.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads
