"""Token embedding and the LM head (which may share the embedding's weight), split by vocabulary rows.

Rank r holds vocabulary rows [start, end) in a shard of ceil(vocab / tp) rows (padding rows are zero).
The embedding sums the ranks' lookups (each row is found on exactly one rank); the LM head gathers
every rank's logits and drops the padding columns.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from services.engine.distributed.sharding import vocab_shard
from services.engine.layers.linear import copy_weight
from services.engine.layers.quantization import QuantizedWeight, linear


class VocabEmbedding(nn.Module):
    """token ids [N] -> embeddings [N, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tp_size()
        self.shard = vocab_shard(vocab_size, get_tp_rank(), self.tp_size)
        rows = self.shard.padded_size if self.tp_size > 1 else vocab_size
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard.start
        here = (local_ids >= 0) & (local_ids < self.shard.num_valid)  # [N]
        embedded = F.embedding(local_ids.masked_fill(~here, 0), self.weight)  # [N, hidden]
        return all_reduce(embedded.masked_fill(~here[:, None], 0.0))

    @torch.no_grad()
    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's rows of the full [vocab, hidden] checkpoint tensor."""
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"weight {name}: checkpoint has {tensor.shape[0]} rows, model expects {self.vocab_size}")
        copy_weight(self.weight[:self.shard.num_valid], tensor[self.shard.start:self.shard.end], name)


class LMHead(nn.Module):
    """hidden [B, hidden] -> logits [B, vocab]. With `tied_to`, reuses that embedding's weight (same shard).
    `quantized`: as Linear's (the embedding lookup keeps the full-precision weight)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        self.vocab_size = vocab_size
        self.tp_size = get_tp_size()
        if tied_to is not None:
            self.shard = tied_to.shard
            self.weight = tied_to.weight
        else:
            self.shard = vocab_shard(vocab_size, get_tp_rank(), self.tp_size)
            rows = self.shard.padded_size if self.tp_size > 1 else vocab_size
            self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)
        self.quantized: QuantizedWeight | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.quantized)  # [B, V / tp (padded)]
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits)[:, :self.vocab_size]

    @torch.no_grad()
    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"weight {name}: checkpoint has {tensor.shape[0]} rows, model expects {self.vocab_size}")
        copy_weight(self.weight[:self.shard.num_valid], tensor[self.shard.start:self.shard.end], name)
