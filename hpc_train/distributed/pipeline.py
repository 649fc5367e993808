"""Pipeline parallelism with `torch.distributed.pipelining`.

The model is cut into pp x virtual_stages stages by its family's `build_stage` (embeddings on the first
stage; final norm, head and loss on the last). Rank r of the pipeline holds stages r, r + pp, r + 2pp, ...
(the looped placement of 1F1B, interleaved 1F1B and interleaved zero bubble), or stages r and 2pp - 1 - r
under the V-shaped schedules (ZBV, DualPipeV: the first rank holds both ends). A schedule fixes its
activation shapes on its first step, so it is built for one (micro-batch size, sequence length) and
rebuilt if they change.

The zero-bubble schedules split each backward into its input half (I: the gradient sent to the previous
stage) and its weight half (W), run later to fill the bubble. torch's W pass writes `.grad` itself, which
skips the post-accumulate-grad hooks the data-parallel strategies count gradients with (ZeRO-1's and
ZeRO-2's reductions from inside backward, ZeRO-2's fp32 accumulation); `SplitBackwardStage` runs it through
autograd's accumulation instead, so every strategy sees a W pass as it sees a full backward. It reads torch's
private state of the input pass (`backward_state`, `dw_runner`, the parameter groups keyed by each weight's
gradient accumulator), which changes between torch releases: what it cannot read, and a trainable weight
that no group reaches, stop the run with the torch version and the fix, never a weight left without its
gradient.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.device_mesh import DeviceMesh

from hpc_train.config import ConfigError, ParallelConfig
from hpc_train.config.schema import SPLIT_BACKWARD, V_SHAPED

# parallel.schedule -> torch's schedule class
SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in the order it runs their forwards."""
    if schedule in V_SHAPED and pp > 1:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def schedule_class(name: str) -> type:
    """torch's class for parallel.schedule `name` (imported here: `torch.distributed.pipelining` costs about a
    second of CPU at import, which the CLI's checks and the planner do not need unless they ask)."""
    from torch.distributed import pipelining

    return getattr(pipelining, SCHEDULES[name])


