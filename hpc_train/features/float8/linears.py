"""train.fp8=tensorwise|rowwise: the blocks' projections become torchao's Float8Linear, before any other
transform sees the stage (tensor parallelism then shards them as it shards nn.Linear, with torchao's float8
styles where they apply: `float8_tp_plan`; FSDP2 wraps them).

Dynamic scaling keeps no state: a Float8Linear holds the weight and bias of the nn.Linear it replaces, under
the same names, and casts them and its input to float8 (with fresh scales) in every matmul. So checkpoints
are the same with fp8 on or off, and a run saved with fp8 resumes without it and the reverse. The embedding
and the head stay in the compute dtype (the logits are the most sensitive matmul: torchtitan and torchao
leave the head out too), as does every projection with a side below train.fp8_min_dim (small matmuls
gain nothing from float8). Float8's matmul (`torch._scaled_mm`) needs every side a multiple of 16 on each
tp rank, and on CUDA a GPU of compute capability 8.9 (Ada, Hopper) or later: both are refused before
anything runs (checks.py, `capability_problem`)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from hpc_train.config import ConfigError, ParallelConfig
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.float8.options import Float8Options
from hpc_train.models.spec import ModelSpec, StageModule, projections

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


def all_gather_problem(backend: str, device: str) -> str:
    """Why train.fp8_all_gather cannot run over gloo (parallel.backend `backend`, train.device `device`)."""
    return (f"train.fp8_all_gather all-gathers float8 bytes, which gloo cannot send (parallel.backend={backend}, "
            f"train.device={device}): it needs NCCL; drop it to all-gather in the compute dtype")  # fmt: skip


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


def float8_config(t: Float8Options):
    """torchao's recipe for train.fp8 (and FSDP2's float8 all-gather, where asked)."""
    from torchao.float8 import Float8LinearConfig

    if t.fp8_all_gather:
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe with it
    return Float8LinearConfig.from_recipe_name(t.fp8)


def convert(stage: StageModule, plan: StagePlan, *, train: Float8Options, parallel: ParallelConfig) -> None:
    """The transform: the chosen projections of `stage` (on the meta device) become Float8Linear. On CUDA the
    device is checked here too, where the launcher placed the ranks."""
    from torchao.float8 import convert_to_float8_training

    if plan.device.type == "cuda":
        capability = torch.cuda.get_device_capability(plan.device)
        if problem := capability_problem(capability, torch.cuda.get_device_name(plan.device)):
            raise ConfigError(problem)
    if train.fp8_all_gather and dist.is_initialized() and dist.get_backend() == "gloo" and plan.mesh.size("dp_cp") > 1:
        raise ConfigError(all_gather_problem(parallel.backend, plan.device.type))
    chosen = set(fp8_projections(stage, train.fp8_min_dim))
    convert_to_float8_training(stage, module_filter_fn=lambda _, name: name in chosen, config=float8_config(train))


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


class PrecomputedScales(StepHooks):
    """train.fp8_all_gather: after each update, every float8 weight's scale at once (one all-reduce of their
    amaxes), so FSDP2's all-gathers do not each wait on their own (torchtitan's precompute). FSDP2 casts with
    the scale held until the next precompute, so a restore of other weights in place computes them again."""

    name = "float8"

    def __init__(self, chunks: list[nn.Module]):
        self.chunks = chunks

    def precompute(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for chunk in self.chunks:
            precompute_float8_dynamic_scale_for_fsdp(chunk)

    def after_update(self, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        self.precompute()
        return {}

    def after_restore(self) -> None:
        self.precompute()
