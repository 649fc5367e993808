"""`plan --search`: every layout of a world that passes validation, with its memory and estimated step
time, those that fit first, fastest first; and the nearest layout that fits where the config's does not."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from hpc_train.config import ConfigError
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import JobConfig, check_run
from hpc_train.optim import NVME, OPTIMIZERS
from hpc_train.planner.memory import GiB, MemoryEstimate, estimate
from hpc_train.planner.step_time import step_time_estimate

LONG_SEQUENCE = 8192  # `plan --search` tries context parallelism from this model.seq_len on
RECOMPUTE = ("none", "selective", "full")  # model.recompute's choices, which `plan --search` tries
LOW_BIT_FALLBACK = {"adamw": ("adamw8bit", "adamw4bit")}  # what `search` tries where a rule's state does not fit
NODE_DISK = "$SLURM_TMPDIR/hpc_train_offload"  # where a searched nvme layout keeps its state: the node's own disk
# step-time estimates this close to the fastest's tie: the estimate's own error (a fixed MFU, no kernel or
# network measured) is larger than that
TIE = 0.05


@dataclass(frozen=True)
class Limits:
    """What a layout of `world` ranks must fit: `gpu_mem` bytes a GPU and, where given, `host_mem` bytes a
    node, which the node's ranks (`node` a node at most) share."""

    world: int
    gpu_mem: float
    host_mem: float | None = None
    node: int = 8

    def over(self, total: float, host: float) -> float:
        """How far a rank's `total` device bytes and `host` bytes are from fitting: their largest ratio to
        what they must fit in (1 or less: it fits)."""
        node_host = host * min(self.world, self.node)
        return max(total / self.gpu_mem, node_host / self.host_mem if self.host_mem else 0.0)

    def fits(self, plan: MemoryEstimate) -> bool:
        host = (plan.host + plan.host_copy) * min(self.world, self.node)
        return plan.total <= self.gpu_mem and (self.host_mem is None or host <= self.host_mem)

    def row_over(self, row: dict) -> float:
        return self.over(row["total_gib"] * GiB, row["host_gib"] * GiB)


def layout_settings(cfg: JobConfig, layout: dict) -> dict[str, object]:
    """The config keys that give `cfg` a `search` row's layout, with their values. dp and the global batch
    follow from the world; sequence parallelism (on with tp) and the cp mode are set only where they act
    (tp > 1, cp > 1); nvme offload goes to the node's own disk unless the config names a directory."""
    settings: dict[str, object] = {"parallel.tp": layout["tp"]}
    if layout["tp"] > 1:
        settings["parallel.sequence_parallel"] = True
    settings |= {"parallel.pp": layout["pp"], "parallel.virtual_stages": layout["vp"],
                 "parallel.schedule": layout["schedule"], "parallel.cp": layout["cp"]}  # fmt: skip
    if layout["cp"] > 1:
        settings["parallel.cp_mode"] = layout["cp_mode"]
    settings |= {"parallel.dp": None, "train.micro_batch_size": layout["mbs"], "train.grad_accum": layout["grad_accum"],
                 "train.global_batch_size": None, "model.recompute": layout["recompute"],
                 "optim.zero_stage": layout["zero"], "optim.offload": layout["offload"]}  # fmt: skip
    if layout["offload"] == "nvme" and not cfg.optim.offload_dir:
        settings["optim.offload_dir"] = NODE_DISK
    settings["optim.name"] = layout["optim"]
    return settings


def with_settings(cfg: JobConfig, settings: dict[str, object]) -> JobConfig:
    """`cfg` with `settings` (`section.key`: value): the sections they set copied, the others shared (the checks
    and the plan only read them)."""
    from copy import copy

    c = copy(cfg)
    for section in {key.split(".")[0] for key in settings}:
        setattr(c, section, copy(getattr(cfg, section)))
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    return c


def overrides(cfg: JobConfig, settings: dict[str, object]) -> list[str]:
    """The `key=value` arguments that give `settings` from `cfg`: the keys whose value differs, as YAML spells
    the value."""
    spelled = {None: "null", True: "true", False: "false"}
    return [f"{key}={spelled.get(value, value) if isinstance(value, bool | None) else value}"
            for key, value in settings.items() if functools.reduce(getattr, key.split("."), cfg) != value]  # fmt: skip


def _row(c: JobConfig, dims: ParallelDims, plan: MemoryEstimate, fits: bool, peak_flops: float,
         changed: list[str]) -> dict:  # fmt: skip
    """A layout as `search` lists it: its settings, its memory, whether it fits, its estimated step time and the
    overrides (`changed`) that give it from the config searched."""
    p, t, o = c.parallel, c.train, c.optim
    return {
        "tp": p.tp, "pp": p.pp, "vp": p.virtual_stages, "schedule": p.schedule, "dp": dims.dp, "cp": p.cp,
        "cp_mode": p.cp_mode, "mbs": t.micro_batch_size, "grad_accum": t.grad_accum, "recompute": c.model.recompute,
        "zero": o.zero_stage, "offload": o.offload, "optim": o.name,
        "total_gib": plan.total / GiB, "host_gib": (plan.host + plan.host_copy) / GiB, "disk_gib": plan.disk / GiB,
        "fits": fits, "step_s": step_time_estimate(c, dims, peak_flops), "overrides": changed,
    }  # fmt: skip


