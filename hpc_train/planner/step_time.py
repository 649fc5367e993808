"""The step-time estimate `plan --search` ranks layouts by: compute at a fixed fraction of peak, the
pipeline bubble, tp, dp and offload transfers over nominal links, and what each feature adds."""

from __future__ import annotations

import math

from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import bubble_fraction
from hpc_train.features.feature import Links
from hpc_train.job import JobConfig, block_policy, declared
from hpc_train.models import get_spec
from hpc_train.optim import optimizer_class
from hpc_train.optim.rules import rule_class
from hpc_train.planner.memory import activation_parts, local_param_count
from hpc_train.planner.traffic import traffic


def step_time_estimate(cfg: JobConfig, dims: ParallelDims, peak_flops: float, mfu: float = 0.4,
                       links: Links | None = None, host_adam_elements_per_s: float = 1e9) -> float:  # fmt: skip
    """A simple model to rank layouts: compute at `mfu` of peak (x4/3 with full recompute), the pipeline
    bubble (pp-1)/(m v), tp communication over NVLink, dp traffic over InfiniBand (`traffic`) less what
    overlaps backward (overlap_grad_reduce: the last micro-batch's backward, 2/3 of its compute; stage 3
    prefetches, so up to all of the compute), offload's real cost: the owned gradients to the host and the
    updated weights back over PCIe (stage 3: the parameter shards for every all-gather and the gradient
    shards of every reduce-scatter) and AdamW on the host cores of each rank, and what each feature that is
    on adds (context and expert parallelism's exchanges)."""
    m, p, t, o, dp = cfg.model, cfg.parallel, cfg.train, cfg.optim, dims.dp
    links = links or Links(gpus_per_node=cfg.slurm.gpus_per_node or 8)
    tokens = t.micro_batch_size * t.grad_accum * m.seq_len  # per dp rank (all its cp ranks)
    compute = tokens * dp * get_spec(m.arch).flops_per_token(m) / (dims.world_size * peak_flops * mfu)
    policy = block_policy(cfg)
    if policy(0) == "full":
        compute *= 4 / 3
    bubble = compute * bubble_fraction(p, t.grad_accum)
    elt = 2 if t.precision != "fp32" else 4
    tp_bytes = 0 if p.tp == 1 else 4 * m.n_layers / p.pp * tokens / p.cp * m.d_model * elt * (p.tp - 1) / p.tp
    dp_time = traffic(cfg, dims)["dp"] / (links.ib_gbps * 1e9)
    if optimizer_class(o).shards_params:  # FSDP prefetches
        dp_time = max(0.0, dp_time - compute)
    elif o.overlap_grad_reduce:
        dp_time = max(0.0, dp_time - 2 / 3 * compute / t.grad_accum)
    offload = 0.0
    if o.offload != "none":
        owned = math.ceil(local_param_count(cfg).trainable / (dp * dims.cp))
        transfers = owned * (4 + elt) if o.zero_stage < 3 else owned * 4 * 3 * t.grad_accum
        offload = transfers / (links.pcie_gbps * 1e9) + owned / host_adam_elements_per_s
    if o.offload == "nvme":  # + the state read and written (stage 3: the moments; Muon's stages 1-2 read and write
        # the masters again, after the matrices' updates are orthogonalized), over the node's disk shared by the
        # ranks on the node
        node = min(dims.world_size, links.gpus_per_node)
        per_element = (12 + 4 * rule_class(o).gathers_matrices) if o.zero_stage < 3 else 8
        offload += owned * per_element * 2 / (links.nvme_gbps * 1e9 / node)
    given = {"dims": dims, "links": links, "block_policy": policy, "flops_per_s": peak_flops * mfu,
             "parts": activation_parts(cfg)}  # fmt: skip
    features = sum(seconds() for _, seconds in declared(cfg, "step_time", **given))
    return compute + bubble + tp_bytes / (links.nvlink_gbps * 1e9) + dp_time + offload + features
