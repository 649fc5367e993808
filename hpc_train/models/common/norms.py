"""The families' norms, run outside autocast: the residual stream stays in its dtype (bf16 when training in
bf16, at every ZeRO stage), the norm computes in fp32 inside its kernel and returns the input's dtype, and
nothing is kept in fp32 only because autocast upcast it (PyTorch's AMP op list has CUDA's autocast run
layer_norm in fp32, which would keep an fp32 copy of the input and hand fp32 to the projections). The
weights may be fp32 (zero_stage 0's autocast over fp32 weights): layer_norm takes a weight of another dtype
than the input's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(The weight in the input's dtype: rms_norm's fused kernel takes no other.)"""
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
