"""The families' norms, run outside autocast: the residual stream stays in its dtype (bf16 when training in
bf16, at every ZeRO stage), the norm computes in fp32 inside its kernel and returns the input's dtype, and
nothing is kept in fp32 only because autocast upcast it (PyTorch's AMP op list has CUDA's autocast run
layer_norm in fp32, which would keep an fp32 copy of the input and hand fp32 to the projections). The
weights may be fp32 (zero_stage 0's autocast over fp32 weights): they are cast to the input's dtype, as
CUDA's layer_norm kernel and rms_norm's fused one take no other (a vector per norm, each forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, _as(self.weight, x), _as(self.bias, x), self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, _as(self.weight, x), self.eps)


def _as(param: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if param is None else param.to(x.dtype)
