"""The checkpoint interval a failure rate calls for, and the goodput it leaves (`hpc-train plan --mtbf-hours`).

Daly's model of a long run ("A higher order estimate of the optimum checkpoint interval for restart dumps",
2006): failures arrive at random (exponentially distributed, mean M: the job's, a node's MTBF over the
nodes); the run computes for an interval tau, then a save blocks it for delta; a failure loses the segment in
progress and costs a restart of R (which a failure can strike too) before the segment is done again. A
segment then takes M e^(R/M) (e^((tau + delta)/M) - 1) on average, so the share of the wall time that is
training kept is tau / (M e^(R/M) (e^((tau + delta)/M) - 1)), and Daly's interval nearly maximizes it
(Young's sqrt(2 delta M) is its first term). Only the time a save blocks training counts: an asynchronous
save's writes overlap the steps after it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hpc_train.observe.metrics import read_records

HOUR = 3600.0
DEFAULT_RESTART_S = 300.0  # a requeue, the ranks' start and a resume, where no run has measured one


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's interval (1974): sqrt(2 delta M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the interval that maximizes `expected_goodput` (M where a save takes
    at least 2M: then every segment is as likely to fail as not)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return young_interval(save_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def expected_goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of the wall time spent on training that is kept, under Daly's model."""
    try:
        segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    except OverflowError:  # segments hundreds of MTBFs long: none completes
        return 0.0
    return interval_s / segment


@dataclass(frozen=True)
class FailurePlan:
    """A job's failure rate and what failures and saves cost it, each figure with where it came from
    (given, measured in the run's records, estimated by the planner, or assumed)."""

    mtbf_s: float  # the job's
    save_s: float  # what a save blocks training for
    restart_s: float  # from a failure to training again
    step_s: float
    sources: dict[str, str]  # figure -> where it came from
    interval_steps: int = 0  # the config's checkpoint.interval (0: none)

    @property
    def best_interval_s(self) -> float:
        return daly_interval(self.save_s, self.mtbf_s)

    @property
    def best_steps(self) -> int:
        return max(1, round(self.best_interval_s / self.step_s))

    def goodput(self, steps: int) -> float:
        return expected_goodput(steps * self.step_s, self.save_s, self.restart_s, self.mtbf_s)


def measured_costs(run_dir: str | Path) -> dict[str, float]:
    """What a run's metrics.jsonl measured: the median step time, the mean time a save blocked training (an
    asynchronous save's: also the next update's wait for its staging) and the mean restart (an in-job
    restart's, from the failure until training again); those it has."""
    records = read_records(run_dir)
    steps = [r["step_time_s"] for r in records if "step_time_s" in r and not r.get("skipped")]
    staged = {r["checkpoint_committed"]["step"]: r["checkpoint_committed"].get("staging_wait_s", 0.0)
              for r in records if "step" in r.get("checkpoint_committed", {})}  # fmt: skip
    saves = [r["checkpoint"]["blocked_s"] + staged.get(r["step"], 0.0)  # an async save's wait for its staging too
             for r in records if "blocked_s" in r.get("checkpoint", {})]  # fmt: skip
    restarts = [r["restart"]["restart_s"] for r in records if "restart_s" in r.get("restart", {})]
    figures = {"step_s": statistics.median(steps)} if steps else {}
    figures |= {"save_s": statistics.fmean(saves)} if saves else {}
    return figures | ({"restart_s": statistics.fmean(restarts)} if restarts else {})


def job_mtbf_s(node_mtbf_hours: float | None, nodes: int, failures_per_day: float | None) -> tuple[float, str]:
    """The job's mean time between failures, and how it was found: a node's MTBF over the job's nodes, or
    the job's failures a day."""
    if failures_per_day is not None:
        return 24 * HOUR / failures_per_day, f"{failures_per_day:g} failures a day"
    return node_mtbf_hours * HOUR / nodes, f"a node's MTBF of {node_mtbf_hours:,g} h over {nodes:,} node(s)"


def format_failure_plan(plan: FailurePlan) -> str:
    """plan's lines: the figures and their sources, Daly's interval in seconds and steps (Young's beside
    it), and the expected goodput there and at the config's interval."""
    s = plan.sources
    lines = [f"failures: the job's MTBF {plan.mtbf_s / HOUR:,.2f} h ({s['mtbf_s']}); a save blocks training "
             f"{plan.save_s:,.1f} s ({s['save_s']}), a restart takes {plan.restart_s:,.0f} s ({s['restart_s']}), "
             f"a step {plan.step_s:,.3g} s ({s['step_s']})"]  # fmt: skip
    best = (f"checkpoint every {plan.best_interval_s:,.0f} s of training (Daly; Young: "
            f"{young_interval(plan.save_s, plan.mtbf_s):,.0f} s): checkpoint.interval={plan.best_steps} steps, "
            f"expected goodput {plan.goodput(plan.best_steps):.1%}")  # fmt: skip
    if plan.interval_steps:
        best += f"; at this config's checkpoint.interval={plan.interval_steps}: {plan.goodput(plan.interval_steps):.1%}"
    return "\n".join([*lines, best])


def failure_plan(
    mtbf: tuple[float, str],
    given: dict[str, float | None],
    run_dir: str | Path,
    estimated_step_s: float,
    interval_steps: int,
) -> FailurePlan:
    """The plan from the figures `given` (step_s, save_s, restart_s: None where not given), else those the run
    in `run_dir` measured, else the planner's step time and an assumed restart; a save cost neither given
    nor measured is refused (there is no estimate of a file system's speed)."""
    measured = measured_costs(run_dir)
    figures, sources = {}, {"mtbf_s": mtbf[1]}
    for name in ("step_s", "save_s", "restart_s"):
        if given.get(name) is not None:
            figures[name], sources[name] = given[name], "given"
        elif name in measured:
            figures[name], sources[name] = measured[name], f"measured in {Path(run_dir) / 'metrics.jsonl'}"
    if "save_s" not in figures:
        raise ValueError(f"--save-s: no save measured in {Path(run_dir) / 'metrics.jsonl'}; give what a save blocks "
                         "training for, in seconds (a run's records hold it as checkpoint.blocked_s)")  # fmt: skip
    figures.setdefault("step_s", estimated_step_s)
    sources.setdefault("step_s", "the planner's estimate")
    figures.setdefault("restart_s", DEFAULT_RESTART_S)
    sources.setdefault("restart_s", "assumed")
    return FailurePlan(mtbf[0], figures["save_s"], figures["restart_s"], figures["step_s"], sources, interval_steps)


def failure_figures(plan: FailurePlan) -> dict:
    """`plan --json`'s: the figures, their sources, Daly's interval and the goodputs."""
    at_config = {"goodput_at_config": plan.goodput(plan.interval_steps)} if plan.interval_steps else {}
    return {"mtbf_s": plan.mtbf_s, "save_s": plan.save_s, "restart_s": plan.restart_s, "step_s": plan.step_s,
            "sources": plan.sources, "interval_s": plan.best_interval_s, "interval_steps": plan.best_steps,
            "goodput": plan.goodput(plan.best_steps), **at_config}  # fmt: skip
