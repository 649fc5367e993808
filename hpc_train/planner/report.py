"""What `hpc-train plan` prints: a layout's estimate, the search's table, the nearest fix."""

from __future__ import annotations

import math
import shlex
import textwrap

from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import JobConfig, block_policy, declared
from hpc_train.planner.memory import GiB, MemoryEstimate, activation_parts, local_param_count


def plan_world(cfg: JobConfig) -> int:
    """The world the plan is for: the Slurm job's ranks on a GPU layout, else the local processes."""
    return cfg.slurm.nodes * cfg.slurm.tasks_per_node if cfg.slurm.gpus_per_node else cfg.parallel.nproc


def feature_lines(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    """What each of the run's features says of it (its `describe`): in `hpc-train plan`'s report and in a
    run's start-up lines."""
    given = {"dims": dims, "local": local_param_count(cfg), "block_policy": block_policy(cfg),
             "parts": activation_parts(cfg)}  # fmt: skip
    return [line for _, describe in declared(cfg, "describe", **given) for line in describe()]


def format_estimate(cfg: JobConfig, dims: ParallelDims, plan: MemoryEstimate, gpu_mem_bytes: float) -> str:
    p, dp = cfg.parallel, dims.dp
    rows = [
        ("parameters", plan.params), ("gradients", plan.grads), ("optimizer state", plan.optimizer),
        (f"activations ({plan.microbatches_in_flight} micro-batch(es) in flight)", plan.activations),
        ("communication buffers (the most at once)", plan.comm_buffers),
        ("loss backward (one chunk, transient)", plan.loss_backward),
        ("a block's backward (transient)", plan.block_backward),
        *([("weights' casts (autocast's, the step's)", plan.weight_casts)] if plan.weight_casts else []),
        ("total at the peak", plan.total),
    ]  # fmt: skip
    cp = f" cp={p.cp} ({p.cp_mode})" if p.cp > 1 else ""
    ep = f" ep={p.ep}" if p.ep > 1 else ""
    head = (f"layout tp={p.tp} pp={p.pp} (x{p.virtual_stages} virtual) dp={dp}{cp}{ep}, micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.model.seq_len}, recompute={cfg.model.recompute}, "
            f"zero={cfg.optim.zero_stage}, offload={cfg.optim.offload}, {cfg.train.precision}")  # fmt: skip
    lines = [head, *feature_lines(cfg, dims)]
    stage = f" (worst stage: {plan.stage} of {plan.stages}, pipeline ranks from 0)" if plan.stages > 1 else ""
    lines.append(f"per rank{stage}:")
    lines += [f"  {name:<44} {value / GiB:10.3f} GiB" for name, value in rows]
    if plan.host > plan.host_features:
        what = "optimizer state, parameters, gradients" if plan.params == 0 else "optimizer state, owned gradients"
        if plan.disk:
            what = "parameters, gradients, nvme buffers" if plan.params == 0 else "the nvme offload's buffers"
        lines.append(f"  {f'in host memory ({what})':<44} {(plan.host - plan.host_features) / GiB:10.3f} GiB")
    if plan.host_copy:
        lines.append(f"  {'in host memory (the state copy)':<44} {plan.host_copy / GiB:10.3f} GiB")
    if plan.disk:
        lines.append(f"  {'on the node disk (optimizer state)':<44} {plan.disk / GiB:10.3f} GiB")
    if plan.host_features:  # each feature's line above says what
        lines.append(f"  {'in host memory (the features above)':<44} {plan.host_features / GiB:10.3f} GiB")
    verdict = "fits" if plan.total <= gpu_mem_bytes else "DOES NOT FIT"
    lines.append(f"  {verdict} in {gpu_mem_bytes / GiB:g} GiB per GPU ({100 * plan.total / gpu_mem_bytes:.0f}%)")
    return "\n".join(lines)


def describe_layout(row: dict) -> str:
    """A `search` row's layout in a few words, as `format_estimate`'s head line names one."""
    pipeline = f" (x{row['vp']} {row['schedule']})" if row["pp"] > 1 else ""
    cp = f" cp={row['cp']} ({row['cp_mode']})" if row["cp"] > 1 else ""
    return (f"tp={row['tp']} pp={row['pp']}{pipeline} dp={row['dp']}{cp}, mbs {row['mbs']} x accum "
            f"{row['grad_accum']}, recompute={row['recompute']}, zero={row['zero']}, offload={row['offload']}, "
            f"{row['optim']}")  # fmt: skip


def shell_overrides(row: dict) -> str:
    """A row's overrides as a shell takes them (a `$VAR` left for the job's node to expand)."""
    return " ".join(shlex.quote(item) for item in row["overrides"]) or "(the config's own layout)"


def format_search(rows: list[dict], limit: int = 20) -> str:
    """The first `limit` rows that fit, ranked (#); a disk column where one of them offloads to nvme."""
    shown = [r for r in rows if r["fits"]][:limit]
    disk = any(r["disk_gib"] for r in shown)
    head = f"{'#':>4} {'~':>1} {'tp':>3} {'pp':>3} {'vp':>3} {'schedule':>16} {'dp':>4} {'cp':>8} {'mbs':>4} " \
           f"{'accum':>6} {'recompute':>10} {'zero':>5} {'offload':>8} {'optim':>10} {'GiB/rank':>9} " \
           f"{'host GiB':>9} {'disk GiB' if disk else '':>{9 * disk}}{' ' * disk}{'step s':>9}  overrides"  # fmt: skip
    lines = [head]
    for rank, r in enumerate(shown, 1):
        cp = f"{r['cp']} {r['cp_mode']}" if r["cp"] > 1 else "1"
        on_disk = f"{r['disk_gib']:>9.2f} " if disk else ""
        lines.append(f"{rank:>4} {'~' if r['tie'] else '':>1} {r['tp']:>3} {r['pp']:>3} {r['vp']:>3} "
                     f"{r['schedule']:>16} {r['dp']:>4} {cp:>8} {r['mbs']:>4} {r['grad_accum']:>6} "
                     f"{r['recompute']:>10} {r['zero']:>5} {r['offload']:>8} {r['optim']:>10} "
                     f"{r['total_gib']:>9.2f} {r['host_gib']:>9.2f} {on_disk}{r['step_s']:>9.4g}  "
                     f"{shell_overrides(r)}")  # fmt: skip
    return "\n".join(lines)


def format_report(report: dict, limit: int = 20) -> str:
    """`search_report` for a reader: what was searched and what fits, the config's own layout, the ties and the
    fastest layouts that fit (`format_search`) with a legend; or, where none fits, the nearest fix
    (`format_search_fix`)."""
    rows, fit, changed = report["rows"], report["fit"], report["fit_with_rule_change"]
    host = f" and {report['host_mem_gib']:g} GiB of host a node" if report["host_mem_gib"] else ""
    shown = f"; the {min(limit, fit)} fastest below (--json lists all)" if fit else ""
    lines = [f"{_ranks(report['world'])}, {report['gpu_mem_gib']:g} GiB per GPU{host}: {report['searched']} layouts "
             f"searched, {fit or 'none'} fit{shown}", _own_line(report)]  # fmt: skip
    if report["fix"]:
        return "\n".join([*lines, format_search_fix(report)])
    if not fit:  # the config's own layout fits, outside what was searched
        return "\n".join(lines)
    ties = [(rank, r) for rank, r in enumerate(rows, 1) if r["tie"]]
    rank, fewest = min(ties, key=lambda tie: (len(tie[1]["overrides"]), tie[0]))
    lines.append(f"{len(ties)} layout(s) tie with the fastest (~: within {report['tie_within']:.0%} of its "
                 f"estimate); of those, the fewest changes: #{rank}, {shell_overrides(fewest)}")  # fmt: skip
    if changed and not report["rule_change"]:
        lines.append(f"{changed} layout(s) that fit only with 8-bit or 4-bit AdamW moments are left out: they "
                     "change the update's numerics (--allow-rule-change lists them)")  # fmt: skip
    elif changed:
        lines.append(f"{changed} of the layouts that fit change the update rule (their overrides set optim.name)")
    lines.append(format_search(rows, limit))
    on_disk = any(r["disk_gib"] for r in [r for r in rows if r["fits"]][:limit])
    disk = " disk GiB: optimizer state a rank keeps on its node's own disk (optim.offload=nvme);" * on_disk
    legend = (f"legend: #: rank by estimated step time; ~: a tie, within {report['tie_within']:.0%} of the "
              "fastest's estimate, less than the estimate's error (choose among ties by memory or by fewer "
              "changes); GiB/rank: device memory of the rank that needs the most; host GiB: host memory a rank "
              f"(offloaded state, the state copy);{disk} step s: estimated seconds a step (compute at 40% MFU, "
              "the pipeline bubble, tp and dp traffic, offload); overrides: the key=value arguments that give the "
              "layout from this config")  # fmt: skip
    return "\n".join([*lines, *textwrap.wrap(legend, 118, subsequent_indent="  ")])


def _ranks(world: int) -> str:
    return f"{world} rank{'s' * (world != 1)}"


def _own_line(report: dict) -> str:
    """Where the config's own layout stands among those searched."""
    own, fit, world = report["own"], report["fit"], report["world"]
    if "error" in own:
        return f"the config's layout: not valid at {_ranks(world)}: {own['error'].splitlines()[0]}"
    head = f"the config's layout ({describe_layout(own)}):"
    if not own["fits"]:
        return f"{head} does not fit: {_needs(report, own)}"
    if not fit:
        searched = "no searched layout does"
        return f"{head} fits at {own['total_gib']:.4g} GiB a rank, est. {own['step_s']:.4g} s a step ({searched})"
    behind = own["step_s"] / report["rows"][0]["step_s"] - 1
    tie = ", a tie (~)" if own["tie"] else ""
    return (f"{head} #{own['rank']} of {fit} that fit, est. {own['step_s']:.4g} s a step ({behind:+.1%} on the "
            f"fastest{tie}), {own['total_gib']:.4g} GiB a rank")  # fmt: skip


def _needs(report: dict, row: dict) -> str:
    """What a row needs against the limits it was searched for (host memory only where one was given)."""
    gpu, host = report["gpu_mem_gib"], report["host_mem_gib"]
    needs = f"{row['total_gib']:.4g} GiB a rank ({row['total_gib'] / gpu:.0%} of {gpu:g} GiB)"
    if host:
        node_host = row["host_gib"] * min(report["world"], report["node"])
        needs += f", {node_host:.4g} GiB of host a node ({node_host / host:.0%} of {host:g} GiB)"
    return needs


def format_search_fix(report: dict) -> str:
    """Where no layout fits: the closest, by how much, and what would fit it (`search_fix`)."""
    fix, world = report["fix"], report["world"]
    if fix["closest"] is None:
        return f"nothing fits: no layout of {_ranks(world)} passes the config's checks"
    closest = fix["closest"]
    lines = [f"nothing fits: the closest layout needs {_needs(report, closest)}: {describe_layout(closest)}",
             f"  overrides: {shell_overrides(closest)}",
             "every recompute choice, zero stage and offload was tried; what would fit it:"]  # fmt: skip
    if fix["gpu_mem_gib"]:
        lines.append(f"  a GPU of {fix['gpu_mem_gib']} GiB: --gpu-mem {fix['gpu_mem_gib']}")
    if fix["host_mem_gib"]:
        lines.append(f"  {fix['host_mem_gib']} GiB of host memory a node: --host-mem {fix['host_mem_gib']}")
    if more := fix["more_ranks"]:
        lines.append(f"  more ranks: --world {more['world']}, where {shell_overrides(more)} needs "
                     f"{more['total_gib']:.4g} GiB a rank")  # fmt: skip
    if report["fit_with_rule_change"] and not report["rule_change"]:
        lines.append(f"  --allow-rule-change: {report['fit_with_rule_change']} layout(s) fit with 8-bit or 4-bit "
                     "AdamW moments (they change the update's numerics)")  # fmt: skip
    return "\n".join(lines)


def format_fix(fix: dict | None, total: int) -> str:
    """What `hpc-train plan` says under a layout that does not fit: the nearest fix (`nearest_fix`), a GPU that
    would hold it, and --search."""
    gpu = math.ceil(total / GiB)
    lines = [f"nearest fix: {shell_overrides(fix)} fits at {fix['total_gib']:.4g} GiB a rank (est. {fix['step_s']:.4g} "
             "s a step)" if fix else "no recompute choice, zero stage or cpu offload makes this layout fit",
             f"or a GPU of {gpu} GiB (--gpu-mem {gpu}); add --search to rank every layout that fits"]  # fmt: skip
    return "\n".join(lines)
