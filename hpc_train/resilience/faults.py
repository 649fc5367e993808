"""Fault injection for the failure tests: real SIGKILLs, hangs, slow ranks and out-of-memory errors at
named points of a step or of the checkpoint commit protocol, chosen by an environment variable (unset:
nothing happens). A production run never meets one: the variable is read only where the test switch
HPC_TRAIN_TESTING=1 is set too (tests/conftest.py and tools/fault_campaign.py set it), so a stray
HPC_TRAIN_FAULT in a job's environment does nothing."""

from __future__ import annotations

import os
import signal
import time

TEST_SWITCH = "HPC_TRAIN_TESTING"  # =1: the failure tests' faults are honoured
SLOW_S = 0.2  # what a slow rank loses per step
LATE_S = 3.0  # what a late rank loses, once


def fault_point(point: str, step: int, rank: int) -> str:
    """For failure tests: HPC_TRAIN_FAULT=<point>@<step>[@<rank>[@<kind>]], several joined by commas, kills this
    process with SIGKILL there (or makes it hang, as a stuck rank would, or stops it with SIGSTOP, as a frozen
    node would, or raises an out-of-memory error, or from that step on sleeps SLOW_S there, as a rank on a
    slow node would, or (`late`) sleeps LATE_S there once, or returns the kind, where the caller acts it out:
    `nan` makes its value non-finite,
    `spike`, at the point `batch` whose "step" is the global batch's number, poisons that batch, and at
    `local_saved`, `wipe` deletes the run's local checkpoints on the node before the kill and `corrupt` flips
    a byte of the rank's own local file); "" where nothing happens, and always without HPC_TRAIN_TESTING=1.
    Only the first attempt of a run meets its faults: ranks restarted in the job (HPC_TRAIN_RESTART > 0) run
    clean; and with HPC_TRAIN_FAULT_TASK=N, only task N of a job array (one member of a sweep)."""
    spec = os.environ.get("HPC_TRAIN_FAULT", "") if os.environ.get(TEST_SWITCH) == "1" else ""
    if not spec or os.environ.get("HPC_TRAIN_RESTART", "0") != "0":
        return ""
    if os.environ.get("HPC_TRAIN_FAULT_TASK", os.environ.get("SLURM_ARRAY_TASK_ID")) != os.environ.get(
        "SLURM_ARRAY_TASK_ID"
    ):
        return ""
    for fault in spec.split(","):
        name, at_step, *rest = fault.split("@")
        kind = rest[1] if len(rest) > 1 else "kill"
        if name != point or int(rest[0] if rest else 0) != rank:
            continue
        if kind == "slow":
            if step >= int(at_step):
                time.sleep(SLOW_S)
            continue
        if step != int(at_step):
            continue
        if kind in ("nan", "spike", "wipe", "corrupt"):
            return kind
        if kind == "hang":
            time.sleep(10**6)
        if kind == "late":
            time.sleep(LATE_S)
            continue
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            continue
        if kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"injected by HPC_TRAIN_FAULT={spec}")
        os.kill(os.getpid(), signal.SIGKILL)
    return ""
