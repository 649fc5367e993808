"""Failing together: a problem one rank meets before a collective (a full disk on its node) raised on every
rank, so that none is left waiting in a collective the others never reach."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def raise_together(problem: str | None, group: Any = None, error: type[Exception] = OSError) -> None:
    """`error` of the first rank's `problem` raised on every rank of `group` when any rank has one."""
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        raise error(next(p for p in problems if p))
