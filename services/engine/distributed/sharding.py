"""Partition arithmetic of tensor parallelism (pure: no torch.distributed).

Column-parallel projections split their output rows evenly across ranks; row-parallel ones split their
input columns. Query heads split evenly; KV heads split evenly when there are at least as many as
ranks, else each KV head is replicated on tp_size // num_kv_heads consecutive ranks. The vocabulary is
split into equal, padded shards (the last may hold padding rows).
"""

from dataclasses import dataclass


def divide(total: int, parts: int, what: str) -> int:
    """total / parts; ValueError naming `what` when it does not divide evenly."""
    if parts < 1 or total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {parts}")
    return total // parts


def even_shard(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, end) of rank's equal share of `total` rows."""
    shard = divide(total, size, what)
    return rank * shard, (rank + 1) * shard


@dataclass(slots=True, frozen=True)
class HeadShard:
    """The heads one rank holds: query heads [first_q, first_q + num_q), KV heads [first_kv, first_kv + num_kv)."""

    first_q: int
    num_q: int
    first_kv: int
    num_kv: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Query heads split evenly; KV heads split evenly, or replicated when num_kv_heads < size."""
    num_q = divide(num_heads, size, "num_attention_heads")
    if num_kv_heads >= size:
        num_kv = divide(num_kv_heads, size, "num_key_value_heads")
        return HeadShard(rank * num_q, num_q, rank * num_kv, num_kv)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is neither a divisor nor a multiple of "
                         f"num_key_value_heads {num_kv_heads}")
    # NOTE: rank r's query heads all map to KV head r * Hkv // tp, since tp / Hkv ranks share each KV head.
    return HeadShard(rank * num_q, num_q, rank * num_kv_heads // size, 1)


@dataclass(slots=True, frozen=True)
class VocabShard:
    """Rows [start, end) of the vocabulary held by one rank, in a shard of padded_size rows."""

    start: int
    end: int
    padded_size: int

    @property
    def num_valid(self) -> int:
        return self.end - self.start


def vocab_shard(vocab_size: int, rank: int, size: int) -> VocabShard:
    """Equal shards of ceil(vocab / size) rows; the tail rows past vocab_size are padding."""
    padded = -(-vocab_size // size)
    start = min(rank * padded, vocab_size)
    return VocabShard(start, min(start + padded, vocab_size), padded)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """ValueError unless a model of these dimensions can be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    head_shard(num_heads, num_kv_heads, 0, size)
    divide(intermediate_size, size, "intermediate_size")
