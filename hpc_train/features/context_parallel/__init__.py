"""Context parallelism (parallel.cp > 1): each sample's sequence split over the cp group, attention exchanging
keys and values around a ring or all-to-all (exchange.py, attention.py). Its key (options.py), its shape
refusals, and what it adds to the plan (plan.py)."""

from __future__ import annotations

import dataclasses

from hpc_train.config import ModelConfig, TrainConfig
from hpc_train.features.context_parallel import plan
from hpc_train.features.context_parallel.attention import ShardSequences, sequence_shard, split_attention
from hpc_train.features.context_parallel.options import ContextParallelOptions
from hpc_train.features.feature import Feature
from hpc_train.models.common.document_attention import document_tile
from hpc_train.models.spec import ActivationShape


def enabled(*, parallel: ContextParallelOptions) -> bool:
    return parallel.cp > 1


def check(*, model: ModelConfig, parallel: ContextParallelOptions) -> list[str]:
    """The sequence splits into equal shards (2 chunks per rank for the ring's zig-zag split), each further
    split over tp under sequence parallelism; Ulysses splits each tp rank's heads over cp."""
    p, problems = parallel, []
    if p.cp == 1:
        return []
    pieces = 2 * p.cp if p.cp_mode == "ring" else p.cp
    pieces *= p.tp if p.sequence_parallel else 1
    if model.seq_len % pieces:
        split = f"{2 * p.cp} chunks (ring: 2 per cp rank)" if p.cp_mode == "ring" else f"{p.cp} shards"
        problems.append(f"model.seq_len={model.seq_len} does not split into {split}"
                        f"{' x tp for sequence parallelism' if p.sequence_parallel else ''}: use a seq_len that is a "
                        f"multiple of {pieces}")  # fmt: skip
    heads = model.n_heads // p.tp if model.n_heads % p.tp == 0 else model.n_heads
    if p.cp_mode == "ulysses" and heads % p.cp:
        problems.append(f"parallel.cp_mode=ulysses splits each tp rank's {heads} heads (model.n_heads="
                        f"{model.n_heads} / parallel.tp={p.tp}) over parallel.cp={p.cp}: pick a cp dividing them, or "
                        "parallel.cp_mode=ring")  # fmt: skip
    return problems


def activation_shape(
    shape: ActivationShape, *, parallel: ContextParallelOptions, model: ModelConfig, train: TrainConfig
) -> ActivationShape:
    """Ulysses' SDPA keeps its output in head shards, beside the sequence shard the output projection reads
    (the ring's running output is that shard itself). With packed documents Ulysses' query tiles span the
    whole sequence, the ring's only its shard: their queries and keys."""
    if parallel.cp_mode == "ulysses":
        return dataclasses.replace(shape, core_output_copy=True)
    local = model.seq_len // parallel.cp
    tile = document_tile(train.micro_batch_size, local, local) if shape.document_tile else 0
    return dataclasses.replace(shape, document_tile=tile)


def hooks(built, *, parallel: ContextParallelOptions) -> ShardSequences:
    return ShardSequences(sequence_shard(built.mesh, parallel.cp_mode))


FEATURE = Feature(
    name="context_parallel",
    options={"parallel": ContextParallelOptions},
    enabled=enabled,
    check=check,
    transform=split_attention,
    hooks=hooks,
    activation_shape=activation_shape,
    memory=plan.memory,
    traffic=plan.traffic,
    step_time=plan.step_time,
)