def search(cfg: JobConfig, world: int, gpu_mem_bytes: float, peak_flops: float,
           host_mem_bytes: float | None = None, rule_change: bool = True) -> list[dict]:  # fmt: skip
    """Every layout of `world` ranks (tp within a node of slurm.gpus_per_node or 8, pp, virtual stages and
    schedule, micro-batch size at a fixed global batch, recompute, zero stage, offload: none, cpu, nvme)
    that passes validation, with its memory, estimated step time and the overrides that give it from `cfg`;
    those that fit first, fastest first, each marked `tie` where its estimate is within TIE of the fastest's.
    With `host_mem_bytes` (a node's), a layout fits only where its node's ranks' host memory does too: so
    nvme offload, slower than cpu, comes first where cpu offload's state does not fit the host. A layout
    whose AdamW state does not fit is tried with 8-bit, then 4-bit moments (`LOW_BIT_FALLBACK`): with
    `rule_change`, the first that fits is its row; without, the row keeps the config's rule and `fits_with`
    names the low-bit rule that would fit."""
    t = cfg.train
    # the config's micro-batches per dp rank at `world` (at least one dp rank, where its own layout is larger)
    own_dp = max(1, world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp))
    global_batch = t.micro_batch_size * t.grad_accum * own_dp
    limits = Limits(world, gpu_mem_bytes, host_mem_bytes, cfg.slurm.gpus_per_node or 8)
    choices = itertools.product(
        [x for x in (1, 2, 4, 8) if x <= limits.node],  # tp
        (1, 2, 4, 8, 16),  # pp
        # (virtual stages, schedule) at pp > 1
        ((1, "1f1b"), (2, "interleaved_1f1b"), (2, "interleaved_zb"), (2, "zbv"), (2, "dualpipev")),
        (1, 2, 4, 8),  # micro-batch size
        RECOMPUTE,
        [
            (zero, offload)
            for zero, cls in OPTIMIZERS.items()
            for offload in ("none", "cpu", "nvme")[: (1 + cls.shards_state + (zero in NVME))]
        ],  # fmt: skip
        # context parallelism for long sequences (activations / cp)
        [(1, "ring")]
        + [
            (cp, mode) for cp in (2, 4, 8) for mode in ("ring", "ulysses") if cfg.model.seq_len >= LONG_SEQUENCE
        ],  # fmt: skip
    )
    rows = []
    for tp, pp, (vp, schedule), mbs, recompute, (zero, offload), (cp, cp_mode) in choices:
        if world % (tp * pp * cp) or (vp > 1 and pp == 1) or global_batch % (mbs * (world // (tp * pp * cp))):
            continue
        dp = world // (tp * pp * cp)
        layout = {"tp": tp, "pp": pp, "vp": vp, "schedule": schedule, "cp": cp, "cp_mode": cp_mode, "mbs": mbs,
                  "grad_accum": global_batch // (mbs * dp), "recompute": recompute, "zero": zero, "offload": offload,
                  "optim": cfg.optim.name}  # fmt: skip
        settings = layout_settings(cfg, layout)
        c = with_settings(cfg, settings)
        try:
            dims = check_run(c, world, check_paths=False)
        except ConfigError:
            continue
        plan, fits_with = estimate(c, dims), None
        for rule in LOW_BIT_FALLBACK.get(cfg.optim.name, ()) if not limits.fits(plan) and offload != "nvme" else ():
            low_bit = estimate(with_settings(c, {"optim.name": rule}), dims)
            if limits.fits(low_bit):
                fits_with = rule
                break
        if fits_with and rule_change:
            settings["optim.name"], plan, fits_with = fits_with, low_bit, None
            c = with_settings(cfg, settings)
        row = _row(c, dims, plan, limits.fits(plan), peak_flops, overrides(cfg, settings))
        rows.append({**row, "fits_with": fits_with})
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["total_gib"]))
    fastest = rows[0]["step_s"] if rows and rows[0]["fits"] else 0.0
    for row in rows:
        row["tie"] = row["fits"] and row["step_s"] <= fastest * (1 + TIE)
    return rows


