"""`--quantization int8` end to end: every projection and the LM head get an int8 copy that decode steps use,
and the embedded model's greedy output agrees with fp32 except at near-ties.

int8 re-quantizes weights that are already 4-bit (the embedded GGUF is Q4_1) per output row and runs the
matmul on bf16 activations, so it moves logits more than bf16 alone: on the embedded model, one prompt at a
time (decode steps of 1 row, all int8), 5 of 9 prompts swapped a token within 32, at fp32 margins of
0.018-0.257 nats, and 70% of all positions agreed. A wrong int8 path (a lost scale, a transposed or
mis-sliced weight) turns the output into noise, and it parts from fp32 where fp32 was sure.
"""

import pytest

from services.engine import LLM, SamplingParams
from services.engine.layers.quantization import QUANTIZED_MAX_ROWS, Int8Weight
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

NEAR_TIE_NATS = 0.5  # about 2x the largest fp32 margin at which an int8 swap was seen (0.257)
MAX_TOKENS = 32


def _int8_copies(llm: LLM) -> dict[str, Int8Weight]:
    return {name: module.quantized for name, module in llm.runner.model.named_modules()
            if getattr(module, "quantized", None) is not None}


@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_every_projection_and_the_lm_head_decode_through_int8(case, tmp_path):
    kind, overrides = CASES[case]
    build_checkpoint(kind, overrides, tmp_path)
    llm = LLM(str(tmp_path), num_kvcache_blocks=64, kvcache_block_size=16, dtype="float32", quantization="int8")
    copies = _int8_copies(llm)
    layers = llm.runner.model_config.num_hidden_layers
    assert len(copies) == 4 * layers + 1 and "lm_head" in copies  # qkv, o, gate/up, down per layer
    assert not _int8_copies(LLM(str(tmp_path), num_kvcache_blocks=64, kvcache_block_size=16, dtype="float32"))
    # A 20-token prompt (prefill over the cut-over: full weights but the LM head's one row), then 4 decode steps.
    llm.generate([list(range(3, 23))], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    assert {name: q.calls for name, q in copies.items()} == {name: 4 if name != "lm_head" else 5 for name in copies}
    assert 20 > QUANTIZED_MAX_ROWS


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.slow
def test_int8_greedy_agrees_with_fp32_except_at_near_ties(default_llm, default_prompt_ids):
    int8_llm = LLM(num_kvcache_blocks=256, kvcache_block_size=16, dtype="float32", quantization="int8",
                   max_num_seqs=1)  # one prompt at a time: every decode step runs int8
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, num_logprobs=20)
    fp32 = default_llm.generate(default_prompt_ids, greedy, use_tqdm=False)
    int8 = int8_llm.generate(default_prompt_ids, greedy, use_tqdm=False)
    assert all(q.calls >= MAX_TOKENS - 1 for q in _int8_copies(int8_llm).values())
    swaps, agreed = [], 0
    for ours, theirs in zip(fp32, int8):
        position = _first_difference(ours["token_ids"], theirs["token_ids"])
        if position is None:
            assert len(ours["token_ids"]) == len(theirs["token_ids"])
            agreed += len(ours["token_ids"])
            continue
        agreed += position
        at = ours["logprobs"][position]  # fp32's view of the position where they part, same prefix so far
        alternatives = dict(zip(at.top_token_ids, at.top_logprobs))
        margin = at.logprob - alternatives.get(theirs["token_ids"][position], float("-inf"))
        swaps.append((position, margin))
    assert all(margin < NEAR_TIE_NATS for _, margin in swaps), swaps
    assert agreed >= 0.5 * sum(len(o["token_ids"]) for o in fp32), (agreed, swaps)
