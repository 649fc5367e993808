"""Goodput: the share of a run's wall time that went into steps it kept, and where the rest went. Rank 0
appends a ledger, run_dir/goodput.jsonl, that outlives every process of the run: a line at each start of
the ranks (when the process, or its Slurm job, started; which job, requeue and in-job restart it is; the
step it resumed from; when training began), one per write of the metrics (the steps trained, each one's
time, the interval's checkpoint saving and evaluation), one per spike rollback, and one at the end. Read
in order (`Account`), the ledger gives:

- productive: the time of every step the run kept (a step trained again keeps only its last time);
- startup: process start (or the job's) to the first step: imports, rendezvous, build, the resume's read;
- checkpoint: the loop blocked saving (the background part of an async save overlaps training: not lost);
- eval: the evaluations;
- restart: an in-job restart, from the failure until the new ranks train again (their start-up included);
- redone: steps trained after the checkpoint a restart or requeue resumed from, trained again, and the time
  from the last recorded step to the failure;
- rollback: a spike rollback's steps, trained again, and the rollback itself;
- queue: between a job's end and its requeued start (Slurm requeues keep the job id);
- other: the rest (reading the device's figures, logging, the end's consolidation).

The wall time is the sum of those: each start's span, plus the gaps a restart or a requeue made. A new
submission (another job) or another `hpc-train train` starts a new span: the time between two launches is
no one's loss. A kill leaves at most a partial last line, which the next start drops. A run started afresh over
committed checkpoints keeps the earlier ledger beside it (goodput.<stamp>.jsonl, as metrics.jsonl's records)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hpc_train.observe.metrics import read_jsonl

LEDGER = "goodput.jsonl"
LAUNCHED_AT = "HPC_TRAIN_LAUNCHED_AT"  # launch_local's start: a rank in its process started then, not before
CAUSES = ("startup", "checkpoint", "eval", "restart", "redone", "rollback", "queue", "other")


def process_started_at() -> float:
    """When this process started (Unix seconds): its start in clock ticks after boot (/proc/self/stat) against
    the time since boot now (/proc/uptime, to the hundredth; /proc/stat's boot time is whole seconds). Now where
    /proc does not say."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def slurm_job_started_at(job_id: str) -> float | None:
    """When this Slurm job (this start of it, after a requeue) began, as squeue says (to the second)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%S"], capture_output=True, text=True, timeout=10)
        return datetime.fromisoformat(out.stdout.strip()).timestamp()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


@dataclass
class Account:
    """The ledger's events added in order: wall time, productive time and the lost time by cause."""

    wall: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    kept: dict[int, float] = field(default_factory=dict)  # step -> its time, for the steps the run keeps
    last_t: float | None = None  # the time of the last event of the current span
    start: dict[str, Any] | None = None  # the current start's event

    def add(self, event: dict[str, Any]) -> None:
        kind, t = event["event"], event["t"]
        if kind == "start":
            self._start(event)
            return
        if self.last_t is None:  # a ledger whose start line was lost: its span begins here
            self.last_t = t
        interval, self.last_t = max(0.0, t - self.last_t), t
        self.wall += interval
        if kind == "steps":
            self.kept.update({int(step): seconds for step, seconds in event["steps"]})
            self.lost["checkpoint"] += event.get("checkpoint_s", 0.0)
            self.lost["eval"] += event.get("eval_s", 0.0)
        elif kind == "rollback":  # the interval: the steps since the last write, trained and dropped, and the restore
            self._drop_after(event["step"], "rollback")
            self.lost["rollback"] += interval

    def _start(self, event: dict[str, Any]) -> None:
        previous, t, ready = self.start, event["t"], max(event["ready"], event["t"])
        self.start = event
        if previous is not None and self.last_t is not None and event.get("attempt", 0) > 0:
            # an in-job restart: the steps after the last line to the failure, then the restart until training again
            failed = min(max(event.get("failed_at") or self.last_t, self.last_t), ready)
            self.lost["redone"] += failed - self.last_t
            self.lost["restart"] += ready - failed
            self.wall += ready - self.last_t
        else:
            same_job = event.get("job") is not None and previous is not None and event.get("job") == previous.get("job")
            if same_job and self.last_t is not None and event.get("requeue", 0) > previous.get("requeue", 0):
                self.lost["queue"] += max(0.0, t - self.last_t)  # a requeue: its wait in the queue
                self.wall += max(0.0, t - self.last_t)
            self.lost["startup"] += ready - t
            self.wall += ready - t
        self.last_t = ready
        self._drop_after(event["step"], "redone")

    def _drop_after(self, step: int, cause: str) -> None:
        """Steps after `step`, resumed or rolled back from, are trained again: their time was lost to `cause`."""
        for dropped in [s for s in self.kept if s > step]:
            self.lost[cause] += self.kept.pop(dropped)

    def summary(self) -> dict[str, Any]:
        productive = sum(self.kept.values())
        lost = {**self.lost, "other": max(0.0, self.wall - productive - sum(self.lost.values()))}
        return {
            "goodput": round(productive / self.wall, 4) if self.wall else None,
            "wall_s": round(self.wall, 3),
            "productive_s": round(productive, 3),
            "lost_s": {cause: round(seconds, 3) for cause, seconds in lost.items() if seconds > 0},
        }


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger's events, up to a line a kill cut short."""
    return read_jsonl(Path(run_dir) / LEDGER)


def account(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's goodput from its ledger; None where it has none."""
    events = read_ledger(run_dir)
    if not events:
        return None
    totals = Account()
    for event in events:
        totals.add(event)
    return totals.summary()


class Ledger:
    """Rank 0's writer of the ledger, keeping its `Account` as it goes (the history is read once, at the start)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LEDGER
        self.totals = Account()
        events = read_ledger(run_dir)
        for event in events:
            self.totals.add(event)
        if self.path.is_file() and not self.path.read_text().endswith("\n"):  # a last line a kill cut short goes
            rewritten = self.path.with_name(f".{LEDGER}.{os.getpid()}")
            rewritten.write_text("".join(json.dumps(event) + "\n" for event in events))
            os.replace(rewritten, self.path)  # whole, or not at all
        self.file, self.ended = None, False

    def set_aside(self, kept: Path) -> None:
        """A run starting from scratch where an earlier start committed checkpoints (metrics.jsonl's records kept
        aside): that start's ledger is kept beside as `kept`, and this start's begins empty."""
        if self.path.is_file():
            self.path.rename(kept)
        self.totals = Account()

    def end(self) -> None:
        """The run's end (once): finished, or stopped and saved."""
        if not self.ended:
            self.add("end")
            self.ended = True

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append an event (flushed: a kill loses at most this line) and return the goodput so far."""
        event = {"event": kind, "t": round(time.time(), 3), **fields}
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()
        self.totals.add(event)
        return self.totals.summary()

    def started(self, step: int) -> dict[str, Any]:
        """This start of the ranks, training from `step`: when its process (or its job, on a first start)
        started and which job, requeue and in-job restart it is."""
        job, attempt = os.environ.get("SLURM_JOB_ID"), int(os.environ.get("HPC_TRAIN_RESTART", "0"))
        launched = os.environ.get(LAUNCHED_AT)
        began = max(process_started_at(), float(launched or 0))
        if job is not None and attempt == 0 and launched is None:  # a job's task (not a launch in an salloc shell)
            began = min(began, slurm_job_started_at(job) or began)
        ready = time.time()
        return self.add("start", t=round(began, 3), ready=round(ready, 3), step=step, job=job, attempt=attempt,
                        requeue=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                        failed_at=float(os.environ.get("HPC_TRAIN_FAILED_AT", "0")) or None)  # fmt: skip

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
