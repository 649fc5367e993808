"""The whole check of a run's config for a world size, before any process starts: the schema and the
parallel layout (config/checks.py), the model family's shapes (models/), the optimizer's capabilities (optim/),
the frozen-parameter patterns and LoRA's targets (`check_run`: the builder and the planner use it), and, for
the CLI's commands, this machine's limits where the ranks start here (`check_job`)."""

from __future__ import annotations

import importlib.util
import os

import torch

from hpc_train.config import ConfigError, JobConfig, check_values, raise_all, validate
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import stage_ids
from hpc_train.distributed.transforms.float8 import capability_problem, check_fp8
from hpc_train.finetune.lora import NF4_BLOCK, check_targets, nf4_scaler_block, projections
from hpc_train.models import get_spec
from hpc_train.models.spec import ModelSpec, is_frozen
from hpc_train.optim import optimizer_class


def check_job(
    cfg: JobConfig, world_size: int, starts_here: bool, check_paths: bool = True, world_from: str = ""
) -> ParallelDims:
    """The one check every CLI command that resolves a config runs before it starts or submits anything
    (train, submit and its dry run, doctor, plan, config show, import-hf), so the same bad input gets the same
    error from each. Every key's own rule, the slurm section's included, holds wherever the command runs (a
    config is one document: what a local run records may be submitted later), and then `check_run`'s layout
    for `world_size` (`world_from` names where that came from, in the layout's errors). This machine's limits
    (`check_machine`) apply only where the ranks start here (`starts_here`): train and doctor --local started
    alone, import-hf, and `config show` outside a job, which reports what `train` here would refuse. A
    submitted job runs on the cluster's nodes, `plan` sizes a layout for any machine, and a rank started by
    srun or torchrun was placed by its launcher, so none of them is bound by this machine."""
    raise_all([lambda: check_values(cfg), *([lambda: check_machine(cfg)] if starts_here else [])])
    try:
        return check_run(cfg, world_size, check_paths)
    except ConfigError as err:
        if not world_from:
            raise
        raise ConfigError(f"{err} (world size = {world_from} = {world_size})") from None


def check_machine(cfg: JobConfig) -> None:
    """A run launched here fits this machine: its device exists and one process per GPU (NCCL's rule), or a
    bounded number of CPU processes (each needs a core's share and its own memory); train.fp8 needs a GPU
    with float8 tensor cores."""
    problems = []
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        problems.append("train.device=cuda but this machine has no CUDA device visible; use train.device=cpu")
    cores = len(os.sched_getaffinity(0))
    if cuda and torch.cuda.is_available():
        limit, what = torch.cuda.device_count(), f"one per GPU ({torch.cuda.device_count()} here)"
    else:
        limit, what = 4 * cores, f"4 per CPU core ({cores} here)"
    if cuda and torch.cuda.is_available() and cfg.train.fp8 != "off":
        name = torch.cuda.get_device_name()
        if problem := capability_problem(torch.cuda.get_device_capability(), name):
            problems.append(problem)
    if cfg.parallel.nproc > limit:
        problems.append(f"parallel.nproc={cfg.parallel.nproc} local processes exceed {what}; use parallel.nproc <= "
                        f"{limit}, or `hpc-train submit` to run on a cluster")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def check_run(cfg: JobConfig, world_size: int, check_paths: bool = True) -> ParallelDims:
    """Raise a ConfigError naming the problem and the fix; return the mesh's dimensions."""
    dp = validate(cfg, world_size, check_paths)
    spec = get_spec(cfg.model.arch)
    raise_all([lambda: spec.validate(cfg.model, cfg.parallel.tp), lambda: optimizer_class(cfg.optim),
               lambda: _check_zero(cfg, dp * cfg.parallel.cp)])  # fmt: skip
    if cfg.model.moe.num_experts or cfg.parallel.ep > 1:
        _check_moe(cfg, dp)
    if cfg.train.freeze:
        _check_freeze(cfg, spec)
    if cfg.finetune.adapters:
        _check_adapters(cfg, spec)
    check_fp8(cfg, spec)
    return ParallelDims(pp=cfg.parallel.pp, dp=dp, cp=cfg.parallel.cp, tp=cfg.parallel.tp)


