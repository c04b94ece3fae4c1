"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral-style GQA). Qwen3 reuses it with per-head q/k norms.

A leaf of the project: imports only layers/ and distributed/. Weights arrive as (Hugging Face name, full
tensor) pairs, whatever the file format; each module keeps its tensor-parallel rank's slice, and q/k/v and
gate/up are fused into merged projections.
"""

from collections.abc import Iterable

import torch
from torch import nn

from services.engine.distributed.parallel_state import get_tp_rank, get_tp_size
from services.engine.distributed.sharding import head_shard
from services.engine.layers.activation import SiluAndMul
from services.engine.layers.attention import Attention
from services.engine.layers.attention_backends.base import AttentionBackend
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.layers.embedding import LMHead, VocabEmbedding
from services.engine.layers.linear import (
    MergedColumnParallelLinear, RowParallelLinear, copy_weight, qkv_parallel_linear)
from services.engine.layers.norm import RMSNorm
from services.engine.layers.rotary import RotaryEmbedding
from services.engine.models.config import ModelConfig

# checkpoint projection name -> (our merged module name, shard index)
_MERGED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend | None,
                 qk_norm: bool):
        super().__init__()
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads, get_tp_rank(), get_tp_size())
        self.num_heads = heads.num_q  # this rank's heads
        self.num_kv_heads = heads.num_kv
        self.head_dim = config.head_dim
        self.qkv_proj = qkv_parallel_linear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                            config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear.evenly(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend | None,
                 qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, backend, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, backend: AttentionBackend | None,
                 qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One rotary table shared by every layer (not a registered submodule of each).
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [N, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """input_ids [N], positions [N], meta -> hidden [N, hidden]; compute_logits(hidden [B, hidden]) -> [B, V]."""

    qk_norm = False

    def __init__(self, config: ModelConfig, max_positions: int | None = None,
                 backend: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings, backend, self.qk_norm)
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """Every layer's Attention module, in layer order (the runner binds KV caches to them)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the model; raise if any parameter stays unset."""
        params = dict(self.named_parameters())
        pending = _expected_weight_keys(self)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head.tied):
                continue
            module_name, _, leaf = name.rpartition(".")
            parent, _, proj = module_name.rpartition(".")
            if proj in _MERGED_SHARDS:
                merged, index = _MERGED_SHARDS[proj]
                key = f"{parent}.{merged}.{leaf}#{index}"
                if key not in pending and f"{parent}.{merged}.{leaf}" not in params:
                    raise ValueError(f"checkpoint weight {name} has no place in the model")
                self.get_submodule(f"{parent}.{merged}").load_shard(index, tensor, name, is_bias=leaf == "bias")
            else:
                if name not in params:
                    raise ValueError(f"checkpoint weight {name} has no place in the model")
                key = name
                module = self.get_submodule(module_name)
                if hasattr(module, "load_param"):
                    module.load_param(leaf, tensor, name)
                else:
                    copy_weight(params[name], tensor, name)
            pending.discard(key)
        if pending:
            raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(pending)[:8])}")


def _expected_weight_keys(model: nn.Module) -> set[str]:
    """Every parameter name, with merged projections split into `name#shard` keys."""
    keys, seen = set(), set()
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{leaf}" if module_name else leaf
            if isinstance(module, MergedColumnParallelLinear):
                keys.update(f"{name}#{i}" for i in range(len(module.output_sizes)))
            else:
                keys.add(name)
    return keys
