"""What train.fp8 adds to the planner: the float8 casts a projection's backward holds, and with
train.fp8_all_gather the bytes FSDP2's all-gathers save (the block's float8 projections gathered in 1 byte an
element instead of the compute dtype), in memory and in dp traffic."""

from __future__ import annotations

import dataclasses

import torch

from hpc_train.config import ModelConfig, OptimConfig, ParallelConfig, SlurmConfig, TrainConfig
from hpc_train.features.feature import Memory
from hpc_train.features.float8.checks import runs_on_cuda
from hpc_train.features.float8.linears import fp8_projections
from hpc_train.features.float8.options import Float8Options
from hpc_train.features.fsdp.sharding import all_gathers_per_step, reshards_after_forward
from hpc_train.models import get_spec
from hpc_train.models.spec import ActivationShape


def enabled(*, train: Float8Options) -> bool:
    return train.fp8 != "off"


def activation_shape(shape: ActivationShape, *, train: Float8Options) -> ActivationShape:
    """Float8 projections keep the parameter itself for backward, never a cast of the weight."""
    return dataclasses.replace(shape, float8=True)


def fp8_projections_of(model: ModelConfig, train: Float8Options) -> dict[str, torch.nn.Module]:
    """The projections train.fp8 converts, on the meta device."""
    with torch.device("meta"):
        chunk = get_spec(model.arch).build_stage(model)
    return fp8_projections(chunk, train.fp8_min_dim)


def working_bytes(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, slurm: SlurmConfig) -> int:
    """What the backward of the widest float8 projection (the MLP's, d x f on a tp rank) holds besides its
    operands: float8 casts (1 byte an element) of its input, its weight and its output's gradient, with their
    scales (one fp32 per tensor, or per row and column with rowwise scaling); on the CPU, whose `_scaled_mm`
    computes in fp32, also their fp32 copies (4 bytes more an element, measured)."""
    tokens, d = train.micro_batch_size * model.seq_len // parallel.cp, model.d_model  # the rank's sequence shard
    f = max(projection.out_features for projection in fp8_projections_of(model, train).values()) // parallel.tp
    elements = tokens * d + d * f + tokens * f
    scales = 4 * (2 * tokens + d + f) if train.fp8 == "rowwise" else 4 * 3
    return elements * (1 if runs_on_cuda(train, slurm) else 5) + scales


def gathered_elements(model: ModelConfig, train: Float8Options, parallel: ParallelConfig) -> int:
    """With train.fp8_all_gather: the elements of one block's float8 projections on a tp rank, which FSDP2
    all-gathers in float8 (1 byte) rather than the compute dtype; otherwise 0."""
    if not train.fp8_all_gather:
        return 0
    return sum(m.weight.numel() for name, m in fp8_projections_of(model, train).items()
               if name.startswith("layers.0.")) // parallel.tp  # fmt: skip


def _compute_bytes(train: TrainConfig) -> int:
    """The dtype FSDP2 gathers in (fp8_all_gather is ZeRO-3's): the compute dtype."""
    return 4 if train.precision == "fp32" else 2


def memory(*, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, optim: OptimConfig,
           slurm: SlurmConfig) -> Memory:  # fmt: skip
    """The casts' working set; with the float8 all-gather, 1 byte instead of the compute dtype's for every
    gathered block's float8 projections: the gathered and prefetched block (or every block the stage keeps
    gathered) and the block a backward gathers."""
    saved = (_compute_bytes(train) - 1) * gathered_elements(model, train, parallel)
    blocks = model.n_layers // parallel.pp
    one_at_a_time = parallel.pp == 1 and reshards_after_forward(optim, parallel)
    gathered = -saved * (1 if one_at_a_time else blocks)
    return Memory(working=working_bytes(model, train, parallel, slurm), static=gathered, block=-saved * one_at_a_time)


def traffic(*, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, optim: OptimConfig, dims) -> dict:
    """dp bytes a rank saves per step when FSDP2 all-gathers the float8 projections in 1 byte."""
    dp = dims.dp * dims.cp
    elements = gathered_elements(model, train, parallel) * model.n_layers // parallel.pp
    if not elements or dp == 1:
        return {}
    gathers = all_gathers_per_step(optim, parallel, train.grad_accum)
    return {"dp": -elements * (dp - 1) / dp * (_compute_bytes(train) - 1) * gathers}
