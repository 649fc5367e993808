"""Stopping: a signal only sets a flag; the ranks agree on it at the end of a step (one MAX all-reduce),
save a checkpoint together and stop. Only Slurm's warning signal requeues the job.

Slurm sends the warning signal (`--signal=USR2@<delay>`, submitit's choice) before the time limit, and at a
preemption where the cluster sets PreemptParameters=send_user_signal: the job requeues itself to go on.
`scancel` (and `hpc-train stop`, which signals the job's steps) sends SIGTERM: the user's stop, which saves
and stops without requeueing, as torchtitan and Megatron-LM stop. A preemption that sends SIGTERM is requeued
by Slurm itself where the partition's PreemptMode is REQUEUE, and is cancelled where it is CANCEL.
"""

from __future__ import annotations

import os
import signal
import subprocess

from hpc_train.bootstrap import STOP_SIGNALS
from hpc_train.resilience.bad_nodes import exclusion

# a stop signal's weight, which the ranks agree on (a MAX): a user's stop outweighs the warning, whichever
# came first, so a job stopped near its time limit is not requeued
STOP_LEVELS = {signal.SIGUSR2: 1, signal.SIGTERM: 2}
REQUEUE = STOP_LEVELS[signal.SIGUSR2]  # the level that requeues the job


def describe_stop(level: int) -> str:
    """A stop level's signal and who sends it, for the log."""
    if level == REQUEUE:
        return "SIGUSR2: Slurm's warning before the time limit or a preemption"
    return "SIGTERM: scancel, `hpc-train stop` or a preemption"


class StopRequest:
    """The stop signals this process received, as the weightiest one's level (0: none)."""

    def __init__(self) -> None:
        self.level = 0
        self._previous = {}

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.level = max(self.level, STOP_LEVELS[signal.Signals(signum)])

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def requeue_slurm_job(max_requeues: int, report, run_dir: str) -> bool:
    """Rank 0: put this Slurm job back in the queue (it resumes from `latest`), up to max_requeues times,
    held while the nodes blamed in run_dir (resilience/bad_nodes.py) are excluded from its next allocation."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return False
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        report(f"not requeueing job {job_id}: it was already requeued {restarts} times (slurm.max_requeues)")
        return False
    nodes, excluded = exclusion(run_dir, int(os.environ.get("SLURM_JOB_NUM_NODES", "1")))
    if nodes:  # held while its next allocation is narrowed, so it cannot start before
        subprocess.run(["scontrol", "requeuehold", job_id], check=True)
        try:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], check=True)
        finally:
            subprocess.run(["scontrol", "release", job_id], check=True)
    else:
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    report(f"requeued job {job_id} (restart {restarts + 1} of at most {max_requeues})" + (excluded and f"; {excluded}"))
    return True
