"""Naming the rank that stopped: every rank records where it is (step, and phase within the step) in the
job's rendezvous store; when a collective times out (a peer hung or died), the error lists the ranks
that are behind."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

KEY = "hpc_train/progress/{}"
PHASES = ("started", "finished the backward pass of", "finished")


def _store():
    return distributed_c10d._get_default_store()


def record(step: int, phase: int) -> None:
    """phase: an index into PHASES."""
    _store().set(KEY.format(dist.get_rank()), f"{step} {phase}")


def is_timeout(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def stragglers(world_size: int) -> str:
    """e.g. 'rank 1 started step 2 (the others finished backward of step 2)', or why it could not be read."""
    try:
        store = _store()
        store.set_timeout(timedelta(seconds=5))
        keys = [KEY.format(r) for r in range(world_size)]
        where = {r: tuple(map(int, store.get(k).split())) if store.check([k]) else (0, 0) for r, k in enumerate(keys)}
    except Exception as err:  # the store lives on rank 0's host: it may be gone too
        return f"could not read the other ranks' progress ({err})"
    describe = lambda step, phase: f"{PHASES[phase]} step {step}" if step else "not started training"
    front = max(where.values())
    behind = [f"rank {r} {describe(*w)}" for r, w in where.items() if w < front]
    if not behind:
        return f"every rank {describe(*front)}"
    return ", ".join(behind) + f" (the others {describe(*front)})"
