"""What mixture-of-experts training adds to the planner: expert parallelism's all-to-all bytes per step, the
rows it holds while an MoE layer runs, their time, and the report's lines (parameters, active per token)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpc_train.config import ModelConfig, ParallelConfig, TrainConfig
from hpc_train.features.feature import Links, Memory, forward_passes
from hpc_train.models import get_spec
from hpc_train.models.common.moe import is_moe_layer, moe_layers

GiB = 2**30


def ep_rows(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> int:
    """Rows one MoE layer dispatches per micro-batch on a rank: its tokens' top_k assignments (its slice of the
    sequence under context and sequence parallelism; dropless: a capacity factor's drops are not counted, so
    this is its upper bound)."""
    split = parallel.cp * (parallel.tp if parallel.sequence_parallel else 1)
    return train.micro_batch_size * model.seq_len // split * model.moe.top_k


def _element_bytes(train: TrainConfig) -> int:
    return 2 if train.precision != "fp32" else 4


def traffic(*, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
            block_policy: Callable[[int], str]) -> dict[str, float]:  # fmt: skip
    """Bytes a rank sends over ep per step: in each MoE layer and micro-batch, the rows for experts held
    elsewhere, (ep-1)/ep of them when the load is balanced (exactly so when every token picks every expert),
    in the compute dtype, through four all-to-alls (dispatch and combine, and their gradients back; a block
    recomputed whole exchanges again in backward), and the tokens-per-expert counts (int64) before each
    dispatch. The MoE layers of the whole model over pp (a stage's own share can differ)."""
    if parallel.ep == 1:
        return {}
    others = (parallel.ep - 1) / parallel.ep
    moe_ids = [i for i in range(model.n_layers) if is_moe_layer(model, i)]
    per_stage = model.n_layers // (parallel.pp * parallel.virtual_stages)
    forwards = forward_passes(block_policy, moe_ids, per_stage, ("full",))  # selective re-runs attention only
    rows = ep_rows(model, parallel, train) * model.d_model * _element_bytes(train) * others * 2
    rows *= forwards + len(moe_ids)
    counts = 8 * model.moe.num_experts * others * forwards
    return {"ep": (rows + counts) / parallel.pp * train.grad_accum}


def memory(*, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, parts) -> Memory:
    """What expert parallelism adds while an MoE layer runs (balanced load): the rows received from the ep
    group and their copy regrouped by expert, in the compute dtype. In backward they live while the routed
    experts' backward runs, after the block's output gradient has passed the shared experts and FSDP's
    gathers for the block are done: in place of the MLP's working set the family counts for a block's
    backward (`parts.block_backward`), not on top of it (measured on CPU: the step's peak never holds them)."""
    if parallel.ep == 1:
        return Memory()
    buffers = 2 * ep_rows(model, parallel, train) * model.d_model * _element_bytes(train)
    return Memory(working=max(0, buffers - parts.block_backward))


def step_time(*, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, links: Links,
              block_policy: Callable[[int], str]) -> float:  # fmt: skip
    """Expert parallelism within a node over NVLink, else InfiniBand; the all-to-alls wait for the experts."""
    sent = traffic(model=model, parallel=parallel, train=train, block_policy=block_policy).get("ep", 0.0)
    return sent / links.within_node(parallel.tp * parallel.ep)


def moe_param_counts(model: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of the whole model with MoE blocks: a token goes through top_k of each
    layer's routed experts (counted on the meta device)."""
    with torch.device("meta"):
        whole = get_spec(model.arch).build_stage(model)
    total = sum(p.numel() for p in whole.parameters())
    moe = model.moe
    routed = sum(p.numel() for _, layer in moe_layers([whole]) for p in layer.experts.parameters())
    return total, total - routed * (moe.num_experts - moe.top_k) // moe.num_experts


def describe(*, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
             block_policy: Callable[[int], str]) -> list[str]:  # fmt: skip
    total, active = moe_param_counts(model)
    moe = model.moe
    lines = [f"mixture of experts: {total / 1e9:.3f}B parameters, {active / 1e9:.3f}B active per token "
             f"({moe.top_k} of {moe.num_experts} routed experts)"]  # fmt: skip
    if train.fp8 != "off":
        lines.append(f"train.fp8={train.fp8}: float8 in the attention, dense and shared-expert projections; the "
                     f"routed experts' grouped GEMM in {train.precision} (no float8 grouped GEMM yet)")  # fmt: skip
    if parallel.ep > 1:
        sent = traffic(model=model, parallel=parallel, train=train, block_policy=block_policy)["ep"]
        lines.append(f"expert parallelism ep={parallel.ep}: {moe.num_experts // parallel.ep} routed experts per rank, "
                     f"{sent / GiB:.3f} GiB sent per rank and step by all-to-all")  # fmt: skip
    return lines