def _accumulator(p: torch.Tensor):
    """A leaf's gradient accumulator: the autograd node torch's weight groups are keyed by."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def split_backward_problem(detail: str) -> str:
    """The error of a split backward this torch cannot run as `SplitBackwardStage` reads it, with its fix."""
    return (f"parallel.schedule's split backward (interleaved_zb, zbv, dualpipev) {detail} with torch "
            f"{torch.__version__} (SplitBackwardStage reads torch.distributed.pipelining's private state): use a "
            "schedule without a split backward, parallel.schedule=1f1b or interleaved_1f1b")  # fmt: skip


def _weights_by_accumulator(submod: nn.Module) -> dict:
    """Each trainable weight of `submod` by its gradient accumulator: (its whole-model name, the weight)."""
    name_of = getattr(submod, "canonical_name", lambda name: name)
    return {_accumulator(p): (name_of(n), p) for n, p in submod.named_parameters() if p.requires_grad}


def _param_groups(state: object, stage: int) -> list[dict]:
    """The parameter groups the input pass kept (torch's `backward_state` entry: inputs, groups, outputs,
    output gradients), checked for what the weight pass reads of them."""
    groups = state[1] if isinstance(state, tuple) and len(state) == 4 else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and {"params", "intermediates"} <= g.keys()
                                               for g in groups):  # fmt: skip
        raise ConfigError(split_backward_problem(f"keeps no parameter groups of stage {stage}'s input pass"))
    return groups


def _check_grouped(weight_of: dict, param_groups: list[dict], stage: int) -> None:
    """Every trainable weight of the stage in a parameter group of its input pass, and nothing else: the weight
    pass computes the gradients of the grouped weights only, so one left out would silently get none."""
    grouped = {node for group in param_groups for node in group["params"]}
    if missing := [name for node, (name, _) in weight_of.items() if node not in grouped]:
        raise ConfigError(split_backward_problem(
            f"leaves {', '.join(missing)} of pipeline stage {stage} without a gradient: no parameter group of its "
            "input pass reaches them (e.g. FSDP2 resharded them after forward)"))  # fmt: skip
    if strangers := len(grouped - weight_of.keys()):
        raise ConfigError(split_backward_problem(
            f"groups {strangers} weights that are not pipeline stage {stage}'s trainable parameters"))  # fmt: skip


@functools.cache
def _split_backward_stage() -> type:
    from torch.distributed.pipelining import PipelineStage

    class SplitBackwardStage(PipelineStage):
        """A stage whose deferred weight pass accumulates through autograd (`torch.autograd.backward` from the
        saved gradient edges into the stage's parameters), so their post-accumulate-grad hooks fire as in a
        full backward. The first stage's W pass is torch's: a full backward, its input half being empty."""

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            if self.is_first or not self.has_backward:
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
            self.dw_runner.pop(bwd_chunk_id)
            param_groups = _param_groups(self.backward_state.pop(bwd_chunk_id), self.stage_index)
            weight_of = _weights_by_accumulator(self.submod)
            _check_grouped(weight_of, param_groups, self.stage_index)
            for group in param_groups:
                nodes, saved = group.pop("intermediates"), group.pop("grads", None)
                weights = [weight_of[node][1] for node in group["params"]]
                if saved is None or not weights:
                    continue
                # an intermediate that is another's descendant takes the gradient the input pass saved for it,
                # not that plus what flows in from the other: no gradient is counted twice
                pairs = list(zip(nodes, saved, strict=True))
                hooks = [node.register_prehook(lambda _, g=g: g) for node, g in pairs if g] if len(pairs) > 1 else []
                try:
                    edges = [(GradientEdge(node, i), grad) for node, grads in pairs
                             for i, grad in enumerate(grads or ()) if grad is not None]  # fmt: skip
                    if edges:
                        torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=weights)
                finally:
                    for hook in hooks:
                        hook.remove()

        # A V-shaped schedule's forward-only step (`eval`) still runs its backward actions, as no-ops, and then
        # hands the gradient they did not make to the adjacent stage on the same rank, which torch refuses:
        # in a step without backward there is nothing to hand on.
        def get_local_bwd_output(self, mb_index: int) -> tuple:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return SplitBackwardStage


def build_schedule(
    chunks: list[nn.Module],
    stages: list[int],
    parallel: ParallelConfig,
    micro_batches: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """One PipelineStage per local chunk and the configured schedule over `micro_batches`. `loss_fn`
    divides by the micro-batch count itself, so the schedule must not rescale the gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    num_stages = parallel.pp * parallel.virtual_stages
    group = pp_mesh.get_group()
    stage_cls = _split_backward_stage() if parallel.schedule in SPLIT_BACKWARD else PipelineStage
    pipeline_stages = [
        stage_cls(chunk, stage, num_stages, device, group=group) for chunk, stage in zip(chunks, stages, strict=True)
    ]
    if stage_cls is not PipelineStage and not all(isinstance(getattr(s, name, None), dict) for s in pipeline_stages
                                                  for name in ("backward_state", "dw_runner")):  # fmt: skip
        raise ConfigError(split_backward_problem("keeps no backward_state and dw_runner in its PipelineStage"))
    cls = schedule_class(parallel.schedule)
    options = {"n_microbatches": micro_batches, "loss_fn": loss_fn}
    if "scale_grads" in inspect.signature(cls).parameters:  # the releases that rescale by default
        options["scale_grads"] = False
    return cls(pipeline_stages[0] if cls is Schedule1F1B else pipeline_stages, **options)


# an action's cost in units of one stage's forward: a full backward is twice a forward, and each of its
# halves one (the zero-bubble paper's assumption, which its schedules are built for)
ACTION_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


@functools.lru_cache(maxsize=256)
def schedule_actions(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> tuple | None:
    """Per pipeline rank, the compute actions torch's schedule runs, in order, as (kind, stage, micro-batch),
    kind one of F (forward), B (full backward), I and W (its input and weight halves); DualPipeV's overlapped
    pairs as their two actions. None where torch lists no actions: for 1F1B (its one-stage schedules are
    listed for the first rank only) and before torch 2.8."""
    if schedule == "1f1b":
        return None
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(schedule_class(schedule), pp, micro_batches, virtual_stages)
    flat = lambda a: a.sub_actions if a.sub_actions else (a,)  # noqa: E731
    return tuple(
        tuple((x.computation_type.value, x.stage_index, x.microbatch_index) for a in rank if a for x in flat(a))
        for rank in ops
    )


def _simulate(actions: tuple) -> tuple[list[float], float]:
    """Each rank's busy time and the step's makespan when every action takes its ACTION_COST and starts as
    soon as its rank is free and its input is there: a forward after the previous stage's forward of the
    micro-batch, an input gradient after the next stage's (or the last stage's own forward), a weight half
    after its input half. Communication is free."""
    num_stages = 1 + max(stage for rank in actions for _, stage, _ in rank)
    key = {"F": "F", "I": "G", "B": "G", "W": "W"}  # G: the stage's input gradient is ready
    done: dict[tuple[str, int, int], float] = {}
    clock, busy, position = [0.0] * len(actions), [0.0] * len(actions), [0] * len(actions)
    while any(position[r] < len(rank) for r, rank in enumerate(actions)):
        moved = False
        for r, rank in enumerate(actions):
            while position[r] < len(rank):
                kind, stage, mb = rank[position[r]]
                if kind == "F":
                    deps = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind == "W":
                    deps = [("G", stage, mb)]
                else:
                    deps = [("F", stage, mb)] if stage == num_stages - 1 else [("G", stage + 1, mb)]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                clock[r] = done[(key[kind], stage, mb)] = start + ACTION_COST[kind]
                busy[r] += ACTION_COST[kind]
                position[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule actions wait on each other: {actions}")
    return busy, max(clock)


@functools.lru_cache(maxsize=256)
def _figures(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> tuple | None:
    """(each rank's busy time, the makespan, each rank's stage micro-batches held after each of its actions as
    (in flight, awaiting their weight half)) of the schedule's actions at min(m, 2pp) micro-batches, and m
    over that count; None where torch lists no actions. In flight: from a forward to its full backward, or to
    its weight half (torch's input half keeps the whole graph, retain_graph, for the weight half); awaiting:
    from an input half to its weight half (the first stage's input half computes nothing). From 2pp
    on, each schedule keeps the same fill and drain idle time and the same warmup (checked for interleaved
    1F1B, interleaved ZB, ZBV and DualPipeV at pp 2 to 8 and m up to 16pp; tests/test_pipeline_schedules.py),
    so longer steps need not be listed: torch takes seconds to list thousands of actions, and --search plans
    thousands of layouts. Where m is not a multiple of pp (interleaved ZB's rounds then differ) all m are."""
    listed = min(micro_batches, 2 * pp) if micro_batches % pp == 0 else micro_batches  # uneven rounds: as they are
    actions = schedule_actions(schedule, pp, listed, virtual_stages)
    if actions is None:
        return None
    busy, makespan = _simulate(actions)
    held = []
    for rank in actions:
        stages = sorted({stage for _, stage, _ in rank})
        live, awaiting, timeline = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), []
        for kind, stage, _ in rank:
            live[stage] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            awaiting[stage] += {"I": 1, "W": -1}.get(kind, 0) * (stage > 0)
            timeline.append((tuple(live.items()), tuple(awaiting.items())))
        held.append(tuple(timeline))
    return busy, makespan, tuple(held), micro_batches / listed


def bubble_fraction(parallel: ParallelConfig, micro_batches: int) -> float:
    """The idle share of a pipeline step relative to its compute, on the rank that idles most: from the
    schedule's own actions (`_figures`), else 1F1B's and interleaved 1F1B's formula (pp - 1) / (m v)."""
    if parallel.pp == 1:
        return 0.0
    figures = _figures(parallel.schedule, parallel.pp, micro_batches, parallel.virtual_stages)
    if figures is None:
        return (parallel.pp - 1) / (micro_batches * parallel.virtual_stages)
    busy, makespan, _, scale = figures
    return max((makespan - b) / (b * scale) for b in busy)


def in_flight_chunks(parallel: ParallelConfig, micro_batches: int, pp_rank: int) -> int | None:
    """The most stage micro-batches whose activations pipeline rank `pp_rank` holds at once, from the
    schedule's actions (`_figures`). None where torch cannot list them."""
    figures = _figures(parallel.schedule, parallel.pp, micro_batches, parallel.virtual_stages)
    return None if figures is None else max(sum(n for _, n in live) for live, _ in figures[2][pp_rank])


def held_at_peak(
    parallel: ParallelConfig, micro_batches: int, pp_rank: int, kept: dict[int, float], awaiting: dict[int, float]
) -> tuple[float, float] | None:
    """Bytes pipeline rank `pp_rank` holds for backward at its peak, from the schedule's actions: its
    activations (`kept`: what a micro-batch keeps on each local stage, times its micro-batches in flight
    after each action; the stages of a V differ), and what gradients awaiting their weight halves
    (`awaiting`: a micro-batch's on each stage) add to that peak at theirs. None where torch cannot list
    them."""
    if parallel.pp == 1:
        return None
    figures = _figures(parallel.schedule, parallel.pp, micro_batches, parallel.virtual_stages)
    if figures is None:
        return None
    held = [(sum(n * kept[s] for s, n in live), sum(n * awaiting[s] for s, n in waiting))
            for live, waiting in figures[2][pp_rank]]  # fmt: skip
    peak = max(activations for activations, _ in held)
    return peak, max(activations + grads for activations, grads in held) - peak
