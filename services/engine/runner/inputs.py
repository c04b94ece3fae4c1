"""Host-side preparation of one step's model inputs: token ids, positions, slots and AttentionMetadata.

Everything is built as Python lists and becomes one tensor per field (pinned + non-blocking on CUDA).
"""

from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.layers.attention_metadata import AttentionMetadata


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


def _padded_block_tables(seqs: list[Sequence]) -> list[list[int]]:
    width = max(len(seq.block_table) for seq in seqs)
    return [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    """Each sequence computes token_ids[num_cached_tokens : num_cached_tokens + num_scheduled_tokens]."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
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
        cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        if end == seq.num_tokens:
            logits_indices.append(cu_seqlens_q[-1] - 1)
            sample_seq_indices.append(b)
    has_prefix = any(seq.num_cached_tokens > 0 for seq in seqs)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=to_device(slot_mapping, torch.int64, device),
        block_tables=to_device(_padded_block_tables(seqs), torch.int32, device) if has_prefix else None,
        cu_seqlens_q=to_device(cu_seqlens_q, torch.int32, device),
        cu_seqlens_k=to_device(cu_seqlens_k, torch.int32, device),
        max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(seqlens_k),
        seqlens_q_cpu=seqlens_q,
        seqlens_k_cpu=seqlens_k,
    )
    return ModelInputs(to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device), meta,
                       to_device(logits_indices, torch.int64, device), sample_seq_indices)


def prepare_decode(seqs: list[Sequence], block_size: int, device: torch.device) -> ModelInputs:
    """Each sequence computes its last token (position num_tokens - 1) and samples the next."""
    input_ids = [seq.last_token_id for seq in seqs]
    positions = [seq.num_tokens - 1 for seq in seqs]
    slot_mapping = [seq.block_table[pos // block_size] * block_size + pos % block_size
                    for seq, pos in zip(seqs, positions)]
    context_lens = [seq.num_tokens for seq in seqs]
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=to_device(slot_mapping, torch.int64, device),
        block_tables=to_device(_padded_block_tables(seqs), torch.int32, device),
        context_lens=to_device(context_lens, torch.int32, device),
        max_seqlen_q=1,
        max_seqlen_k=max(context_lens),
        seqlens_k_cpu=context_lens,
    )
    num_seqs = len(seqs)
    return ModelInputs(to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device), meta,
                       torch.arange(num_seqs, device=device), list(range(num_seqs)))


def dummy_prefill(num_tokens: int, max_seq_len: int, device: torch.device) -> ModelInputs:
    """A cache-less prefill of num_tokens tokens in sequences of at most max_seq_len (memory profiling)."""
    seqlens = [max_seq_len] * (num_tokens // max_seq_len) + ([num_tokens % max_seq_len] if num_tokens % max_seq_len else [])
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        cu_seqlens_q=to_device(cu, torch.int32, device),
        cu_seqlens_k=to_device(cu, torch.int32, device),
        max_seqlen_q=max(seqlens),
        max_seqlen_k=max(seqlens),
        seqlens_q_cpu=seqlens,
        seqlens_k_cpu=seqlens,
    )
    positions = [p for n in seqlens for p in range(n)]
    return ModelInputs(torch.zeros(num_tokens, dtype=torch.int64, device=device),
                       to_device(positions, torch.int64, device), meta,
                       to_device([c - 1 for c in cu[1:]], torch.int64, device), list(range(len(seqlens))))
