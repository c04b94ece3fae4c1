"""A tiny random-weight Llama built in memory (no checkpoint) for runner-level tests."""

import torch

from services.engine.layers.attention_backends.base import AttentionBackend
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM

TINY_CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=64)


def tiny_llama(backend: AttentionBackend, seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(TINY_CONFIG, backend=backend).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model
