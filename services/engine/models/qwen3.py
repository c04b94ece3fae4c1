"""Qwen3 decoder: the Llama layout plus an RMSNorm over each head of q and k before the rotary embedding."""

from services.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same forward contract as LlamaForCausalLM; head_dim comes from the config, not hidden / heads."""

    qk_norm = True
