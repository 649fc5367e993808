"""train.fp8=tensorwise|rowwise: the blocks' projections become torchao's Float8Linear, before any other
transform sees the stage (tensor parallelism then shards them as it shards nn.Linear; FSDP2 wraps them).

Dynamic scaling keeps no state: a Float8Linear holds the weight and bias of the nn.Linear it replaces, under
the same names, and casts them and its input to float8 (with fresh scales) in every matmul. So checkpoints
are the same with fp8 on or off, and a run saved with fp8 resumes without it and the reverse. The embedding
and the head stay in the compute dtype (the logits are the most sensitive matmul: torchtitan and torchao
leave the head out too), as does every projection with a side below train.fp8_min_dim (small matmuls
gain nothing from float8). Float8's matmul (`torch._scaled_mm`) needs every side a multiple of 16 on each
tp rank, and on CUDA a GPU of compute capability 8.9 (Ada, Hopper) or later: both are refused before
anything runs (`check_fp8`, `capability_problem`)."""

from __future__ import annotations

import importlib.util
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from hpc_train.config import ConfigError, JobConfig, TrainConfig
from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.finetune.lora import projections
from hpc_train.models.spec import ModelSpec, StageModule

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
ALIGNMENT = 16  # every side of a float8 matmul


def capability_problem(capability: tuple[int, int], device_name: str = "this GPU") -> str | None:
    """Why train.fp8 cannot run on a CUDA device of this compute capability (None: it can). A pure function
    of `torch.cuda.get_device_capability()`'s tuple, so the rule is tested where no GPU exists."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (f"train.fp8 needs float8 tensor cores, compute capability 8.9 or later (L4, L40, H100, H200...); "
            f"{device_name} has {major}.{minor}: set train.fp8=off (bf16 is the fastest this GPU runs)")  # fmt: skip


def fp8_projections(chunk: nn.Module, min_dim: int) -> dict[str, nn.Linear]:
    """The block projections train.fp8 converts: those whose smaller side is at least `min_dim`."""
    return {name: m for name, m in projections(chunk).items() if min(m.in_features, m.out_features) >= min_dim}


def local_shapes(chunk: nn.Module, spec: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """Each block projection's (out, in) features on one tp rank: a column-parallel one splits its outputs,
    a row-parallel one its inputs (the family's TP plan says which)."""
    plan = spec.tp_plan(chunk, False) if tp > 1 else {}
    shapes = {}
    for name, m in projections(chunk).items():
        style = plan.get(name)
        out_features = m.out_features // (tp if isinstance(style, ColwiseParallel) else 1)
        in_features = m.in_features // (tp if isinstance(style, RowwiseParallel) else 1)
        shapes[name] = (out_features, in_features)
    return shapes


def runs_on_cuda(cfg: JobConfig) -> bool:
    """Whether the ranks will compute on GPUs, as far as the config says: train.device=cuda, or auto with
    CUDA here or GPUs in its Slurm section (a plan or a submit from a login node without one)."""
    device = cfg.train.device
    return device == "cuda" or (device == "auto" and (torch.cuda.is_available() or cfg.slurm.gpus_per_node > 0))


def runs_on_gloo(cfg: JobConfig) -> bool:
    """Whether the ranks' collectives go through gloo: parallel.backend=gloo, or auto on a CPU run."""
    backend = cfg.parallel.backend
    return backend == "gloo" or (backend == "auto" and not runs_on_cuda(cfg))


def all_gather_problem(cfg: JobConfig) -> str:
    return (f"train.fp8_all_gather all-gathers float8 bytes, which gloo cannot send (parallel.backend="
            f"{cfg.parallel.backend}, train.device={cfg.train.device}): it needs NCCL; drop it to all-gather in "
            f"the compute dtype")  # fmt: skip


def check_fp8(cfg: JobConfig, spec: ModelSpec) -> None:
    """What train.fp8 and its options need of the rest of the config: a ConfigError naming each problem and
    its fix, before any process starts."""
    t = cfg.train
    problems = []
    if t.fp8 == "off":
        if t.fp8_all_gather:
            problems.append("train.fp8_all_gather is for float8 weights: set train.fp8=tensorwise, or drop it")
        if problems:
            raise ConfigError("\n".join(problems))
        return
    if importlib.util.find_spec("torchao") is None:
        problems.append("train.fp8 needs torchao (its float8 linears): pip install 'hpc_train[fp8]'")
    if cfg.finetune.adapters:
        problems.append(f"train.fp8 trains the block projections in float8, and finetune.method={cfg.finetune.method} "
                        "freezes them: set train.fp8=off for adapters")  # fmt: skip
    if t.fp8_all_gather:
        if t.fp8 != "tensorwise":
            problems.append("train.fp8_all_gather needs one scale per weight: set train.fp8=tensorwise, or drop it")
        if cfg.optim.zero_stage != 3:
            problems.append(f"train.fp8_all_gather is FSDP2's (optim.zero_stage=3), not optim.zero_stage="
                            f"{cfg.optim.zero_stage}: drop it")  # fmt: skip
        elif runs_on_gloo(cfg):
            problems.append(all_gather_problem(cfg))
    tp = cfg.parallel.tp
    with torch.device("meta"):
        chunk = spec.build_stage(cfg.model, 0, 1, tp)
    chosen = fp8_projections(chunk, t.fp8_min_dim)
    if not chosen:
        widest = max(min(m.in_features, m.out_features) for m in projections(chunk).values())
        problems.append(f"train.fp8_min_dim={t.fp8_min_dim} leaves no projection in float8 (the largest smaller "
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
    if problems:
        raise ConfigError("\n".join(problems))


def float8_config(t: TrainConfig):
    """torchao's recipe for train.fp8 (and FSDP2's float8 all-gather, where asked)."""
    from torchao.float8 import Float8LinearConfig

    if t.fp8_all_gather:
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe with it
    return Float8LinearConfig.from_recipe_name(t.fp8)


def _apply(stage: StageModule, plan: StagePlan) -> None:
    from torchao.float8 import convert_to_float8_training

    t = plan.cfg.train
    if plan.device.type == "cuda":  # where the ranks were placed by their launcher, checked here
        capability = torch.cuda.get_device_capability(plan.device)
        if problem := capability_problem(capability, torch.cuda.get_device_name(plan.device)):
            raise ConfigError(problem)
    if t.fp8_all_gather and dist.is_initialized() and dist.get_backend() == "gloo":
        raise ConfigError(all_gather_problem(plan.cfg))
    chosen = set(fp8_projections(stage, t.fp8_min_dim))
    convert_to_float8_training(stage, module_filter_fn=lambda _, name: name in chosen, config=float8_config(t))


TRANSFORM = Transform("float8", lambda plan: plan.cfg.train.fp8 != "off", _apply)


def is_float8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def float8_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The TP plan with torchao's float8 styles where they apply: tensorwise Float8Linear projections cast
    their inputs (and output gradients) to float8 before tp's collectives, so a sequence-parallel
    all-gather moves float8 bytes; a module whose linears are all such gets its input cast once for all of
    them. Rowwise scaling keeps the plain styles (torchao's float8 styles assume one scale per tensor)."""
    if "torchao.float8" not in sys.modules:  # nothing was converted (and torchao's import is not cheap)
        return plan
    from torchao.float8 import ScalingGranularity
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def tensorwise(module: nn.Module) -> bool:
        if not is_float8(module):
            return False
        c = module.config
        casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
        return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts)

    out = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if type(style) in (ColwiseParallel, RowwiseParallel) and tensorwise(module):
            cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            style = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                        use_local_output=style.use_local_output)  # fmt: skip
        elif type(style) is PrepareModuleInput and not style.with_kwargs:
            linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
            if linears and all(tensorwise(m) for m in linears):
                style = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                 desired_input_layouts=style.desired_input_layouts,
                                                 use_local_output=style.use_local_output)  # fmt: skip
        out[name] = style
    return out


def precompute_scales(chunks: list[nn.Module]) -> None:
    """After each update with train.fp8_all_gather: every float8 weight's scale at once (one all-reduce of
    their amaxes), so FSDP2's all-gathers do not each wait on their own (torchtitan's precompute)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for chunk in chunks:
        precompute_float8_dynamic_scale_for_fsdp(chunk)
