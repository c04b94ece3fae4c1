"""RMSNorm with an optional fused residual add."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementation.

    forward(x) returns the normed x; forward(x, residual) first adds x to the residual stream and returns
    (normed sum, new residual), which saves one pass in the decoder layers.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
