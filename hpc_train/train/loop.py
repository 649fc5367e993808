"""The step loop. `run_training` is the per-rank entry point: join the process group, build the run
(builder.py), resume, step until done or stopped, leave. Each step: next micro-batches -> forward and
backward -> reduce, clip, update (train/step.py); once per log interval (and at evals, saves, straggler
reports and the end) the pending steps' figures are read -> eval -> metrics -> checkpoint.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.bootstrap import RankEnv, distributed, select_device
from hpc_train.builder import Run, build_run
from hpc_train.checkpoint.checkpointer import Resumed
from hpc_train.config import JobConfig
from hpc_train.data.sampler import add_skip, read_range
from hpc_train.observe.goodput import Ledger
from hpc_train.observe.memory import live_storage_bytes
from hpc_train.observe.metrics import peak_memory_bytes
from hpc_train.observe.profiling import ProfileWindow, write_oom_report
from hpc_train.optim.schedule import lr_at
from hpc_train.resilience import watchdog
from hpc_train.resilience.bad_nodes import blame
from hpc_train.resilience.faults import fault_point
from hpc_train.resilience.preemption import REQUEUE, StopRequest, describe_stop, requeue_slurm_job
from hpc_train.resilience.spikes import Rollbacks
from hpc_train.resilience.stragglers import StragglerMonitor, describe_stragglers
from hpc_train.resilience.watchdog import HangWatchdog
from hpc_train.train.report import TrainResult, announce, finish
from hpc_train.train.step import (
    NonFiniteStep,
    StepOptions,
    StepResult,
    evaluate,
    rank_micro_batches,
    read_figures,
    skip_reason,
    train_step,
)


def run_training(rank_env: RankEnv, cfg: JobConfig) -> TrainResult:
    """Train on this rank, resuming from the newest valid checkpoint. A stop signal ends training early
    with a committed checkpoint."""
    device = select_device(cfg.train.device, rank_env.local_rank)
    stop = StopRequest().install()
    last_memory: dict[str, int] = {}  # the last step's measured bytes, for an out-of-memory report
    # logging.measure_peak_step, on rank 0 (the record carries its bytes): what the process held before this
    # run (on CPU, what torch keeps of an earlier run in the same process) is left out of the step's peak
    held = None
    if cfg.logging.measure_peak_step and rank_env.rank == 0:
        held = frozenset(live_storage_bytes().items()) if device.type != "cuda" else frozenset()
    try:
        p = cfg.parallel
        with distributed(rank_env, device, p.backend, p.timeout_s, p.rendezvous_timeout_s):
            try:
                return train(build_run(cfg, rank_env, device), stop, last_memory, held)
            except torch.OutOfMemoryError:
                path = write_oom_report(Path(cfg.run_dir), rank_env.rank, device, last_memory)
                print(f"rank {rank_env.rank}: out of memory; memory summary in {path}", flush=True)
                raise
            except RuntimeError as err:
                if not watchdog.is_timeout(err):
                    raise
                where = watchdog.stragglers(rank_env.world_size)
                stacks = watchdog.write_stacks(cfg.run_dir, f"rank {rank_env.rank}: a collective timed out after "
                                               f"parallel.timeout_s={p.timeout_s}s ({where}), called from:\n"
                                               f"{''.join(traceback.format_tb(err.__traceback__))}\n")  # fmt: skip
                raise RuntimeError(
                    f"rank {rank_env.rank}: a collective timed out after parallel.timeout_s="
                    f"{cfg.parallel.timeout_s}s: a peer stopped responding: {where}; this rank's stacks in {stacks}"
                ) from err
    finally:
        stop.uninstall()


def train(
    run: Run, stop: StopRequest, last_memory: dict[str, int], held: frozenset[tuple[int, int]] | None = None
) -> TrainResult:
    """Claim the checkpoint directory, resume, train; the claim ends with the run, however it ends. `held`:
    where logging.measure_peak_step is measured, the storages the process held before the run (left out)."""
    run.checkpointer.claim()
    hang = HangWatchdog(run.cfg.parallel.hang_timeout_s, run.cfg.run_dir, run.rank_env.world_size)
    ledger = None
    try:
        ledger = Ledger(run.cfg.run_dir) if run.metrics else None  # observe/goodput.py: rank 0's, after the claim
        result = _train(run, stop, last_memory, hang, held, ledger)
        run.checkpointer.finish()
        if ledger is not None:
            ledger.end()
        return result
    finally:
        if ledger is not None:
            ledger.close()
        hang.close()
        run.checkpointer.release()
        run.optimizer.close()


def _nonfinite(run: Run, step: int, reason: str, skipped: int) -> None:
    """A non-finite step (its update already dropped on the device): skipped while train.skip_nonfinite
    allows, else the end of the run, before anything of it is checkpointed."""
    allowed = run.cfg.train.skip_nonfinite
    if skipped > allowed:
        raise NonFiniteStep(
            f"step {step}: {reason}; stopping (no checkpoint of this state is written, the last one stays). Usual "
            f"causes: a learning rate too high, bad data or numerics; train.skip_nonfinite={allowed} "
            "allows that many such steps to be skipped"
        )
    run.report(f"step {step}: {reason}; step skipped ({skipped} of train.skip_nonfinite={allowed})")


@dataclass
class Pending:
    """A step trained but not yet read: what the host knew then, and its figures still on the device."""

    record: dict[str, Any]  # step, lr, consumed_samples...
    result: StepResult
    timings: dict[str, float] | None


def _restart_figures(run: Run, resumed: Resumed | None) -> dict[str, float] | None:
    """After an in-job restart (the launcher sets HPC_TRAIN_RESTART and HPC_TRAIN_FAILED_AT): the time from
    the failure until training again, and the training since the resumed checkpoint that is done again."""
    attempt = int(os.environ.get("HPC_TRAIN_RESTART", "0"))
    if not attempt:
        return None
    failed_at = float(os.environ.get("HPC_TRAIN_FAILED_AT", "0"))
    figures = {"attempt": attempt, "restart_s": round(time.time() - failed_at, 3)}
    lost = f"in-job restart {attempt}: training again {figures['restart_s']:.1f}s after the failure"
    if resumed is not None:
        figures["redone_s"] = round(failed_at - resumed.committed_at, 3)
        lost += f"; the {figures['redone_s']:.1f}s trained after the checkpoint of step {resumed.step} are redone"
    run.report(lost)
    return figures


def _first_spike(pending: list[Pending], figures: list[dict[str, float]], steps: int) -> float:
    """What a rank adds to the loop's MAX all-reduce for train.spike_guard: minus the first step of the
    interval that spiked (minus `steps` + 1: none), so that every rank agrees on the earliest one seen."""
    return -next((p.record["step"] for p, f in zip(pending, figures, strict=True) if f["spike"]), steps + 1)


def roll_back(run: Run, spike: Pending, figures: dict[str, float], rollbacks: Rollbacks) -> dict | None:
    """A loss spike: every rank restores the newest checkpoint this process saved or resumed from and skips
    the data that led to the spike (train.spike_guard.skip). Returns what metrics.jsonl records of it (also
    kept in `rollbacks`), or None when there is no such checkpoint yet (reported, training goes on)."""
    step, sampler, start = spike.record["step"], run.sampler, time.perf_counter()
    medians = run.spikes.medians()  # before the resume restores the checkpoint's
    seen = (f"loss {figures['loss']:.4g} (median {medians['loss_median']:.4g}), gradient norm "
            f"{figures['grad_norm']:.4g} (median {medians['grad_norm_median']:.4g})")  # fmt: skip
    resumed = run.checkpointer.roll_back()
    if resumed is None:
        run.report(f"loss spike at step {step}: {seen}; no checkpoint to roll back to yet, training on")
        return None
    samples = rollbacks.skipped_range(spike.record["consumed_samples"], sampler.global_batch_size,
                                      sampler.consumed_samples)  # fmt: skip
    rollbacks.check(step, samples)
    skipped = sampler.describe(read_range(sampler, *samples))
    add_skip(sampler, *samples)
    run.report(f"loss spike at step {step}: {seen}; rolled back to the checkpoint of step {resumed.step} (from "
               f"{resumed.source}), samples {samples[0]}-{samples[1]} of the stream skipped")  # fmt: skip
    done = {"spike_step": step, "loss": figures["loss"], "grad_norm": figures["grad_norm"], **medians,
            "to_step": resumed.step, "from": resumed.source, "rollback_s": time.perf_counter() - start,
            "skipped_samples": list(samples), "skipped_indices": skipped}  # fmt: skip
    rollbacks.done.append(done)
    return done


def _stop(run: Run, result: TrainResult, step: int, level: int, ledger: Ledger | None) -> TrainResult:
    """A stop signal (its agreed level), with the state of `step` committed, and leave together. Only Slurm's
    warning signal (the time limit near, or a preemption) requeues the job (rank 0): SIGTERM is a user's stop
    (`scancel`, `hpc-train stop`), which stops. The metrics (W&B's included) and the goodput ledger are closed
    first: a requeue ends the job's processes at once."""
    run.report(f"stop signal received ({describe_stop(level)}): checkpoint of step {step} committed, stopping")
    if run.metrics:
        run.metrics.close()
        if ledger is not None:
            ledger.end()
        if level == REQUEUE:
            result.requeued = requeue_slurm_job(run.cfg.slurm.max_requeues, run.report, run.cfg.run_dir)
        else:  # launch/slurm.py's `stopped_at` reads this line
            run.report(f"stopped on request at step {step}: the same command (or `hpc-train submit` of the same "
                       "config) resumes from it")  # fmt: skip
    dist.barrier()
    return result


def evaluate_all(run: Run) -> dict[str, float]:
    """`eval_loss` (data.valid_path's, else the mean over data.valid_sources) and `eval_loss/<name>` for each
    of data.valid_sources."""
    per_source = {
        f"eval_loss/{name}": evaluate(run.model, ds, run.cfg.train, run.cfg.data)
        for name, ds in run.valid_sources.items()
    }
    if run.valid_set is not None:
        return {"eval_loss": evaluate(run.model, run.valid_set, run.cfg.train, run.cfg.data), **per_source}
    return {"eval_loss": sum(per_source.values()) / len(per_source), **per_source}


def _report_stragglers(run: Run, stragglers: list[dict], step: int) -> None:
    """Rank 0: the slow ranks in the log; the nodes of those past logging.straggler_blame are blamed."""
    log = run.cfg.logging
    if not stragglers or run.metrics is None:
        return
    run.report(describe_stragglers(stragglers, step, log.straggler_interval))
    for slow in stragglers:
        if log.straggler_blame and slow["slower"] >= log.straggler_blame:
            blame(run.cfg.run_dir, slow["host"], f"rank {slow['rank']} computed {slow['slower']:.2f}x the median")


def _train(
    run: Run,
    stop: StopRequest,
    last_memory: dict[str, int],
    hang: HangWatchdog,
    held: frozenset[tuple[int, int]] | None,
    ledger: Ledger | None,
) -> TrainResult:
    cfg, t = run.cfg, run.cfg.train
    with hang.timed(0, "resume", watchdog.START_ALLOWANCE):  # collectives: the plan, the checksums' agreement
        resumed = run.checkpointer.resume() if cfg.checkpoint.resume else None
    if resumed is None and run.metrics:  # from scratch: an earlier start's records are not this start's
        committed = any(c.problem is None for c in run.checkpointer.store.scan())
        kept = run.metrics.start_afresh(run.report if committed else None)
        if kept is not None and ledger is not None:  # its goodput ledger beside them (goodput.<stamp>.jsonl)
            ledger.set_aside(kept.with_name(kept.name.replace("metrics.", "goodput.", 1)))
    start_step = resumed.step if resumed else 0
    run.checkpointer.begin(start_step)
    since_save: list[float] = []  # step times since the last save, a process's first left out (interval=auto)
    downstream = None
    if cfg.eval.tasks:  # lm-eval's tasks, loaded once on rank 0 (the optional extra: imported only here)
        from hpc_train.train.downstream import Downstream

        downstream = Downstream(cfg, run.rank_env.rank)
    resumed_at = {"consumed_samples": run.sampler.consumed_samples, "skipped_samples": run.sampler.skipped}
    meter = announce(run, start_step)
    restart = _restart_figures(run, resumed)
    if ledger is not None:
        ledger.started(start_step)
    profile = ProfileWindow(cfg.logging.profile_steps, Path(cfg.run_dir), run.rank_env.rank, run.device)
    result = TrainResult()
    nonfinite_steps = 0
    monitor = StragglerMonitor(cfg.logging, run.device, (run.mesh.rank("pp"), run.mesh.rank("tp")))
    pending: list[Pending] = []
    rollbacks, rolled_back = Rollbacks(t.spike_guard), []  # train.spike_guard's, and those the next record names
    job_id = {"job_id": os.environ["SLURM_JOB_ID"]} if "SLURM_JOB_ID" in os.environ else {}  # on each record
    interval_start = time.perf_counter()
    step = start_step
    while step < t.steps:
        step += 1
        watchdog.record(step, 0, len(rollbacks.done))
        # the first step of a process sets up communicators and compiles: a longer allowance
        hang.arm(step, allowance=watchdog.START_ALLOWANCE if step == start_step + 1 else 1)
        lr = lr_at(step - 1, cfg.optim, t.steps)
        micro_batches = rank_micro_batches(run.train_set, run.sampler.next_micro_batches(), run.device,
                                           run.model.hooks, cfg.data)  # fmt: skip
        batch = run.sampler.consumed_samples // run.sampler.global_batch_size  # its number in the stream
        profile.before_step(step)
        timings = {} if cfg.logging.breakdown else None
        peak_step = step == cfg.logging.measure_peak_step
        # the bytes by category on this run's first two steps (and a profiled one), not every step
        options = StepOptions(cfg.optim.grad_clip, run.scaler, step, timings, monitor.clock, run.checkpointer.staged,
                              measure_peak=held if peak_step else None,
                              measure_memory=step < start_step + 3 or peak_step, spikes=run.spikes,
                              batch=batch, rollbacks=len(rollbacks.done))  # fmt: skip
        stats = train_step(run.model, run.optimizer, micro_batches, lr, options)
        with hang.paused():
            profile.after_step(step)
        last_memory.update(stats.memory)
        # when the step ran (its launch, in Unix seconds) and in which Slurm job; samples read (a blend's: tokens
        # per source)
        record = {"step": step, "time": round(time.time(), 3), **job_id, "lr": lr, **run.sampler.progress()}
        first = step == start_step + 1
        if resumed is not None and first:  # where this run picked up, for the record
            record["resumed_from"] = {"step": resumed.step, "layout": resumed.layout, "source": resumed.source,
                                      **resumed_at}  # fmt: skip
            if resumed.from_partner:
                record["resumed_from"]["from_partner"] = resumed.from_partner
            if resumed.passed_over:
                record["resumed_from"]["passed_over"] = resumed.passed_over
        if restart and first:
            record["restart"] = restart
        if rolled_back:  # the rollbacks to the checkpoint before this step (a second one cut the first's line)
            record["rollback"], rolled_back = rolled_back, []
        pending.append(Pending(record, stats, timings))
        evaluated = run.valid_set is not None or run.valid_sources
        eval_due = evaluated and t.eval_interval and (step % t.eval_interval == 0 or step == t.steps)
        tasks_due = downstream is not None and downstream.due(step)
        if not (step % cfg.logging.log_interval == 0 or step == t.steps or eval_due or tasks_due or monitor.due(step)
                or run.checkpointer.should_save(step, False) or run.checkpointer.should_save_local(step)):  # fmt: skip
            watchdog.record(step, 2, len(rollbacks.done))
            hang.disarm()
            continue
        # Once per log interval (and at evals, saves and the end): the device is read, every pending step's
        # figures at once, and the interval's time is shared by its steps.
        figures = read_figures([p.result for p in pending])
        elapsed = (time.perf_counter() - interval_start) / len(pending)
        evals: dict[str, Any] = {}
        if eval_due:
            with hang.paused():
                eval_start = time.perf_counter()
                evals = {**evaluate_all(run), "eval_s": 0.0}
                evals["eval_s"] = round(time.perf_counter() - eval_start, 4)
                result.eval_losses[step] = evals["eval_loss"]
        # one MAX all-reduce for the peak memory over ranks and for a stop signal seen by any rank (the weightiest:
        # where ranks saw both, the user's stop, which does not requeue, wins)
        agreed = torch.tensor([*map(float, peak_memory_bytes(run.device)), float(stop.level),
                               _first_spike(pending, figures, t.steps)], dtype=torch.float64,
                              device=run.device)  # fmt: skip
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        *peak, stop_level, spike_at = agreed.tolist()
        stop_level = int(stop_level)  # 0: no stop
        spiked = next((i for i, p in enumerate(pending) if p.record["step"] == -spike_at), None)
        if spiked is not None:
            watchdog.record(step, watchdog.ROLLING_BACK, len(rollbacks.done))
            hang.disarm()
            with hang.timed(step, "spike rollback", watchdog.START_ALLOWANCE):  # a resume's collectives
                rollback = roll_back(run, pending[spiked], figures[spiked], rollbacks)
            if rollback is not None:
                if ledger is not None:
                    ledger.add("rollback", step=rollback["to_step"])
                step = rollback["to_step"]  # this process's own: at or after start_step
                rolled_back = [r for r in rollbacks.done if r["to_step"] == step]
                del result.losses[step - start_step :]
                result.eval_losses = {s: loss for s, loss in result.eval_losses.items() if s <= step}
                pending.clear()
                if stop_level:  # the checkpoint rolled back to is committed: nothing to save
                    return _stop(run, result, step, stop_level, ledger)
                interval_start = time.perf_counter()
                continue
        if tasks_due and not stop_level:  # agreed: not on a step rolled back, nor before a stop's save
            with hang.paused():
                eval_start = time.perf_counter()
                evals.update(downstream.evaluate(run.model, step))  # downstream/<task>/<metric>
                evals["eval_s"] = round(evals.get("eval_s", 0.0) + time.perf_counter() - eval_start, 4)
            if "downstream_error" in evals:
                run.report(f"step {step}: downstream evaluation failed on rank 0 ({evals['downstream_error']}); "
                           "training goes on")  # fmt: skip
        records = []
        for p, f in zip(pending, figures, strict=True):
            monitor.add(elapsed)  # the step's share of the interval: a step itself does not wait for the device
            if reason := skip_reason(f):
                nonfinite_steps += 1
                if nonfinite_steps > cfg.train.skip_nonfinite and run.metrics:
                    for r in records:  # the steps before it are recorded; it stops the run
                        run.metrics.write(r, show=False)
                _nonfinite(run, p.record["step"], reason, nonfinite_steps)
            r = {**p.record, "loss": f["loss"], "grad_norm": float("nan") if f["overflow"] else f["grad_norm"]}
            if reason or f["overflow"]:
                r["skipped"] = True  # its update was dropped
            r.update(meter.fields(r["step"], elapsed, p.result.memory, tuple(peak), p.timings))
            if run.scaler:
                r.update(loss_scale=f["loss_scale"], skipped_steps=int(f["skipped_steps"]))
            for hook in run.model.hooks:  # the features' figures (one read of the device each)
                if hook.name in p.result.features:
                    r.update(hook.record(p.result.features[hook.name]))
            result.losses.append(f["loss"])
            records.append(r)
        pending.clear()
        if cfg.checkpoint.interval == "auto":
            since_save += [r["step_time_s"] for r in records if r["step"] > start_step + 1]
        record = records[-1]
        record.update(evals)
        if slow := monitor.report(step):
            record.update(slow)
            _report_stragglers(run, slow["stragglers"], step)
        watchdog.record(step, 2, len(rollbacks.done))
        hang.disarm()
        saving = run.checkpointer.should_save(step, stop_level)
        saving_locally = run.checkpointer.should_save_local(step, saving)
        if ledger is not None:  # each recorded step's time, for the goodput ledger (before the save trims records)
            kept = [[r["step"], r["step_time_s"]] for r in records if not r.get("skipped")]
        save_start = time.perf_counter()
        if (saving or saving_locally) and run.metrics:  # the interval's earlier steps on disk, its last with it
            for r in records[:-1]:
                run.metrics.write(r, show=False)
            records = records[-1:]
            run.metrics.hold(record)
        if saving_locally:
            watchdog.record(step, watchdog.SAVING, len(rollbacks.done))
            with hang.timed(step, "node-local checkpoint save", watchdog.START_ALLOWANCE):
                record["local_checkpoint"] = run.checkpointer.save_local(step)
        if saving:
            watchdog.record(step, watchdog.SAVING, len(rollbacks.done))
            # its collectives hang like a step's; its writes may take long: the longer allowance
            with hang.timed(step, "checkpoint save", watchdog.START_ALLOWANCE):
                record["checkpoint"] = run.checkpointer.save(step)  # what the save cost: on its step's record
                if stop_level or step == t.steps:  # the last save: nothing to overlap; its commit on this record
                    record["checkpoint"].update(run.checkpointer.wait() or {})
                else:  # checkpoint.interval=auto: when the next save comes
                    step_s, blocked = statistics.median(since_save or [elapsed]), record["checkpoint"]["blocked_s"]
                    if auto := run.checkpointer.plan_next_save(step, blocked, step_s, run.device):
                        record["checkpoint"]["auto_interval"] = auto
                since_save = []
        if committed := run.checkpointer.poll():  # an async save committed during this interval
            record["checkpoint_committed"] = committed
        if ledger is not None:  # the steps recorded, each one's time, and what the loop spent saving and evaluating
            record["goodput"] = ledger.add("steps", steps=kept, eval_s=evals.get("eval_s", 0.0),
                                           checkpoint_s=round(time.perf_counter() - save_start, 4))  # fmt: skip
        if run.metrics:
            for r in records:
                run.metrics.write(r, show=r["step"] % cfg.logging.log_interval == 0 or r["step"] == t.steps)
        interval_start = time.perf_counter()
        if stop_level:  # its save was waited for above
            return _stop(run, result, step, stop_level, ledger)
    fault_point("finished", t.steps, run.rank_env.rank)  # a failure test's late rank, still to record below
    watchdog.record(t.steps, watchdog.CONSOLIDATING, len(rollbacks.done))
    # gathers every shard (collectives) and writes the whole model: the longer allowance
    with hang.timed(t.steps, "final consolidation", watchdog.START_ALLOWANCE):
        finish(run, result, start_step)  # the last step's save was waited for above
    return result
