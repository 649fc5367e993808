"""Fault injection for the failure tests: real SIGKILLs, hangs and out-of-memory errors at named points of
a step or of the checkpoint commit protocol, chosen by an environment variable (unset: nothing happens)."""

from __future__ import annotations

import os
import signal
import time


def fault_point(point: str, step: int, rank: int) -> None:
    """For failure tests: HPC_TRAIN_FAULT=<point>@<step>[@<rank>[@hang|@oom]] kills this process with
    SIGKILL there (or makes it hang, as a stuck rank would, or raises an out-of-memory error)."""
    spec = os.environ.get("HPC_TRAIN_FAULT", "")
    if not spec:
        return
    name, at_step, *rest = spec.split("@")
    if name == point and int(at_step) == step and int(rest[0] if rest else 0) == rank:
        if rest[1:] == ["hang"]:
            time.sleep(10**6)
        if rest[1:] == ["oom"]:
            import torch

            raise torch.OutOfMemoryError(f"injected by HPC_TRAIN_FAULT={spec}")
        os.kill(os.getpid(), signal.SIGKILL)
