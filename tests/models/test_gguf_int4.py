"""`--quantization gguf`: the embedded GGUF's Q4_1 projections read from the file's bytes into torch's int4 pack.

The bytes decode to exactly what gguf's own dequantizer gives; the kernel multiplies by those weights up to the
bf16 rounding of each group's scale and zero; every per-layer projection of the embedded model is int4 and the
LM head (Q8_0 in the file) int8; greedy output agrees with fp32 except at near-ties. Measured on the embedded
model one prompt at a time: 5 of 9 prompts swapped a token within 32, at fp32 margins of 0.018-0.205 nats,
78% of positions agreed (int8: 0.018-0.257, 70%).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from services.engine import LLM, SamplingParams
from services.engine.layers.quantization import QUANTIZED_MAX_ROWS, Int4Weight, Int8Weight, linear
from services.engine.loader import open_gguf
from services.engine.loader.gguf_int4 import q4_1_parts
from tests.models.test_int8_agreement import NEAR_TIE_NATS, _first_difference

MAX_TOKENS = 32


def _q4_1_tensor(default_model_path, name: str):
    tensor = next(t for t in open_gguf(default_model_path).tensors if t.name == name)
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1
    return tensor


def test_q4_1_bytes_decode_to_gguf_dequantized_weights(default_model_path):
    tensor = _q4_1_tensor(default_model_path, "blk.3.ffn_down.weight")
    cols, rows = (int(n) for n in tensor.shape)
    q, d, m = q4_1_parts(tensor.data, rows, cols)
    assert q.shape == (rows, cols) and q.max() <= 15 and d.shape == m.shape == (rows, cols // 32)
    ours = np.repeat(d, 32, axis=1) * q + np.repeat(m, 32, axis=1)
    np.testing.assert_array_equal(ours, dequantize(tensor.data, tensor.tensor_type))


def test_int4_weight_multiplies_by_the_files_weights(default_model_path):
    tensor = _q4_1_tensor(default_model_path, "blk.0.attn_q.weight")
    cols, rows = (int(n) for n in tensor.shape)
    q, d, m = (torch.from_numpy(part) for part in q4_1_parts(tensor.data, rows, cols))
    int4 = Int4Weight(q, d, m)
    # Scale and zero (= m + 8d) rounded to bf16: the weight the kernel uses.
    scale = d.bfloat16().float().repeat_interleave(32, dim=1)
    zero = (m + 8 * d).bfloat16().float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(int4.dequantized(), (q.float() - 8) * scale + zero, rtol=0, atol=1e-6)
    full = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))  # [N, K]
    x = torch.randn(QUANTIZED_MAX_ROWS, cols, generator=torch.Generator().manual_seed(0))
    expected = (x.bfloat16().float() @ int4.dequantized().T).bfloat16().float()
    torch.testing.assert_close(linear(x, full, None, int4), expected, rtol=2 ** -7, atol=1e-5)
    over = torch.randn(QUANTIZED_MAX_ROWS + 1, cols)
    assert torch.equal(linear(over, full, None, int4), torch.nn.functional.linear(over, full))
    assert int4.calls == 1


def test_gguf_needs_a_gguf_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model"):
        LLM(str(tmp_path), device="cpu", quantization="gguf")


@pytest.mark.slow
def test_gguf_greedy_agrees_with_fp32_except_at_near_ties(default_llm, default_prompt_ids):
    gguf_llm = LLM(num_kvcache_blocks=256, kvcache_block_size=16, dtype="float32", quantization="gguf",
                   max_num_seqs=1)  # one prompt at a time: every decode step runs the quantized kernels
    copies = {name: m.quantized for name, m in gguf_llm.runner.model.named_modules() if getattr(m, "quantized", None)}
    assert isinstance(copies.pop("lm_head"), Int8Weight)
    layers = gguf_llm.runner.model_config.num_hidden_layers
    assert len(copies) == 4 * layers and all(isinstance(q, Int4Weight) for q in copies.values())
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, num_logprobs=20)
    fp32 = default_llm.generate(default_prompt_ids, greedy, use_tqdm=False)
    ours = gguf_llm.generate(default_prompt_ids, greedy, use_tqdm=False)
    assert all(q.calls >= MAX_TOKENS - 1 for q in copies.values())
    swaps, agreed = [], 0
    for reference, output in zip(fp32, ours):
        position = _first_difference(reference["token_ids"], output["token_ids"])
        if position is None:
            agreed += len(reference["token_ids"])
            continue
        agreed += position
        at = reference["logprobs"][position]
        margin = at.logprob - dict(zip(at.top_token_ids, at.top_logprobs)).get(output["token_ids"][position],
                                                                               float("-inf"))
        swaps.append((position, margin))
    assert all(margin < NEAR_TIE_NATS for _, margin in swaps), swaps
    assert agreed >= 0.5 * sum(len(r["token_ids"]) for r in fp32), (agreed, swaps)
