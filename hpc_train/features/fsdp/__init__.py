"""ZeRO-3 with FSDP2 (optim.zero_stage=3): the stage sharded over dp x cp (sharding.py), its options' rules,
the all-gather buffers and dp traffic it adds to the plan (plan.py). The update itself is the optimizer's
(optim/fsdp.py: the rule over FSDP2's sharded parameters)."""

from __future__ import annotations

from hpc_train.config import ModelConfig, OptimConfig, ParallelConfig
from hpc_train.config.schema import SPLIT_BACKWARD, V_SHAPED
from hpc_train.features.feature import Feature
from hpc_train.features.fsdp import plan
from hpc_train.features.fsdp.sharding import Reshard, reshards_after_forward, shard
from hpc_train.optim import optimizer_class


def enabled(*, optim: OptimConfig) -> bool:
    return optimizer_class(optim).shards_params


def check(*, optim: OptimConfig, parallel: ParallelConfig, model: ModelConfig, dims, spec) -> list[str]:
    """Options that only one side of ZeRO-3 (FSDP2) has; it shards over dp x cp; what torch's split-backward
    pipeline schedules cannot run with it."""
    if not enabled(optim=optim):
        return ["optim.reshard_after_forward is for optim.zero_stage=3 (FSDP2): drop it"] * (
            optim.reshard_after_forward is not None
        )
    if dims.dp * dims.cp == 1 and optim.offload == "none":  # with offload: the one-GPU case, its shards on the host
        return ["optim.zero_stage=3 shards over dp x cp, and dp x cp=1 here: use optim.zero_stage=1, more ranks, or "
                "optim.offload=cpu or nvme (the parameters and gradients in host memory, each block's weights "
                "copied to the device as it runs)"]  # fmt: skip
    if optim.overlap_grad_reduce:
        return ["optim.overlap_grad_reduce is for zero stages 0-2 (FSDP2 always reduces in backward): drop it with "
                "optim.zero_stage=3"]  # fmt: skip
    return _pipeline_problems(optim, parallel, model, dims, spec) if parallel.pp > 1 else []


def _pipeline_problems(optim: OptimConfig, parallel: ParallelConfig, model: ModelConfig, dims, spec) -> list[str]:
    """A split backward's weight half finds a stage's weights through the graph its input half kept: a block
    resharded after forward has left it (its weights would get no gradient). A V's first rank holds the
    tied head and embedding as one parameter, which FSDP2 replaces with a copy where its dim-0 shard is
    padded: the input embedding would stop training on that rank."""
    problems = []
    if parallel.schedule in SPLIT_BACKWARD and reshards_after_forward(optim, parallel):
        problems.append(f"optim.reshard_after_forward=true with parallel.schedule={parallel.schedule}: its weight half "
                        "would find no block weights (resharded after forward); set optim.reshard_after_forward=false "
                        "(the default with pipeline parallelism)")  # fmt: skip
    rows, shards = spec.padded_vocab_size(model, dims.tp) // dims.tp, dims.dp * dims.cp
    if parallel.schedule in V_SHAPED and spec.ties_embeddings(model) and rows % shards:
        problems.append(f"parallel.schedule={parallel.schedule} with tied embeddings and optim.zero_stage=3 needs the "
                        f"embedding's {rows} rows a tp rank to split evenly over dp x cp = {shards}: set "
                        f"model.vocab_multiple to a multiple of {shards}, or parallel.schedule="
                        "interleaved_zb")  # fmt: skip
    return problems


FEATURE = Feature(
    name="fsdp",
    enabled=enabled,
    check=check,
    transform=shard,
    hooks=lambda built: Reshard(built.chunks),
    memory=plan.memory,
    traffic=plan.traffic,
)
