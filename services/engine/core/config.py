"""Scheduler-side configuration: budgets and KV-cache geometry (no model or device knowledge)."""

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets of one engine step and the shape of the paged KV cache.

    `num_kvcache_blocks` is filled in by the model runner once it has sized the cache.
    `max_waiting` bounds the requests waiting to be admitted, preempted ones not counted (0 = unbounded); past
    it add_request raises QueueFullError. `max_num_seqs` caps a step and also how many sequences run at once.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    block_size: int = 16
    num_kvcache_blocks: int = 0
    enable_prefix_caching: bool = True
    max_waiting: int = 0
