"""Tensor-parallel partition arithmetic, and each sharded layer's slice of a full checkpoint tensor: the
ranks' slices, put back together the way the collectives do, give the unsharded layer's output."""

import pytest
import torch

from services.engine.distributed.parallel_state import get_tp_size, tensor_parallel_layout
from services.engine.distributed.sharding import (
    HeadShard, check_tensor_parallel, even_shard, head_shard, vocab_shard)
from services.engine.layers.embedding import LMHead, VocabEmbedding
from services.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, qkv_parallel_linear


def test_even_shards_and_clear_errors():
    assert [even_shard(12, r, 3, "x") for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel(8, 8, 30, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(9, 3, 64, 2)


def test_kv_heads_split_when_enough_and_replicate_when_fewer_than_ranks():
    assert [head_shard(8, 4, r, 2) for r in range(2)] == [HeadShard(0, 4, 0, 2), HeadShard(4, 4, 2, 2)]
    # 2 KV heads over 4 ranks: ranks 0, 1 hold KV head 0 and ranks 2, 3 KV head 1, matching their q heads.
    shards = [head_shard(8, 2, r, 4) for r in range(4)]
    assert [(s.first_q, s.num_q, s.first_kv, s.num_kv) for s in shards] == \
        [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    group = 8 // 2
    assert all(s.first_q // group == s.first_kv == (s.first_q + s.num_q - 1) // group for s in shards)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        head_shard(12, 3, 0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        head_shard(12, 3, 0, 2)


def test_vocab_shards_are_padded_equal_blocks():
    shards = [vocab_shard(10, r, 4) for r in range(4)]
    assert [(s.start, s.end, s.padded_size) for s in shards] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
    assert vocab_shard(2, 3, 4).num_valid == 0


def _per_rank(size: int, build):
    modules = []
    for rank in range(size):
        with tensor_parallel_layout(rank, size):
            modules.append(build())
    assert get_tp_size() == 1
    return modules


def test_qkv_then_row_parallel_equals_the_full_projections():
    torch.manual_seed(0)
    hidden, head_dim, num_heads, num_kv_heads = 16, 4, 4, 1  # one KV head, replicated on both ranks
    q, k, v = torch.randn(16, hidden), torch.randn(4, hidden), torch.randn(4, hidden)
    o = torch.randn(hidden, 16)
    x = torch.randn(3, hidden)
    parts = []
    for qkv, o_proj in zip(_per_rank(2, lambda: qkv_parallel_linear(hidden, head_dim, num_heads, num_kv_heads)),
                           _per_rank(2, lambda: RowParallelLinear(16, hidden))):
        for index, weight in enumerate((q, k, v)):
            qkv.load_shard(index, weight, "qkv")
        o_proj.load_param("weight", o, "o_proj.weight")
        q_local, k_local, v_local = qkv.split(qkv(x))
        assert q_local.shape == (3, 8) and k_local.shape == (3, 4)
        torch.testing.assert_close(k_local, x @ k.T)
        parts.append(torch.nn.functional.linear(q_local, o_proj.weight))
    torch.testing.assert_close(sum(parts), (x @ q.T) @ o.T)


def test_gate_up_is_split_per_projection():
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for rank, layer in enumerate(_per_rank(2, lambda: MergedColumnParallelLinear.evenly(4, [8, 8]))):
        layer.load_shard(0, gate, "gate")
        layer.load_shard(1, up, "up")
        assert torch.equal(layer.weight, torch.cat([gate[4 * rank:4 * rank + 4], up[4 * rank:4 * rank + 4]]))


def test_vocab_parallel_embedding_and_head_cover_every_row_once():
    vocab, hidden = 11, 6
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 10, 7])
    embeddings = _per_rank(3, lambda: VocabEmbedding(vocab, hidden))
    heads = [LMHead(vocab, hidden, tied_to=e) for e in embeddings]
    for embedding in embeddings:
        embedding.load_param("weight", table, "embed")
    partial = []
    for embedding in embeddings:
        local = ids - embedding.shard.start
        here = (local >= 0) & (local < embedding.shard.num_valid)
        partial.append(embedding.weight[local.clamp(0, embedding.weight.shape[0] - 1)] * here[:, None])
    torch.testing.assert_close(sum(partial), table[ids])
    hidden_states = torch.randn(2, hidden)
    gathered = torch.cat([hidden_states @ h.weight.T for h in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(gathered, hidden_states @ table.T)
    assert heads[2].shard.num_valid == 3 and heads[2].weight[3:].eq(0).all(), "padding rows stay zero"


def test_a_checkpoint_of_the_wrong_shape_is_refused():
    (layer,) = _per_rank(1, lambda: RowParallelLinear(8, 4))
    with pytest.raises(ValueError, match="columns"):
        layer.load_param("weight", torch.randn(4, 6), "down_proj.weight")
