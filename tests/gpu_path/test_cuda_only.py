"""Checks that need a GPU (skipped on CPU; bench/gpu_check.sh runs them there): no host sync inside a step
before the sampled ids are read, CUDA-graph replay equal to eager decode, and memory-based KV sizing."""

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.core.interfaces import SchedulerOutput
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint
from tests.runner.helpers import make_seq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SAMPLED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
           SamplingParams(temperature=1.0, seed=7)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tiny-gpu"))
    kind, overrides = CASES["llama-3kv-heads-dim24"]
    build_checkpoint(kind, overrides, directory)
    return directory


@pytest.fixture(scope="module")
def graph_llm(checkpoint) -> LLM:
    # fp32: graph replay (padded batch, full-width block tables) plans its split-K decode differently from
    # eager, so only the summation order differs; in bf16 that could flip a near-tie.
    return LLM(checkpoint, device="cuda", dtype="float32", max_num_seqs=4, num_kvcache_blocks=64,
               enable_prefix_caching=False)


def _seqs(num_seqs: int, prompt_len: int) -> list:
    return [make_seq(i, [(5 * i + t) % 400 + 3 for t in range(prompt_len)], [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3],
                     sampling=SAMPLED[i % len(SAMPLED)]) for i in range(num_seqs)]


def _step_without_sync(llm: LLM, batch: SchedulerOutput) -> torch.Tensor:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids, _ = llm.runner.sample_on_device(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return token_ids


@pytest.mark.parametrize("num_seqs", [3, 6])  # 3 decodes by graph replay (padded to 4); 6 runs eagerly
def test_prefill_and_decode_steps_do_not_sync_before_reading_ids(graph_llm, num_seqs):
    seqs = _seqs(num_seqs, 20)
    prefill_ids = _step_without_sync(graph_llm, SchedulerOutput(seqs, is_prefill=True))
    for seq, token_id in zip(seqs, prefill_ids.tolist()):
        seq.num_cached_tokens, seq.num_scheduled_tokens = seq.num_tokens, 1
        seq.token_ids.append(token_id)
    decode_ids = _step_without_sync(graph_llm, SchedulerOutput(seqs, is_prefill=False))
    assert decode_ids.shape == (num_seqs,) and decode_ids.is_cuda


def test_graph_replay_gives_the_eager_greedy_tokens(checkpoint, graph_llm):
    assert graph_llm.runner.graphs is not None and graph_llm.runner.graphs.sizes == [1, 2, 4]
    eager = LLM(checkpoint, device="cuda", dtype="float32", max_num_seqs=4, num_kvcache_blocks=64,
                enforce_eager=True)
    assert eager.runner.graphs is None
    prompts = [[(3 * i + n) % 400 + 3 for i in range(n)] for n in (5, 23, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17)]
    assert [o["token_ids"] for o in graph_llm.generate(prompts, params, use_tqdm=False)] == \
        [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]


def test_kv_cache_is_sized_from_free_memory_with_graphs_counted(checkpoint):
    llm = LLM(checkpoint, device="cuda", max_num_seqs=64, gpu_memory_utilization=0.2)
    free, total = torch.cuda.mem_get_info()
    assert llm.runner.dtype == torch.bfloat16 and llm.runner.graphs is not None
    assert llm.runner.num_kvcache_blocks > 64
    assert total - free <= 0.2 * total + (256 << 20), "the engine stays near its utilization target"
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4
