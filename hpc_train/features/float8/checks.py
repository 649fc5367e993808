"""What train.fp8 and its options need of the rest of the config, refused before any process starts, each
problem with its fix."""

from __future__ import annotations

import importlib.util

import torch

from hpc_train.config import ModelConfig, OptimConfig, ParallelConfig, SlurmConfig, TrainConfig
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.features.float8.linears import (
    ALIGNMENT,
    all_gather_problem,
    capability_problem,
    fp8_projections,
    local_shapes,
)
from hpc_train.features.float8.options import Float8Options
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.models.spec import ModelSpec, projections


def runs_on_cuda(train: TrainConfig, slurm: SlurmConfig) -> bool:
    """Whether the ranks will compute on GPUs, as far as the config says: train.device=cuda, or auto with
    CUDA here or GPUs in its Slurm section (a plan or a submit from a login node without one)."""
    device = train.device
    return device == "cuda" or (device == "auto" and (torch.cuda.is_available() or slurm.gpus_per_node > 0))


def runs_on_gloo(train: TrainConfig, parallel: ParallelConfig, slurm: SlurmConfig) -> bool:
    """Whether the ranks' collectives go through gloo: parallel.backend=gloo, or auto on a CPU run."""
    backend = parallel.backend
    return backend == "gloo" or (backend == "auto" and not runs_on_cuda(train, slurm))


def check(*, train: Float8Options, model: ModelConfig, parallel: ParallelConfig, optim: OptimConfig,
          finetune: FinetuneConfig, slurm: SlurmConfig, spec: ModelSpec, dims: ParallelDims,
          here: bool) -> list[str]:  # fmt: skip
    """`here`: the ranks start on this machine, whose GPU must have float8 tensor cores. The float8 all-gather
    is refused on gloo only where FSDP2 shards the weights over more than one rank (dp x cp): with one, no
    float8 byte crosses gloo, and the precomputed scales run (and are tested) on a CPU (one ZeRO-3 process
    with optim.offload=cpu)."""
    if train.fp8 == "off":
        refused = "train.fp8_all_gather is for float8 weights: set train.fp8=tensorwise, or drop it"
        return [refused] if train.fp8_all_gather else []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append("train.fp8 needs torchao (its float8 linears): pip install 'hpc_train[fp8]'")
    if finetune.adapters:
        problems.append(f"train.fp8 trains the block projections in float8, and finetune.method={finetune.method} "
                        "freezes them: set train.fp8=off for adapters")  # fmt: skip
    if train.fp8_all_gather:
        if train.fp8 != "tensorwise":
            problems.append("train.fp8_all_gather needs one scale per weight: set train.fp8=tensorwise, or drop it")
        if optim.zero_stage != 3:
            problems.append(f"train.fp8_all_gather is FSDP2's (optim.zero_stage=3), not optim.zero_stage="
                            f"{optim.zero_stage}: drop it")  # fmt: skip
        elif runs_on_gloo(train, parallel, slurm) and dims.dp * dims.cp > 1:
            problems.append(all_gather_problem(parallel.backend, train.device))
    if here and runs_on_cuda(train, slurm) and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if problem := capability_problem(torch.cuda.get_device_capability(), name):
            problems.append(problem)
    tp = parallel.tp
    with torch.device("meta"):
        chunk = spec.build_stage(model, 0, 1, tp)
    chosen = fp8_projections(chunk, train.fp8_min_dim)
    if not chosen:
        widest = max(min(m.in_features, m.out_features) for m in projections(chunk).values())
        problems.append(f"train.fp8_min_dim={train.fp8_min_dim} leaves no projection in float8 (the largest smaller "
                        f"side is {widest}): lower it, or set train.fp8=off")  # fmt: skip
    shapes = local_shapes(chunk, spec, tp)
    odd = [name for name in chosen if any(side % ALIGNMENT for side in shapes[name])]
    if odd:
        name = odd[0]
        where = f" per tp rank (parallel.tp={tp})" if tp > 1 else ""
        problems.append(
            f"train.fp8: {name.split('.', 2)[-1]} is {shapes[name][0]} x {shapes[name][1]}{where}, and float8 matmuls "
            f"need every side a multiple of {ALIGNMENT}: pick model.d_model, model.n_heads, model.ffn_hidden (and "
            f"parallel.tp) that give multiples of {ALIGNMENT}, or raise train.fp8_min_dim above "
            f"{min(chosen[name].in_features, chosen[name].out_features)} to keep it out of float8"
        )
    return problems
