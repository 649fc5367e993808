"""What Slurm's queue says about runs: a submitted job carries its run directory in its comment
(`--comment=hpc_train:<run_dir>`), so `submit` finds a job already running a run directory (two jobs would
write one run's checkpoints), `hpc-train stop` finds the job to stop, and `hpc-train status` shows each run's
job, its state and its step. squeue answers for jobs pending or running; sacct for the last job that ended."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpc_train.config import ConfigError
from hpc_train.errors import UserError

COMMENT_PREFIX = "hpc_train:"
ARRAY_PREFIX = "hpc_train-array:"  # a sweep's job array: `hpc_train-array:<member indices>:<sweep dir>`
SWEEP_FILE = "sweep.json"  # in a sweep's directory: its members (launch/sweep.py)


def run_comment(run_dir: str) -> str:
    """The comment `submit` gives a run's job: the run directory, resolved (absolute, no `..` or links), so
    any spelling of it from any directory finds it."""
    return COMMENT_PREFIX + str(Path(run_dir).resolve())


def array_comment(sweep_dir: str, members: list[int]) -> str:
    """The comment of a sweep's job array: task i runs member `members[i]` of the sweep's sweep.json."""
    return f"{ARRAY_PREFIX}{','.join(map(str, members))}:{Path(sweep_dir).resolve()}"


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    state: str  # squeue's: PENDING, RUNNING, COMPLETING, REQUEUED...
    run_dir: str


def read_manifest(sweep_dir: str | Path) -> dict | None:
    """A sweep's sweep.json (launch/sweep.py writes it): its members and the arrays that ran them; None without."""
    path = Path(sweep_dir) / SWEEP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def array_task_job(job_id: str, state: str, task: str, comment: str) -> QueuedJob | None:
    """A task of a sweep's array (squeue -r: one line a task; `N/A` for a sweep of one member, a plain job) as
    the job of the member it runs. None where the sweep cannot be read (another user's private directory, a
    comment or sweep.json not ours): that line is not a run of this user's."""
    try:
        indices, sweep_dir = comment.removeprefix(ARRAY_PREFIX).split(":", 1)
        members = [int(i) for i in indices.split(",")]
        manifest = read_manifest(sweep_dir)
        return QueuedJob(job_id, state, manifest["members"][members[0 if task == "N/A" else int(task)]]["path"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def slurm_output(command: list[str]) -> str | None:
    """A Slurm command's output, or None where it does not answer (no Slurm on this machine)."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def queued_runs(mine: bool = False) -> list[QueuedJob] | None:
    """Every job in the queue that runs an hpc_train run, whoever submitted it (`mine`: this user's); None
    without Slurm."""
    out = slurm_output(["squeue", "-h", "-r", "-o", "%i|%T|%K|%k", *(["--me"] if mine else [])])
    if out is None:
        return None
    jobs = []
    for line in out.splitlines():
        job_id, state, task, comment = line.split("|", 3)
        if comment.startswith(COMMENT_PREFIX):
            jobs.append(QueuedJob(job_id, state, comment.removeprefix(COMMENT_PREFIX)))
        elif comment.startswith(ARRAY_PREFIX) and (job := array_task_job(job_id, state, task, comment)) is not None:
            jobs.append(job)
    return jobs


def jobs_of(run_dir: str, queued: list[QueuedJob] | None = None) -> list[QueuedJob]:
    """The queued jobs of a run directory."""
    path = str(Path(run_dir).resolve())
    return [job for job in (queued_runs() if queued is None else queued) or [] if job.run_dir == path]


def check_no_job_runs(run_dir: str, queued: list[QueuedJob] | None = None) -> None:
    """Before a submission: no job in the queue (`queued`, else squeue's now) already runs this run directory."""
    if jobs := jobs_of(run_dir, queued):
        listed = ", ".join(f"job {job.job_id} ({job.state})" for job in jobs)
        raise ConfigError(
            f"{listed} already runs {jobs[0].run_dir}: a second job would write the same run; wait for it to end, "
            f"stop it with `hpc-train stop {run_dir}` (it saves first), or give this run its own name= or run_dir="
        )


# squeue states of a job whose ranks may be training: they get the stop signal; any other queued job (pending,
# requeued, held, suspended, configuring: no rank has started) is cancelled, and a completing one is ending
TRAINING = ("RUNNING",)


def stop(run_dir: str) -> list[str]:
    """Stop the run's jobs: a running job's steps get SIGTERM (every rank saves and stops, and the job ends
    without requeueing); a job not running yet is cancelled. Returns what was done, a line a job."""
    done = []
    for job in jobs_of(run_dir):
        if job.state == "COMPLETING":
            done.append(f"job {job.job_id} is already ending (COMPLETING)")
            continue
        training = job.state in TRAINING
        command = ["scancel", *(["--signal=TERM"] if training else []), job.job_id]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            raise UserError(f"`{' '.join(command)}` failed: {out.stderr.strip()}")
        done.append(f"job {job.job_id} ({job.state}): " + ("asked its ranks to save and stop" if training else
                                                           "no rank had started: cancelled"))  # fmt: skip
    return done
