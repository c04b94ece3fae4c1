"""GGUF conventions: tensor names, llama.cpp's q/k row permutation, and the default model's metadata."""

import numpy as np
import pytest

from services.engine.loader import gguf_file_of, load_model_config
from services.engine.loader.gguf import hf_name, unpermute_qk


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k projections (pairs the two rotary halves)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("num_heads, head_dim", [(9, 64), (3, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, head_dim):
    weight = np.random.default_rng(0).standard_normal((num_heads * head_dim, 40)).astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), weight)


def test_unpermute_matches_transformers_gguf_loader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.random.default_rng(1).standard_normal((3 * 64, 576)).astype(np.float32)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    expected = processor.process(weight, "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(unpermute_qk(weight, 3), expected)


def test_tensor_names_map_to_hugging_face_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("blk.1.ffn_gate.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight") is None


def test_default_model_config(default_model_path):
    assert gguf_file_of(default_model_path) == default_model_path
    config = load_model_config(default_model_path)
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.intermediate_size == 1536
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
