"""Fault injection for the failure tests: real SIGKILLs, hangs, slow ranks and out-of-memory errors at
named points of a step or of the checkpoint commit protocol, chosen by an environment variable (unset:
nothing happens)."""

from __future__ import annotations

import os
import signal
import time

SLOW_S = 0.2  # what a slow rank loses per step


def fault_point(point: str, step: int, rank: int) -> bool:
    """For failure tests: HPC_TRAIN_FAULT=<point>@<step>[@<rank>[@hang|@stop|@oom|@slow|@nan|@spike|@wipe]] kills this
    process with SIGKILL there (or makes it hang, as a stuck rank would, or stops it with SIGSTOP, as a frozen
    node would, or raises an out-of-memory error, or from that step on sleeps SLOW_S there, as a rank on a
    slow node would, or returns True, where the caller makes its value non-finite, or, at the point `batch`
    whose "step" is the global batch's number, poisons that batch, or, at `local_saved`, wipes the node's
    local checkpoints before the kill). Only the first attempt of a run meets its fault: ranks restarted in
    the job (HPC_TRAIN_RESTART > 0) run clean."""
    spec = os.environ.get("HPC_TRAIN_FAULT", "")
    if not spec or os.environ.get("HPC_TRAIN_RESTART", "0") != "0":
        return False
    name, at_step, *rest = spec.split("@")
    kind = rest[1] if len(rest) > 1 else "kill"
    if name != point or int(rest[0] if rest else 0) != rank:
        return False
    if kind == "slow":
        if step >= int(at_step):
            time.sleep(SLOW_S)
        return False
    if step != int(at_step):
        return False
    if kind in ("nan", "spike", "wipe"):
        return True
    if kind == "hang":
        time.sleep(10**6)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return False
    if kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected by HPC_TRAIN_FAULT={spec}")
    os.kill(os.getpid(), signal.SIGKILL)
    return False
