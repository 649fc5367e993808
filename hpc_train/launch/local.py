"""Local launcher: start `parallel.nproc` ranks on this machine when no Slurm or torchrun started us."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hpc_train.launch.bootstrap import STOP_SIGNALS, RankEnv


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank_env(rank: int, nproc: int, port: int) -> RankEnv:
    return RankEnv(rank, nproc, rank, nproc, 0, "127.0.0.1", port, "local")


def _spawned(rank: int, entry: Callable[..., Any], nproc: int, port: int, args: tuple) -> None:
    entry(local_rank_env(rank, nproc, port), *args)


def _sequence(rank_env: RankEnv, ports: list[int], runs: list[tuple]) -> None:
    for port, (entry, args) in zip(ports, runs, strict=True):
        entry(local_rank_env(rank_env.rank, rank_env.world_size, port), *args)


def launch_sequence(entry: Callable[..., Any], nproc: int, arg_lists: list[tuple]) -> None:
    """`entry(rank_env, *args)` for each args in turn, in the same `nproc` worker processes (each run with
    a rendezvous port of its own): what benchmarks and tests use to try many layouts cheaply."""
    runs = [(entry, tuple(args)) for args in arg_lists]
    launch_local(_sequence, nproc, [free_port() for _ in runs], runs)


def launch_local(entry: Callable[..., Any], nproc: int, *args: Any) -> Any:
    """Run `entry(rank_env, *args)` on `nproc` ranks. One rank runs in this process and its result is
    returned; several are spawned, and the first failing rank's traceback is raised here. SIGTERM and
    SIGUSR2 sent to this launcher reach every rank, as Slurm signals every task of a job."""
    port = free_port()
    if nproc == 1:
        return entry(local_rank_env(0, 1, port), *args)
    context = mp.start_processes(_spawned, args=(entry, nproc, port, args), nprocs=nproc, start_method="spawn",
                                 join=False)  # fmt: skip

    def forward(signum, frame):
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        # once a rank has failed the others cannot finish a step: 5 s to exit, then SIGKILL (a hung rank
        # keeps ignoring SIGTERM, which it treats as a request to stop after its current step)
        while not context.join(grace_period=5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None
