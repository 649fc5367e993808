"""float8's keys, in the `train` section."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_train.config import choice, non_negative


@dataclass
class Float8Options:
    # float8 matmuls in the blocks' projections (torchao's Float8Linear, dynamic scaling): off, one scale per
    # tensor, or one per row (more accurate, slower); the embedding and the head stay in the compute dtype.
    # Needs a GPU of compute capability 8.9+ (Ada, Hopper) on CUDA; the CPU runs it too (slowly)
    fp8: str = choice("off", "tensorwise", "rowwise")
    fp8_min_dim: int = non_negative(0)  # projections with a side (in or out features) below this stay unconverted
    fp8_all_gather: bool = False  # ZeRO-3: FSDP2 all-gathers those weights in float8 (tensorwise, NCCL only)

    def __post_init__(self) -> None:
        if self.fp8 in ("False", "false"):  # YAML reads a bare `off` (and `false`) as a boolean
            self.fp8 = "off"