def _check_moe(cfg: JobConfig, dp: int) -> None:
    """What MoE layers do not run with yet, and expert parallelism's layout, refused before any rank starts:
    one line per problem."""
    experts, ep = cfg.model.moe.num_experts, cfg.parallel.ep
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={ep} shards the routed experts of MoE layers, and this model is dense "
                          "(model.moe.num_experts=0): set parallel.ep=1")  # fmt: skip
    layout = {
        f"parallel.ep={ep} must divide the data-parallel size {dp} (it is carved from dp): pick ep among the "
        f"divisors of {dp}, or more ranks": dp % ep,
        f"parallel.ep={ep} must divide model.moe.num_experts={experts} (each rank holds num_experts/ep): pick ep "
        f"among the divisors of {experts}": experts % ep,
    }
    problems = [problem for problem, refused in layout.items() if refused]
    unsupported = {
        "parallel.sequence_parallel": (cfg.parallel.sequence_parallel, "set parallel.sequence_parallel=false"),
        f"parallel.cp={cfg.parallel.cp}": (cfg.parallel.cp > 1, "set parallel.cp=1"),
        "train.fp8": (cfg.train.fp8 != "off", "set train.fp8=off"),
        "train.compile": (cfg.train.compile, "set train.compile=false"),
        f"finetune.method={cfg.finetune.method}": (cfg.finetune.adapters, "use finetune.method=full"),
    }
    problems += [f"{key} is not supported with model.moe.num_experts={experts} yet: {fix}"
                 for key, (refused, fix) in unsupported.items() if refused]  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def _check_zero(cfg: JobConfig, dp_cp: int) -> None:
    """Options that only one side of ZeRO-3 (FSDP2) has; it shards over dp x cp."""
    o = cfg.optim
    if optimizer_class(o).shards_params:
        if dp_cp == 1:
            raise ConfigError(
                "optim.zero_stage=3 shards over dp x cp, and dp x cp=1 here: use optim.zero_stage=1 (or more ranks)"
            )
        if o.overlap_grad_reduce:
            raise ConfigError("optim.overlap_grad_reduce is for zero stages 0-2 (FSDP2 always reduces in backward): "
                              "drop it with optim.zero_stage=3")  # fmt: skip
    elif o.reshard_after_forward is not None:
        raise ConfigError("optim.reshard_after_forward is for optim.zero_stage=3 (FSDP2): drop it")


def _check_adapters(cfg: JobConfig, spec: ModelSpec) -> None:
    """LoRA's targets are projections of the family, and it decides alone what trains."""
    if cfg.train.freeze:
        raise ConfigError(f"train.freeze is for finetune.method=full; {cfg.finetune.method} trains only its adapters "
                          "(finetune.lora_targets picks where they go): drop train.freeze")  # fmt: skip
    if cfg.finetune.lora_dropout and cfg.parallel.tp > 1:
        raise ConfigError("finetune.lora_dropout with parallel.tp > 1 would draw another mask on each tp rank of a "
                          "replicated input: set finetune.lora_dropout=0 or parallel.tp=1")  # fmt: skip
    if optimizer_class(cfg.optim).shards_params:
        raise ConfigError(f"finetune.method={cfg.finetune.method} trains only small adapters, with nothing worth "
                          "sharding by FSDP2: use optim.zero_stage=1 (or 0)")  # fmt: skip
    with torch.device("meta"):
        stage = spec.build_stage(cfg.model)
    check_targets(stage, cfg.finetune.lora_targets)
    if cfg.finetune.quantized_base:
        _check_qlora(cfg, stage)


def _check_qlora(cfg: JobConfig, stage: torch.nn.Module) -> None:
    """What NF4 base weights (torchao's NF4Tensor, a plain tensor subclass) can be part of here."""
    problems = []
    if cfg.train.precision == "fp16":
        problems.append("finetune.method=qlora dequantizes its NF4 weights to bf16: set train.precision=bf16 (or fp32)")
    if importlib.util.find_spec("torchao") is None:
        problems.append("finetune.method=qlora needs torchao (its NF4 tensor): pip install 'hpc_train[finetune]'")
    if cfg.parallel.tp > 1:
        problems.append("finetune.method=qlora keeps whole NF4 weights per rank: use parallel.tp=1 (pp and dp work)")
    sizes = {name: m.weight.numel() for name, m in projections(stage).items()}
    odd = [name for name, numel in sizes.items() if nf4_scaler_block(numel) is None]
    if odd:
        name, numel = odd[0], sizes[odd[0]]
        problems.append(f"finetune.method=qlora quantizes blocks of {NF4_BLOCK} weights; {name} has {numel}: pick "
                        f"model sizes divisible by {NF4_BLOCK}")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def _check_freeze(cfg: JobConfig, spec: ModelSpec) -> None:
    """Every train.freeze pattern names a parameter, and every pipeline rank keeps one to train (an
    optimizer needs parameters; a stage with none would only forward what others learn)."""
    freeze, pp, stages = cfg.train.freeze, cfg.parallel.pp, cfg.parallel.pp * cfg.parallel.virtual_stages
    names_by_rank = []
    for pp_rank in range(pp):
        names = []
        for stage in stage_ids(pp_rank, pp, cfg.parallel.virtual_stages):
            with torch.device("meta"):
                chunk = spec.build_stage(cfg.model, stage, stages)
            names += [chunk.canonical_name(name) for name, _ in chunk.named_parameters()]
        names_by_rank.append(names)
    every = [name for names in names_by_rank for name in names]
    for pattern in freeze:
        if not any(is_frozen(name, [pattern]) for name in every):
            raise ConfigError(
                f"train.freeze pattern {pattern!r} matches no parameter of the {spec.name} model "
                f"(e.g. {every[0]!r}, 'layers.0.*'); `hpc-train ckpt inspect` lists a checkpoint's names"
            )
    if all(is_frozen(name, freeze) for name in every):
        raise ConfigError("train.freeze holds every parameter fixed: nothing would train")
    for pp_rank, names in enumerate(names_by_rank):
        if all(is_frozen(name, freeze) for name in names):
            raise ConfigError(
                f"train.freeze holds every parameter of pipeline rank {pp_rank} fixed ({len(names)} parameters): "
                f"unfreeze one there, or use a smaller parallel.pp"
            )
