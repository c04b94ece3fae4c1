"""Preparation of one step's model inputs, in two stages.

1. `build_prefill` / `build_decode`: plain Python lists (StepInputs) from the scheduled sequences. This is
   what rank 0 broadcasts to tensor-parallel workers, and what the CUDA-graph buffers are filled from.
2. `to_model_inputs`: one tensor per field (pinned + non-blocking on CUDA) and the AttentionMetadata.
Nothing here waits on the device.
"""

from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.layers.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    """Plain-data inputs of one step (picklable; no tensors).

    Both: input_ids, positions, slot_mapping [N]; block_tables [B][max_blocks] padded with 0 (None for a
    prefill without cached prefix). Prefill: seqlens_q / seqlens_k [B] (new tokens / whole context).
    Decode: context_lens [B]. logits_indices: flat rows to compute logits for (prefill only; decode
    samples every row); sample_seq_indices: the batch position of each sampled sequence.
    """

    is_prefill: bool
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]] | None
    sample_seq_indices: list[int]
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    context_lens: list[int] | None = None
    logits_indices: list[int] | None = None


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


def slots_for_range(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions [start, end) of a sequence with this block table."""
    slots: list[int] = []
    for index in range(start // block_size, (end - 1) // block_size + 1 if end > start else 0):
        base = block_table[index] * block_size - index * block_size
        lo, hi = max(start, index * block_size), min(end, (index + 1) * block_size)
        slots.extend(range(base + lo, base + hi))
    return slots


def padded_block_tables(block_tables: list[list[int]]) -> list[list[int]]:
    width = max(len(table) for table in block_tables)
    return [table + [0] * (width - len(table)) for table in block_tables]


def build_prefill(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence computes token_ids[num_cached_tokens : num_cached_tokens + num_scheduled_tokens]."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    seqlens_q: list[int] = []
    seqlens_k: list[int] = []
    logits_indices: list[int] = []
    sample_seq_indices: list[int] = []
    for b, seq in enumerate(seqs):
        start = seq.num_cached_tokens
        end = start + seq.num_scheduled_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(slots_for_range(seq.block_table, start, end, block_size))
        seqlens_q.append(end - start)
        seqlens_k.append(end)
        if end == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sample_seq_indices.append(b)
    has_prefix = any(seq.num_cached_tokens > 0 for seq in seqs)
    block_tables = padded_block_tables([seq.block_table for seq in seqs]) if has_prefix else None
    return StepInputs(True, input_ids, positions, slot_mapping, block_tables, sample_seq_indices,
                      seqlens_q=seqlens_q, seqlens_k=seqlens_k, logits_indices=logits_indices)


def build_decode(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence computes its last token (position num_tokens - 1) and samples the next."""
    positions = [seq.num_tokens - 1 for seq in seqs]
    return StepInputs(
        is_prefill=False,
        input_ids=[seq.last_token_id for seq in seqs],
        positions=positions,
        slot_mapping=[seq.block_table[pos // block_size] * block_size + pos % block_size
                      for seq, pos in zip(seqs, positions)],
        block_tables=padded_block_tables([seq.block_table for seq in seqs]),
        sample_seq_indices=list(range(len(seqs))),
        context_lens=[seq.num_tokens for seq in seqs],
    )


def _cumulative(lengths: list[int]) -> list[int]:
    total, result = 0, [0]
    for n in lengths:
        total += n
        result.append(total)
    return result


def to_model_inputs(step: StepInputs, device: torch.device) -> ModelInputs:
    """Tensors and attention metadata of a step on `device`."""
    if step.is_prefill:
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=to_device(step.slot_mapping, torch.int64, device),
            block_tables=to_device(step.block_tables, torch.int32, device) if step.block_tables else None,
            cu_seqlens_q=to_device(_cumulative(step.seqlens_q), torch.int32, device),
            cu_seqlens_k=to_device(_cumulative(step.seqlens_k), torch.int32, device),
            max_seqlen_q=max(step.seqlens_q),
            max_seqlen_k=max(step.seqlens_k),
            seqlens_q_cpu=step.seqlens_q,
            seqlens_k_cpu=step.seqlens_k,
        )
        logits_indices = to_device(step.logits_indices, torch.int64, device)
    else:
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=to_device(step.slot_mapping, torch.int64, device),
            block_tables=to_device(step.block_tables, torch.int32, device),
            context_lens=to_device(step.context_lens, torch.int32, device),
            max_seqlen_q=1,
            max_seqlen_k=max(step.context_lens),
            seqlens_k_cpu=step.context_lens,
        )
        logits_indices = torch.arange(len(step.context_lens), device=device)
    return ModelInputs(to_device(step.input_ids, torch.int64, device), to_device(step.positions, torch.int64, device),
                       meta, logits_indices, step.sample_seq_indices)


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    return to_model_inputs(build_prefill(seqs, block_size), device)


def prepare_decode(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    return to_model_inputs(build_decode(seqs, block_size), device)


def cacheless_prefill(token_ids: list[list[int]]) -> StepInputs:
    """A prefill of whole sequences with no KV cache behind them (memory profiling, scoring): every
    row's logits index is listed, slots are -1 (the runner unbinds the cache, so nothing is stored)."""
    seqlens = [len(ids) for ids in token_ids]
    return StepInputs(
        is_prefill=True,
        input_ids=[t for ids in token_ids for t in ids],
        positions=[p for n in seqlens for p in range(n)],
        slot_mapping=[-1] * sum(seqlens),
        block_tables=None,
        sample_seq_indices=list(range(len(seqlens))),
        seqlens_q=seqlens,
        seqlens_k=seqlens,
        logits_indices=[c - 1 for c in _cumulative(seqlens)[1:]],
    )


def dummy_prefill(num_tokens: int, max_seq_len: int) -> StepInputs:
    """A cache-less prefill of num_tokens zero tokens in sequences of at most max_seq_len (memory profiling)."""
    num_full, rest = divmod(num_tokens, max_seq_len)
    seqlens = [max_seq_len] * num_full + ([rest] if rest else [])
    return cacheless_prefill([[0] * n for n in seqlens])
