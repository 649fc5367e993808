"""optim.name=adamw8bit: AdamW with 8-bit moments (torchao's `OptimState8bit`: bitsandbytes' dynamic code
book, one fp32 scale per 256 elements), 2.03 bytes of state per element instead of 8 (rules/lowbit.py)."""

from __future__ import annotations

import torch

from hpc_train.optim.rules.lowbit import LowBitAdamW


class AdamW8bit(LowBitAdamW):
    block_size = 256  # torchao's default
    code_bits = 8
    qmap_entries = 256

    @staticmethod
    def state_zeros(shape: torch.Size, signed: bool, device: torch.device) -> torch.Tensor:
        from torchao.optim.subclass_8bit import OptimState8bit

        return OptimState8bit.zeros(shape, signed, AdamW8bit.block_size, device)

    @staticmethod
    def quantize(normalized: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        from torchao.optim.quant_utils import quantize_8bit_with_qmap

        return quantize_8bit_with_qmap(normalized, qmap)
