"""train.fp8: float8 matmuls in the blocks' projections (torchao's Float8Linear). Its keys (options.py), the
transform and its tensor-parallel styles (linears.py), its refusals (checks.py), what it adds to the plan
(plan.py), and with train.fp8_all_gather the scales precomputed after each update."""

from __future__ import annotations

from hpc_train.features.feature import Feature
from hpc_train.features.float8 import checks, plan
from hpc_train.features.float8.linears import PrecomputedScales, convert
from hpc_train.features.float8.options import Float8Options


def hooks(built, *, train: Float8Options) -> PrecomputedScales | None:
    return PrecomputedScales(built.chunks) if train.fp8_all_gather else None


FEATURE = Feature(
    name="float8",
    options={"train": Float8Options},
    enabled=plan.enabled,
    check=checks.check,
    transform=convert,
    hooks=hooks,
    memory=plan.memory,
    traffic=plan.traffic,
    activation_shape=plan.activation_shape,
)
