"""`hpc-train status`: for each run, its job (in the queue, else the last one that ran it), the job's state,
the step reached of train.steps and the newest checkpoint. squeue answers for jobs pending or running
(launch/queue.py), sacct for the last job that ended."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from hpc_train.checkpoint.store import CheckpointStore
from hpc_train.launch.queue import jobs_of, queued_runs, read_manifest, slurm_output
from hpc_train.observe.metrics import last_step


def newest_job(log_dir: Path) -> str | None:
    """The newest job submitted for a run: submitit names its script `<job id>_submission.sh` in the log folder."""
    ids = [int(m.group(1)) for p in log_dir.glob("*_submission.sh") if (m := re.match(r"(\d+)_submission", p.name))]
    return str(max(ids)) if ids else None


def array_task(run_dir: Path) -> str | None:
    """Where a sweep's array ran this run (a member's directory, in the sweep's directory): the last array
    task that ran it (`<array>_<task>`; a one-member sweep's plain job), else None."""
    manifest, path = read_manifest(run_dir.parent), str(run_dir.resolve())
    members = [m["path"] for m in manifest["members"]] if manifest else []
    task = None
    for array in manifest["arrays"] if path in members else []:
        if (index := members.index(path)) in array["members"]:
            many = len(array["members"]) > 1
            task = f"{array['job_id']}_{array['members'].index(index)}" if many else array["job_id"]
    return task


def run_job(run_dir: Path, cfg: dict, queued: list | None) -> tuple[str, str, bool] | None:
    """The run's job, its state and whether it is in the queue: its job in the queue (squeue's state), else the
    last job that ran it (a sweep's array task, or the newest its logs name) with accounting's state ('unknown'
    where sacct does not know it); None where no Slurm job ran it."""
    if jobs := jobs_of(str(run_dir), queued):
        return jobs[0].job_id, jobs[0].state, True
    logs = run_dir / "slurm"  # where a run without its config.yaml has them
    if cfg:
        logs = recorded_path(run_dir, cfg, cfg["slurm"]["log_dir"] or f"{cfg['run_dir']}/slurm")
    job_id = array_task(run_dir) or newest_job(logs)
    if job_id is None:
        return None
    out = slurm_output(["sacct", "-j", job_id, "-X", "-n", "-o", "State%40"]) or ""
    return job_id, (out.split() or ["unknown"])[0], False


def recorded_config(run_dir: Path) -> dict:
    """The config a run recorded (run_dir/config.yaml), as plain values; {} where there is none."""
    path = run_dir / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


def recorded_path(run_dir: Path, cfg: dict, value: str) -> Path:
    """A path the run's recorded config holds, from here: a relative one was relative to where the run
    started, which is `run_dir` less the recorded (relative) run_dir."""
    path, recorded = Path(value), Path(cfg.get("run_dir") or ".")
    if path.is_absolute() or recorded.is_absolute():
        return path
    start = run_dir.resolve()
    for _ in recorded.parts:
        start = start.parent
    return start / path


def status_rows(run_dirs: list[str]) -> list[dict[str, str]]:
    """A row for each run: its job (queued, else the last one), the job's state, the step reached of
    train.steps and the newest checkpoint. No run dirs: every run of this user's with a job in the queue."""
    queued = queued_runs(mine=not run_dirs)  # named run directories: anyone's jobs
    if not run_dirs:
        run_dirs = sorted({job.run_dir for job in queued or []})
    rows = []
    for run_dir in run_dirs:
        path = Path(run_dir)
        if not path.is_dir():
            rows.append({"run": run_dir, "job": "-", "state": "no such run directory", "step": "-", "checkpoint": "-"})
            continue
        cfg = recorded_config(path)
        checkpoints = recorded_path(path, cfg, cfg["checkpoint"]["dir"]) if cfg else path / "checkpoints"
        job = run_job(path, cfg, queued)
        job_id, state = (
            (job[0], job[1] + " (not in the queue)" * (not job[2])) if job else ("-", "no Slurm job (a local run)")
        )
        step, total = last_step(path), cfg.get("train", {}).get("steps", "?")
        rows.append({"run": run_dir, "job": job_id, "state": state,
                     "step": f"{'-' if step is None else step}/{total}",
                     "checkpoint": CheckpointStore(checkpoints).latest_pointer() or "-"})  # fmt: skip
    return rows


def format_status(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "no hpc_train job in the queue (`hpc-train status RUN_DIR` shows a run that has ended)"
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in rows[0]}
    lines = ["  ".join(f"{key:<{widths[key]}}" for key in rows[0])]
    lines += ["  ".join(f"{row[key]:<{widths[key]}}" for key in row) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