def search_report(cfg: JobConfig, world: int, gpu_mem_bytes: float, peak_flops: float,
                  host_mem_bytes: float | None = None, rule_change: bool = False) -> dict:  # fmt: skip
    """`hpc-train plan --search`'s answer: every layout `search` finds (`rows`), how many fit, the config's own
    layout at `world` ranks (`own`: its rank among those that fit, `error` where it is not valid there), and,
    where nothing fits (the config's own layout neither), the nearest fix (`fix`, `search_fix`). Without
    `rule_change` the config's update rule is kept (a low-bit one changes the numerics); `fit_with_rule_change`
    counts the layouts that fit only with one (with it: the layouts that fit with one)."""
    limits = Limits(world, gpu_mem_bytes, host_mem_bytes, cfg.slurm.gpus_per_node or 8)
    rows = search(cfg, world, gpu_mem_bytes, peak_flops, host_mem_bytes, rule_change)
    fitting = [r for r in rows if r["fits"]]
    changed_rule = sum(r["fits_with"] is not None for r in rows) if not rule_change else \
        sum(r["fits"] and r["optim"] != cfg.optim.name for r in rows)  # fmt: skip
    try:
        dims = check_run(cfg, world, check_paths=False)
    except ConfigError as err:
        own = {"error": str(err)}
    else:
        plan = estimate(cfg, dims)
        own = _row(cfg, dims, plan, limits.fits(plan), peak_flops, [])
        if own["fits"]:
            own["rank"] = 1 + sum(r["step_s"] < own["step_s"] for r in fitting)
            own["tie"] = not fitting or own["step_s"] <= fitting[0]["step_s"] * (1 + TIE)
    return {"world": world, "node": limits.node, "gpu_mem_gib": gpu_mem_bytes / GiB,
            "host_mem_gib": host_mem_bytes / GiB if host_mem_bytes else None, "searched": len(rows),
            "fit": len(fitting), "ties": sum(r["tie"] for r in rows), "tie_within": TIE, "rule_change": rule_change,
            "fit_with_rule_change": changed_rule, "own": own,
            "fix": None if fitting or own.get("fits") else search_fix(cfg, rows, limits, peak_flops),
            "rows": rows}  # fmt: skip


def search_fix(cfg: JobConfig, rows: list[dict], limits: Limits, peak_flops: float) -> dict:
    """Where no layout fits: the one closest to fitting (`closest`, `over`: its ratio to the limit it exceeds
    most) and what would fit it: a GPU (`gpu_mem_gib`) or a node's host memory (`host_mem_gib`) that large, or
    more ranks (`more_ranks`, `_at_more_ranks`, or None). Every recompute choice, zero stage and offload was
    searched."""
    if not rows:
        return {"closest": None}
    closest = min(rows, key=lambda r: (limits.row_over(r), r["step_s"]))
    node_host = closest["host_gib"] * min(limits.world, limits.node)
    return {
        "closest": closest, "over": limits.row_over(closest),
        "gpu_mem_gib": math.ceil(closest["total_gib"]) if closest["total_gib"] * GiB > limits.gpu_mem else None,
        "host_mem_gib": math.ceil(node_host) if limits.host_mem and node_host * GiB > limits.host_mem else None,
        "more_ranks": _at_more_ranks(cfg, closest, limits, peak_flops),
    }  # fmt: skip


def _at_more_ranks(cfg: JobConfig, row: dict, limits: Limits, peak_flops: float) -> dict | None:
    """`row`'s layout on 2, 4 or 8 times the ranks, the extra ones tensor-parallel (within a node), pipeline or
    data-parallel (the global batch kept: fewer micro-batches each): the first that fits, with its `world`
    (of the fewest ranks, the fastest); None where none does."""
    for times in (2, 4, 8):
        more, found = dataclasses.replace(limits, world=limits.world * times), []
        wider = [{"tp": row["tp"] * times}] if row["tp"] * times <= limits.node else []
        deeper = [{"grad_accum": row["grad_accum"] // times}] if row["grad_accum"] % times == 0 else []
        for change in [*wider, {"pp": row["pp"] * times}, *deeper]:
            if fitting := _fitting_row(cfg, layout_settings(cfg, {**row, **change}), more, peak_flops):
                found.append({**fitting, "world": more.world})
        if found:
            return min(found, key=lambda r: r["step_s"])
    return None


def nearest_fix(cfg: JobConfig, limits: Limits, peak_flops: float) -> dict | None:
    """For a config whose layout does not fit: the fewest changes of its recompute choice, zero stage and cpu
    offload (its tp, pp and batch kept) that fit, the fastest of those; None where none does."""
    found = []
    for recompute, zero, offload in itertools.product(RECOMPUTE, OPTIMIZERS, ("none", "cpu")):
        settings = {"model.recompute": recompute, "optim.zero_stage": zero, "optim.offload": offload}
        if overrides(cfg, settings) and (fitting := _fitting_row(cfg, settings, limits, peak_flops)):
            found.append(fitting)
    return min(found, key=lambda r: (len(r["overrides"]), r["step_s"]), default=None)


def _fitting_row(cfg: JobConfig, settings: dict, limits: Limits, peak_flops: float) -> dict | None:
    """The row of `cfg` changed by `settings` at `limits.world`, where that layout is valid there and fits;
    None otherwise."""
    c = with_settings(cfg, settings)
    try:
        dims = check_run(c, limits.world, check_paths=False)
    except ConfigError:
        return None
    plan = estimate(c, dims)
    return _row(c, dims, plan, True, peak_flops, overrides(cfg, settings)) if limits.fits(plan) else None
