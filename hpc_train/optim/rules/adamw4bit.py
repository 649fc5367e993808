"""optim.name=adamw4bit: AdamW with 4-bit moments (torchao's `OptimState4bit`: two codes per byte, one fp32
scale per 128 elements), 1.06 bytes of state per element instead of 8 (rules/lowbit.py)."""

from __future__ import annotations

import torch

from hpc_train.optim.rules.lowbit import LowBitAdamW


class AdamW4bit(LowBitAdamW):
    block_size = 128  # torchao's default
    code_bits = 4
    qmap_entries = 16

    @staticmethod
    def state_zeros(shape: torch.Size, signed: bool, device: torch.device) -> torch.Tensor:
        from torchao.optim.subclass_4bit import OptimState4bit

        return OptimState4bit.zeros(shape, signed, AdamW4bit.block_size, device)

    @staticmethod
    def quantize(normalized: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        from torchao.optim.quant_utils import quantize_4bit_with_qmap

        codes = quantize_4bit_with_qmap(normalized, qmap)
        return (codes[::2] << 4) | codes[1::2]  # two per byte, as OptimState4bit packs them
