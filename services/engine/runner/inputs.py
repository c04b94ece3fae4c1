"""Preparation of one step's model inputs, in two stages.

1. `StepInputBuilder.build`: host tensors (StepInputs) from the scheduled sequences, computed with numpy
   into reusable buffers (pinned on CUDA) from the runner's persistent block tables. This is what rank 0
   broadcasts to tensor-parallel workers, and what the CUDA-graph buffers are filled from.
2. `to_model_inputs`: the tensors on the device (non-blocking copies) and the AttentionMetadata.
Nothing here waits on the device, and no Python loop runs per token.
"""

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sequence import Sequence
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.runner.block_tables import PersistentBlockTables
from services.engine.runner.prompt_logprobs import PromptRows, make_prompt_rows


@dataclass(slots=True)
class StepInputs:
    """Host-side inputs of one step (CPU tensors; views of the builder's buffers, valid until its next build).

    token_data [3, N] int64: input ids, positions, slot mapping (slot -1: store nothing) of the N new tokens.
    block_tables [B, W] int32 padded with 0 (None for a prefill without cached prefix).
    seqlens_k [B]: each sequence's whole context (cached + new; for decode, its context length), also as
    context_lens [B] int32 (decode) or, with seqlens_q [B] (new tokens per sequence), as cu_seqlens
    [2, B+1] int32 (prefill: offsets of the new tokens, then of the whole contexts).
    logits_indices [S] int64: flat rows to compute logits for (prefill only; decode samples every row);
    sample_seq_indices: the batch position of each sampled sequence.
    prompt_rows: the prompt positions whose log-probabilities a request asked for (prefill only; usually None).
    """

    is_prefill: bool
    token_data: torch.Tensor
    block_tables: torch.Tensor | None
    seqlens_k: list[int]
    sample_seq_indices: list[int]
    context_lens: torch.Tensor | None = None
    seqlens_q: list[int] | None = None
    cu_seqlens: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    prompt_rows: PromptRows | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_data[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.token_data[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.token_data[2]

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_k)

    def detached(self) -> "StepInputs":
        """A compact copy that owns its memory (to pickle for tensor-parallel workers: a view would drag its
        whole buffer along, and the builder reuses that buffer next step)."""
        def clone(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()
        return StepInputs(self.is_prefill, clone(self.token_data), clone(self.block_tables), self.seqlens_k,
                          self.sample_seq_indices, clone(self.context_lens), self.seqlens_q,
                          clone(self.cu_seqlens), clone(self.logits_indices),
                          None if self.prompt_rows is None else self.prompt_rows.detached())


@dataclass(slots=True)
class ModelInputs:
    """What the model and the sampler need for one step.

    logits_indices [S]: rows of the model's hidden output to compute logits for (one per sampled sequence);
    sample_seq_indices: the batch position of each of those sequences.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seq_indices: list[int]


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


class _HostBuffer:
    """A growable flat host tensor (pinned on CUDA) handing out contiguous views of its first elements.

    NOTE: a view is overwritten by the next build (see StepInputBuilder for when that is safe on CUDA).
    """

    def __init__(self, dtype: torch.dtype, pin_memory: bool, size: int = 1024):
        self.dtype, self.pin_memory = dtype, pin_memory
        self.tensor = torch.empty(size, dtype=dtype, pin_memory=pin_memory)

    def view(self, *shape: int) -> tuple[torch.Tensor, np.ndarray]:
        numel = int(np.prod(shape))
        if numel > self.tensor.numel():
            self.tensor = torch.empty(max(numel, 2 * self.tensor.numel()), dtype=self.dtype,
                                      pin_memory=self.pin_memory)
        tensor = self.tensor[:numel].view(*shape)
        return tensor, tensor.numpy()


class StepInputBuilder:
    """Builds each step's StepInputs; owns the persistent block tables and the reusable host buffers.

    NOTE (CUDA): the buffers are pinned and copied non-blocking, so they may be rewritten only once the
    device has read them: the runner calls `inputs_enqueued()` after queuing a step's work, and `build`
    waits on that event (already passed when the step's sampled ids were read; this matters for a step
    that samples nothing, such as a prefill of chunks only).
    """

    def __init__(self, block_size: int, max_blocks_per_seq: int, max_num_seqs: int, device: torch.device):
        pin = device.type == "cuda"
        self.block_size = block_size
        self.device = device
        self.tables = PersistentBlockTables(max_blocks_per_seq, max_num_seqs + 1)  # host only: gathered, not copied
        self._tokens = _HostBuffer(torch.int64, pin)
        self._block_tables = _HostBuffer(torch.int32, pin)
        self._lens = _HostBuffer(torch.int32, pin)
        self._logits_indices = _HostBuffer(torch.int64, pin)
        self._enqueued = torch.cuda.Event() if pin else None

    def build(self, batch: SchedulerOutput) -> StepInputs:
        if self._enqueued is not None:
            self._enqueued.synchronize()
        return self.build_prefill(batch.seqs) if batch.is_prefill else self.build_decode(batch.seqs)

    def inputs_enqueued(self) -> None:
        """Mark the point on the current stream after which the last build's buffers may be reused."""
        if self._enqueued is not None:
            self._enqueued.record()

    def to_model_inputs(self, step: StepInputs) -> ModelInputs:
        return to_model_inputs(step, self.device)

    def build_decode(self, seqs: list[Sequence]) -> StepInputs:
        """Each sequence computes its last token (position num_tokens - 1) and samples the next."""
        rows = np.array(self.tables.rows_for(seqs), dtype=np.int64)  # [B]
        seqlens_k = [len(seq.token_ids) for seq in seqs]
        context_lens, lens = self._lens.view(len(seqs))
        lens[:] = seqlens_k
        token_data, data = self._tokens.view(3, len(seqs))
        data[0] = [seq.token_ids[-1] for seq in seqs]
        np.subtract(lens, 1, out=data[1])
        self._slots(rows, data[1], data[2])
        return StepInputs(False, token_data, self._gather_tables(rows, max(seqlens_k)), seqlens_k,
                          list(range(len(seqs))), context_lens=context_lens)

    def build_prefill(self, seqs: list[Sequence]) -> StepInputs:
        """Each sequence computes token_ids[num_cached_tokens : num_cached_tokens + num_scheduled_tokens]."""
        rows = np.array(self.tables.rows_for(seqs), dtype=np.int64)  # [B]
        starts = np.array([seq.num_cached_tokens for seq in seqs], dtype=np.int64)  # [B]
        seqlens_q = [seq.num_scheduled_tokens for seq in seqs]
        ends = starts + seqlens_q  # [B]
        cu_q = np.cumsum(seqlens_q)  # [B]
        num_tokens = int(cu_q[-1])
        token_data, data = self._tokens.view(3, num_tokens)
        input_ids: list[int] = []
        for seq, start, end in zip(seqs, starts.tolist(), ends.tolist()):
            input_ids.extend(seq.token_ids[start:end])
        data[0] = input_ids
        # positions: start_b + i for the i-th new token of sequence b
        data[1] = np.arange(num_tokens) + np.repeat(starts - (cu_q - seqlens_q), seqlens_q)
        self._slots(np.repeat(rows, seqlens_q), data[1], data[2])
        sampled = np.flatnonzero(ends == [seq.num_tokens for seq in seqs])  # [S]
        logits_indices, indices = self._logits_indices.view(len(sampled))
        np.subtract(cu_q[sampled], 1, out=indices)
        cu_seqlens, cu = self._lens.view(2, len(seqs) + 1)
        cu[:, 0] = 0
        cu[0, 1:] = cu_q
        np.cumsum(ends, out=cu[1, 1:])
        seqlens_k = ends.tolist()
        has_prefix = bool(starts.any())
        block_tables = self._gather_tables(rows, max(seqlens_k)) if has_prefix else None
        return StepInputs(True, token_data, block_tables, seqlens_k, sampled.tolist(), seqlens_q=seqlens_q,
                          cu_seqlens=cu_seqlens, logits_indices=logits_indices,
                          prompt_rows=make_prompt_rows(seqs, starts, ends, cu_q))

    def _slots(self, token_rows: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """Cache slot of each token [N] from its block-table row and position (block id * size + offset)."""
        out[:] = self.tables.array[token_rows, positions // self.block_size]
        out *= self.block_size
        out += positions % self.block_size

    def _gather_tables(self, rows: np.ndarray, max_context_len: int) -> torch.Tensor:
        width = -(-max_context_len // self.block_size)
        tables, out = self._block_tables.view(len(rows), width)
        self.tables.gather(rows, width, out)
        return tables  # [B, W]


def build_prefill(seqs: list[Sequence], block_size: int) -> StepInputs:
    """StepInputs of a prefill of `seqs` from a fresh builder (tests, one-off steps)."""
    return _one_off_builder(seqs, block_size).build_prefill(seqs)


def build_decode(seqs: list[Sequence], block_size: int) -> StepInputs:
    """StepInputs of a decode of `seqs` from a fresh builder (tests, one-off steps)."""
    return _one_off_builder(seqs, block_size).build_decode(seqs)


def _one_off_builder(seqs: list[Sequence], block_size: int) -> StepInputBuilder:
    max_blocks = max(max(len(seq.block_table) for seq in seqs), 1)
    return StepInputBuilder(block_size, max_blocks, len(seqs), torch.device("cpu"))


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=True) if tensor.device != device else tensor


def to_model_inputs(step: StepInputs, device: torch.device) -> ModelInputs:
    """Tensors and attention metadata of a step on `device`."""
    token_data = _copy(step.token_data, device)  # [3, N]
    block_tables = None if step.block_tables is None else _copy(step.block_tables, device)
    if step.is_prefill:
        cu_seqlens = _copy(step.cu_seqlens, device)  # [2, B+1]
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=token_data[2],
            block_tables=block_tables,
            cu_seqlens_q=cu_seqlens[0],
            cu_seqlens_k=cu_seqlens[1],
            max_seqlen_q=max(step.seqlens_q),
            max_seqlen_k=max(step.seqlens_k),
            seqlens_q_cpu=step.seqlens_q,
            seqlens_k_cpu=step.seqlens_k,
        )
        logits_indices = _copy(step.logits_indices, device)
    else:
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=token_data[2],
            block_tables=block_tables,
            context_lens=_copy(step.context_lens, device),
            max_seqlen_q=1,
            max_seqlen_k=max(step.seqlens_k),
            seqlens_k_cpu=step.seqlens_k,
        )
        logits_indices = torch.arange(step.num_seqs, device=device)
    return ModelInputs(token_data[0], token_data[1], meta, logits_indices, step.sample_seq_indices)


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    return to_model_inputs(build_prefill(seqs, block_size), device)


def prepare_decode(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    return to_model_inputs(build_decode(seqs, block_size), device)


def cacheless_prefill(token_ids: list[list[int]]) -> StepInputs:
    """A prefill of whole sequences with no KV cache behind them (memory profiling, scoring): every
    row's logits index is listed, slots are -1 (the runner unbinds the cache, so nothing is stored)."""
    seqlens = [len(ids) for ids in token_ids]
    token_data = torch.tensor([[t for ids in token_ids for t in ids],
                               [p for n in seqlens for p in range(n)],
                               [-1] * sum(seqlens)], dtype=torch.int64)  # [3, N]
    cu = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [B+1]
    return StepInputs(True, token_data, None, seqlens, list(range(len(seqlens))), seqlens_q=seqlens,
                      cu_seqlens=torch.stack([cu, cu]), logits_indices=cu[1:].to(torch.int64) - 1)


def dummy_prefill(num_tokens: int, max_seq_len: int) -> StepInputs:
    """A cache-less prefill of num_tokens zero tokens in sequences of at most max_seq_len (memory profiling)."""
    num_full, rest = divmod(num_tokens, max_seq_len)
    seqlens = [max_seq_len] * num_full + ([rest] if rest else [])
    return cacheless_prefill([[0] * n for n in seqlens])
