"""Linear projections: replicated, column-parallel (merged q/k/v and gate/up) and row-parallel.

Each module is built for this process's tensor-parallel rank (distributed.parallel_state) and loads its
own slice of a full checkpoint tensor. At tensor_parallel_size 1 every slice is the whole tensor and
no collective runs, so these are plain linear layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from services.engine.distributed.sharding import even_shard, head_shard
from services.engine.layers.quantization import QuantizedWeight, linear


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), converting dtype and device."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)}, model expects {tuple(param.shape)}")
    param.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features], replicated on every rank. Inference only.

    `quantized`: the weight's int8/int4 copy under `--quantization` (set after loading), used for calls of few
    rows (layers.quantization.linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.quantized)

    @torch.no_grad()
    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's part of the checkpoint's full `leaf` ("weight" or "bias") tensor."""
        copy_weight(self._param(leaf, name), tensor, name)

    def _param(self, leaf: str, name: str) -> torch.Tensor:
        param = getattr(self, leaf, None)
        if param is None:
            raise ValueError(f"weight {name}: the model has no {leaf} for this projection")
        return param


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input stacked along the output dim (q/k/v, or gate/up), each split
    by output rows across ranks. Checkpoints store each projection separately: `load_shard(i, ...)` copies
    this rank's rows of projection i.

    shards: per projection, (full rows, first row this rank holds, rows this rank holds).
    """

    def __init__(self, in_features: int, shards: list[tuple[int, int, int]], bias: bool = False):
        super().__init__(in_features, sum(num for _, _, num in shards), bias)
        self.shards = list(shards)
        self.output_sizes = [num for _, _, num in shards]
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(shards) + 1)]

    @classmethod
    def evenly(cls, in_features: int, output_sizes: list[int], bias: bool = False) -> "MergedColumnParallelLinear":
        """Every projection split into equal row blocks, rank r holding block r (gate/up)."""
        rank, size = get_tp_rank(), get_tp_size()
        shards = []
        for full in output_sizes:
            start, end = even_shard(full, rank, size, "projection size")
            shards.append((full, start, end - start))
        return cls(in_features, shards, bias)

    @torch.no_grad()
    def load_shard(self, index: int, tensor: torch.Tensor, name: str, is_bias: bool = False) -> None:
        full, start, num = self.shards[index]
        if tensor.shape[0] != full:
            raise ValueError(f"weight {name}: checkpoint has {tensor.shape[0]} rows, model expects {full}")
        target = self._param("bias" if is_bias else "weight", name)
        copy_weight(target[self.offsets[index]:self.offsets[index + 1]], tensor[start:start + num], name)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a merged output [..., sum(output_sizes)] back into its projections (views)."""
        return list(y.split(self.output_sizes, dim=-1))


def qkv_parallel_linear(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                        bias: bool = False) -> MergedColumnParallelLinear:
    """The merged q/k/v projection of this rank's heads (KV heads replicated when fewer than ranks)."""
    heads = head_shard(num_heads, num_kv_heads, get_tp_rank(), get_tp_size())
    shards = [(num_heads * head_dim, heads.first_q * head_dim, heads.num_q * head_dim),
              (num_kv_heads * head_dim, heads.first_kv * head_dim, heads.num_kv * head_dim),
              (num_kv_heads * head_dim, heads.first_kv * head_dim, heads.num_kv * head_dim)]
    return MergedColumnParallelLinear(hidden_size, shards, bias)


class RowParallelLinear(Linear):
    """Input columns split across ranks; the partial products are summed (all-reduce), then the bias added.

    Its input is the output of a column-parallel projection on the same rank (attention heads, MLP rows).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size = get_tp_size()
        self.input_start, input_end = even_shard(in_features, get_tp_rank(), self.tp_size, "input size")
        super().__init__(input_end - self.input_start, out_features, bias)
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.quantized)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        if leaf == "weight":
            if tensor.shape[-1] != self.full_in_features:
                raise ValueError(f"weight {name}: checkpoint has {tensor.shape[-1]} columns, model expects "
                                 f"{self.full_in_features}")
            tensor = tensor[:, self.input_start:self.input_start + self.in_features]
        copy_weight(self._param(leaf, name), tensor, name)
