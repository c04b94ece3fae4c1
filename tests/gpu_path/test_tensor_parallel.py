"""Tensor parallelism on CPU: two gloo processes (rank 0 here, rank 1 spawned) run a tiny random checkpoint
and match the unsharded engine: the same greedy tokens, and logits within fp32 tolerance."""

import socket

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.core.interfaces import SchedulerOutput
from services.engine.distributed import parallel_state
from services.engine.distributed.worker import free_port
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint
from tests.runner.helpers import make_seq

TP_CASES = {
    "llama-kv-heads-split": CASES["llama"],
    "llama-kv-head-replicated-odd-vocab": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                                         vocab_size=509, tie_word_embeddings=True)),
    "qwen3-qk-norm": CASES["qwen3"],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
ENGINE = dict(num_kvcache_blocks=64, kvcache_block_size=16, device="cpu", dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module", params=list(TP_CASES))
def engines(request, tmp_path_factory):
    kind, overrides = TP_CASES[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    build_checkpoint(kind, overrides, directory)
    single = LLM(directory, **ENGINE)
    sharded = LLM(directory, tensor_parallel_size=2, distributed_port=free_port(), max_num_batched_tokens=24,
                  **ENGINE)  # an explicit port (the default, a free one at launch: test_tp_rendezvous.py)
    yield single, sharded
    workers = list(sharded.runner._workers)
    sharded.shutdown()
    assert not any(w.is_alive() for w in workers) and parallel_state.get_group_size() == 1


def test_an_explicit_distributed_port_is_where_the_group_meets(engines):
    _, sharded = engines
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", sharded.runner.args.distributed_port))  # held by rank 0's rendezvous


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (5, 23, 40)]


def test_sharded_model_holds_half_of_each_layer(engines):
    single, sharded = engines
    assert parallel_state.get_group_size() == 2 and parallel_state.get_tp_size() == 1
    attn_1 = single.runner.model.attention_layers()[0]
    attn_2 = sharded.runner.model.attention_layers()[0]
    assert attn_2.num_heads * 2 == attn_1.num_heads
    assert attn_2.num_kv_heads == max(1, attn_1.num_kv_heads // 2)
    assert sharded.runner.kv_cache.shape[-2] == attn_2.num_kv_heads


def test_greedy_tokens_equal_the_unsharded_engine(engines):
    single, sharded = engines
    prompts = _prompts(single.runner.vocab_size)
    expected = [o["token_ids"] for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o["token_ids"] for o in sharded.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected


def test_prefill_and_decode_logits_match_within_fp32_tolerance(engines):
    single, sharded = engines
    prompt = _prompts(single.runner.vocab_size)[2]
    steps = []
    for llm in (single, sharded):
        seq = make_seq(0, prompt, [5, 9, 2])
        prefill, _ = llm.runner.logits(SchedulerOutput([seq], is_prefill=True))
        seq.num_cached_tokens = len(prompt)
        seq.token_ids.append(int(prefill[0].argmax()))
        seq.num_scheduled_tokens = 1
        decode, _ = llm.runner.logits(SchedulerOutput([seq], is_prefill=False))
        steps.append((prefill, decode))
    (prefill_1, decode_1), (prefill_2, decode_2) = steps
    assert prefill_2.shape == (1, single.runner.vocab_size)
    torch.testing.assert_close(prefill_2, prefill_1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_2, decode_1, rtol=1e-4, atol=1e-4)


def test_a_single_rank_engine_never_calls_torch_distributed(tmp_path, monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed used at tensor_parallel_size 1")

    for name in ("init_process_group", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast_object_list",
                 "new_group"):
        monkeypatch.setattr(dist, name, refuse)
    kind, overrides = TP_CASES["llama-kv-heads-split"]
    build_checkpoint(kind, overrides, tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 16
    llm.shutdown()


def test_a_model_that_cannot_be_split_fails_before_any_worker_starts(tmp_path):
    import multiprocessing

    kind, overrides = TP_CASES["llama-kv-heads-split"]  # 4 query heads, 2 KV heads
    build_checkpoint(kind, overrides, tmp_path)
    before = set(multiprocessing.active_children())  # the module's TP=2 engine may be alive
    group_size = parallel_state.get_group_size()
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 3"):
        LLM(str(tmp_path), tensor_parallel_size=3, distributed_port=free_port(), **ENGINE)
    assert set(multiprocessing.active_children()) == before and parallel_state.get_group_size() == group_size
