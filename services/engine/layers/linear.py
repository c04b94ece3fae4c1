"""Linear projections, including the merged ones that run several projections in one matmul."""

import torch
import torch.nn.functional as F
from torch import nn


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), converting dtype and device."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)}, model expects {tuple(param.shape)}")
    param.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features]. Inference only: no gradients."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q/k/v, or gate/up).

    Checkpoints store each projection separately; `load_shard(i, ...)` copies projection i into its rows.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]

    @torch.no_grad()
    def load_shard(self, index: int, tensor: torch.Tensor, name: str, is_bias: bool = False) -> None:
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError(f"weight {name}: the model has no bias for this projection")
        copy_weight(target[self.offsets[index]:self.offsets[index + 1]], tensor, name)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a merged output [..., sum(output_sizes)] back into its projections (views)."""
        return list(y.split(self.output_sizes, dim=-1))
