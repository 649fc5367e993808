"""The precision policy, decided once from the config and the optimizer: which dtype the model's weights
are held in, which dtype autocast computes in, and whether fp16 loss scaling is on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpc_train.placement import local

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype  # the model's weights (bf16/fp16 only where the optimizer keeps fp32 masters)
    autocast_dtype: torch.dtype | None  # None: no autocast (fp32)
    loss_scaling: bool  # fp16: dynamic loss scaling agreed over every rank

    @classmethod
    def decide(cls, precision: str, optimizer_keeps_master_weights: bool) -> PrecisionPolicy:
        """bf16/fp16 weights when the optimizer holds an fp32 master copy (ZeRO-1, -2); otherwise fp32 weights
        under autocast."""
        low = None if precision == "fp32" else DTYPES[precision]
        weights = low if low is not None and optimizer_keeps_master_weights else torch.float32
        return cls(param_dtype=weights, autocast_dtype=low, loss_scaling=precision == "fp16")

    @property
    def param_bytes(self) -> int:
        return self.param_dtype.itemsize

    @property
    def frozen_dtype(self) -> torch.dtype:
        """LoRA's frozen base needs no master copy: it is held in the compute dtype."""
        return self.autocast_dtype or torch.float32

    def cast_parameters(self, params: list[nn.Parameter], dtype: torch.dtype | None = None) -> None:
        """Hold `params` in `dtype` (default `param_dtype`), after the optimizer took its fp32 master copy. The
        Parameter objects stay the same (the optimizer holds them); buffers stay fp32. `param.data = ...`
        would leave a DTensor's local shard in fp32, so whole tensors are swapped."""
        dtype = dtype or self.param_dtype
        for param in params:
            if local(param).dtype != dtype:
                cast = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, cast)
