"""CUDA graphs for decode steps: the batch-size ladder, padding, static input buffers, capture and replay.

A decode batch of n sequences replays the graph of the smallest captured size >= n; rows n.. are padding
that writes nothing (slot -1: store_kv skips it) and attends to one cached token of block 0 (context
length 1, a real and finite cache slot in every backend), so their outputs are finite and discarded.
Batches above the largest captured size, and every prefill, run eagerly.

Everything except DecodeGraphs' capture and replay is plain torch and runs on CPU.
"""

import bisect
import logging
from collections.abc import Callable

import torch

from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.runner.inputs import StepInputs

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH_SIZE = 512
PAD_TOKEN_ID = 0
PAD_SLOT = -1
PAD_CONTEXT_LEN = 1

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to min(max_num_seqs, limit), which is always the last rung."""
    top = min(max_num_seqs, limit)
    if top < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows, or None (run eagerly)."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def estimate_cuda_graph_bytes(buffer_bytes: int, first_graph_bytes: int, next_graph_bytes: int,
                              num_graphs: int) -> int:
    """Device memory of all captured graphs, from two measured captures.

    Graphs share one memory pool, captured largest first, so the first (largest) graph's growth holds the
    pool every smaller one reuses; each further graph adds about what the second capture added (its own
    executable graph and any pool growth). Plus the static input buffers.
    """
    if num_graphs < 1:
        return 0
    return buffer_bytes + max(0, first_graph_bytes) + (num_graphs - 1) * max(0, next_graph_bytes)


class DecodeGraphBuffers:
    """The static decode inputs every captured graph reads, allocated once for the largest captured batch.

    token_data [3, max_batch_size] int64: input ids, positions, slot mapping (one row each);
    context_lens [max_batch_size] int32; block_tables [max_batch_size, max_blocks_per_seq] int32.
    Columns of block_tables past a row's context are stale and never read (every backend reads only the
    blocks holding context_lens tokens), so a padding row only needs block 0 in its first column.
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        self.token_data = torch.zeros(3, max_batch_size, dtype=torch.int64, device=device)
        self.token_data[2].fill_(PAD_SLOT)
        self.context_lens = torch.full((max_batch_size,), PAD_CONTEXT_LEN, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.token_data, self.context_lens, self.block_tables))

    def fill(self, step: StepInputs, batch_size: int) -> None:
        """Copy a decode step's n rows in (three non-blocking copies from its host tensors) and make rows
        n..batch_size padding."""
        num_seqs = step.num_seqs
        if step.is_prefill or not 0 < num_seqs <= batch_size <= self.max_batch_size:
            raise ValueError(f"cannot fill a graph batch of {batch_size} with this step ({num_seqs} rows)")
        width = step.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds the graph's {self.max_blocks_per_seq}")
        self.token_data[:, :num_seqs].copy_(step.token_data, non_blocking=True)
        self.context_lens[:num_seqs].copy_(step.context_lens, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(step.block_tables, non_blocking=True)
        if num_seqs < batch_size:
            self.token_data[0, num_seqs:batch_size].fill_(PAD_TOKEN_ID)
            self.token_data[1, num_seqs:batch_size].zero_()
            self.token_data[2, num_seqs:batch_size].fill_(PAD_SLOT)
            self.context_lens[num_seqs:batch_size].fill_(PAD_CONTEXT_LEN)
            self.block_tables[num_seqs:batch_size, 0].zero_()

    def pad_all(self, batch_size: int) -> None:
        """Make rows [0, batch_size) padding rows (what capture and warm-up run on)."""
        self.token_data[:2, :batch_size].zero_()
        self.token_data[2, :batch_size].fill_(PAD_SLOT)
        self.context_lens[:batch_size].fill_(PAD_CONTEXT_LEN)
        self.block_tables[:batch_size].zero_()

    def views(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [bs], positions [bs], decode metadata) over the first batch_size rows of the buffers.

        max_seqlen_k is the block tables' capacity, so a backend that sizes its launch from it (Triton's
        split-K decode) keeps one launch shape for every replay.
        """
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.token_data[2, :batch_size],
            block_tables=self.block_tables[:batch_size],
            context_lens=self.context_lens[:batch_size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_blocks_per_seq * self.block_size,
        )
        return self.token_data[0, :batch_size], self.token_data[1, :batch_size], meta


class DecodeGraphs:
    """One captured decode forward per batch size (CUDA only), sharing a memory pool and the buffers."""

    def __init__(self, forward: ModelForward, buffers: DecodeGraphBuffers, sizes: list[int]):
        self.forward = forward
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def warm_up(self, batch_size: int) -> None:
        """One eager run at this size on padding rows (compiles kernels; cuBLAS picks its algorithms)."""
        self.buffers.pad_all(batch_size)
        self.forward(*self.buffers.views(batch_size))
        torch.cuda.synchronize(self.buffers.device)

    def capture_one(self, batch_size: int) -> None:
        """Capture the forward at this size into the shared pool (warm it up first)."""
        self.buffers.pad_all(batch_size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[batch_size] = self.forward(*self.buffers.views(batch_size))  # [bs, hidden]
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[batch_size] = graph
        torch.cuda.synchronize(self.buffers.device)

    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the largest one's pool)."""
        for batch_size in reversed(self.sizes):
            self.warm_up(batch_size)
            self.capture_one(batch_size)

    def release(self) -> None:
        """Drop every graph, its outputs and the pool."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode step by graph replay, or None when no graph fits it."""
        num_seqs = step.num_seqs
        batch_size = padded_batch_size(num_seqs, self.sizes)
        if batch_size is None or batch_size not in self.graphs:
            return None
        self.buffers.fill(step, batch_size)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][:num_seqs]


def measure_cuda_graph_bytes(forward: ModelForward, sizes: list[int], max_blocks_per_seq: int, block_size: int,
                             device: torch.device) -> int:
    """Capture the largest and the smallest graph (against whatever KV cache is bound now, e.g. a one-block
    temporary one), read how much device memory each took, release them and estimate the whole ladder."""
    buffers = DecodeGraphBuffers(sizes[-1], max_blocks_per_seq, block_size, device)
    graphs = DecodeGraphs(forward, buffers, sizes)
    measured = [0, 0]
    for i, batch_size in enumerate(sorted({sizes[-1], sizes[0]}, reverse=True)):
        graphs.warm_up(batch_size)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        graphs.capture_one(batch_size)
        measured[i] = free_before - torch.cuda.mem_get_info(device)[0]
    total = estimate_cuda_graph_bytes(buffers.nbytes, measured[0], measured[1], len(sizes))
    graphs.release()
    del graphs, buffers
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    logger.info("CUDA graphs: the largest took %.1f MiB, the smallest %.1f MiB more; %d graphs ~ %.1f MiB",
                measured[0] / 2**20, measured[1] / 2**20, len(sizes), total / 2**20)
    return total
