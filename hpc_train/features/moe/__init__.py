"""Training a mixture of experts (model.moe; the layer itself is the model family's, models/common/moe.py):
expert parallelism's sharding of the routed experts (expert_parallel.py; their optimizer: optim/experts.py),
the layers' statistics and DeepSeek-V3's routing-bias update after each step (stats.py), what MoE still
refuses, and what it adds to the plan (plan.py)."""

from __future__ import annotations

from hpc_train.config import ModelConfig, ParallelConfig
from hpc_train.features.feature import Feature
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.features.moe import plan
from hpc_train.features.moe.expert_parallel import shard_experts
from hpc_train.features.moe.stats import MoEStep


def enabled(*, model: ModelConfig, parallel: ParallelConfig) -> bool:
    return model.moe.num_experts > 0 or parallel.ep > 1


def check(*, model: ModelConfig, parallel: ParallelConfig, train, finetune: FinetuneConfig, dims) -> list[str]:
    """Expert parallelism's layout, and what MoE layers do not run with yet (`train`: regional compile's
    key): one line per problem."""
    experts, ep, dp = model.moe.num_experts, parallel.ep, dims.dp
    if ep > 1 and not experts:
        return [f"parallel.ep={ep} shards the routed experts of MoE layers, and this model is dense "
                "(model.moe.num_experts=0): set parallel.ep=1"]  # fmt: skip
    if not experts:
        return []
    layout = {
        f"parallel.ep={ep} must divide the data-parallel size {dp} (it is carved from dp): pick ep among the "
        f"divisors of {dp}, or more ranks": dp % ep,
        f"parallel.ep={ep} must divide model.moe.num_experts={experts} (each rank holds num_experts/ep): pick ep "
        f"among the divisors of {experts}": experts % ep,
    }
    problems = [problem for problem, refused in layout.items() if refused]
    unsupported = {
        "train.compile with model.moe.capacity_factor > 0": (
            train.compile and model.moe.capacity_factor > 0,
            "set train.compile=false, or model.moe.capacity_factor=0 (the dropped assignments change the compiled "
            "shapes every step)",
        ),
        f"finetune.method={finetune.method}": (finetune.quantized_base, "use finetune.method=lora or full"),
    }
    problems += [f"{key} is not supported with model.moe.num_experts={experts} yet: {fix}"
                 for key, (refused, fix) in unsupported.items() if refused]  # fmt: skip
    return problems


FEATURE = Feature(
    name="moe",
    enabled=enabled,
    check=check,
    transform=shard_experts,
    hooks=MoEStep,  # (a dense model with ep > 1 is refused)
    memory=plan.memory,
    traffic=plan.traffic,
    step_time=plan.step_time,
    describe=plan.describe,
)
