"""Bytes a rank sends per step, by process-group role (dp: the optimizer's strategy; cp, ep...: each
feature's own)."""

from __future__ import annotations

from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import JobConfig, block_policy, declared
from hpc_train.optim import optimizer_class, precision_policy
from hpc_train.optim.rules import rule_class
from hpc_train.planner.memory import compute_bytes, local_param_count


def dp_traffic_bytes(cfg: JobConfig, dims: ParallelDims, params: int, matrices: int = 0) -> float:
    """Bytes a rank sends over dp per step for `params` local elements by the optimizer's strategy (ring
    collectives: (dp-1)/dp of the buffer each). Stage 0: an fp32 all-reduce (reduce-scatter + all-gather).
    Stages 1-2: an fp32 reduce-scatter (stage 2: one per micro-batch) and an all-gather of the weights in
    their dtype. Stage 3's gathers and reduce-scatters are FSDP2's (features/fsdp). A rule that needs whole
    matrices (Muon) adds, where the state is sharded, an fp32 all-gather of the `matrices` elements'
    updates."""
    t, o, dp = cfg.train, cfg.optim, dims.dp * dims.cp
    if dp == 1:
        return 0.0
    ring = params * (dp - 1) / dp
    cls = optimizer_class(o)
    traffic = 0.0
    if o.zero_stage == 0:
        traffic = ring * 4 * 2
    elif not cls.shards_params:
        reduce_scatters = t.grad_accum if o.zero_stage == 2 else 1
        traffic = ring * (4 * reduce_scatters + precision_policy(cfg.train, cfg.optim).param_bytes)
    if rule_class(o).gathers_matrices and cls.shards_state:
        traffic += 4 * matrices * (dp - 1) / dp
    return traffic


def traffic(cfg: JobConfig, dims: ParallelDims) -> dict[str, float]:
    """Bytes a rank sends per step, by process-group role: dp (the optimizer's strategy, and what features
    add to it: FSDP2's gathers, float8's savings), cp, ep... (each feature's own)."""
    local = local_param_count(cfg)
    out = {"dp": dp_traffic_bytes(cfg, dims, local.trainable, local.trainable_matrices)}
    given = {"dims": dims, "local": local, "compute": compute_bytes(cfg), "block_policy": block_policy(cfg)}
    for _, sent in declared(cfg, "traffic", **given):
        for role, nbytes in sent().items():
            out[role] = out.get(role, 0.0) + nbytes
    return out
