"""Local launcher: start `parallel.nproc` ranks on this machine when no Slurm or torchrun started us."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.errors import HANG_EXIT, USER_ERROR_EXIT, RankFailed
from hpc_train.observe.goodput import LAUNCHED_AT
from hpc_train.resilience.restart import (
    Attempt,
    LauncherState,
    announce_restart,
    exit_description,
    forwarding_stop_signals,
    rank_processes,
    run_rank,
)
from hpc_train.resilience.watchdog import Heartbeats


def serve_store() -> dist.TCPStore:
    """The rendezvous store, served by the launcher on a loopback port the OS assigns while binding it (a
    store left to bind itself listens on every interface). Ranks join it as clients, so no port is picked
    ahead of time and lost to another socket before rank 0 binds it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def local_rank_env(rank: int, nproc: int, port: int, prefix: str) -> RankEnv:
    return RankEnv(rank, nproc, rank, nproc, 0, "127.0.0.1", port, "local", store_prefix=prefix)


def _started(
    rank: int, entry: Callable[..., Any], nproc: int, port: int, attempt: Attempt, args: tuple, launcher: LauncherState
) -> None:
    run_rank(local_rank_env(rank, nproc, port, f"run0-{attempt.number}"), entry, attempt, args, launcher)


def _sequence(rank_env: RankEnv, runs: list[tuple]) -> None:
    for index, (entry, args) in enumerate(runs):
        if "torch._dynamo" in sys.modules:  # each run compiles afresh, as in a process of its own (inductor
            torch._dynamo.reset()  # can fail recompiling a block for another tensor-parallel layout); the
            # fork server's ranks have it imported, so they always reset (cheap: it clears caches)
        entry(dataclasses.replace(rank_env, store_prefix=f"run{index}"), *args)


def launch_sequence(entry: Callable[..., Any], nproc: int, arg_lists: list[tuple]) -> None:
    """`entry(rank_env, *args)` for each args in turn, in the same `nproc` worker processes (each run under
    a store prefix of its own): what benchmarks and tests use to try many layouts cheaply."""
    launch_runs(nproc, [(entry, tuple(args)) for args in arg_lists])


def launch_runs(nproc: int, runs: list[tuple[Callable[..., Any], tuple]], max_restarts: int = 0) -> None:
    """`entry(rank_env, *args)` for each (entry, args) of `runs` in turn, in the same `nproc` worker
    processes: `launch_sequence` with an entry of each run's own."""
    launch_local(_sequence, nproc, runs, max_restarts=max_restarts)


def launch_local(entry: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0) -> Any:
    """Run `entry(rank_env, *args)` on `nproc` ranks. One rank without restarts runs in this process and its
    result is returned; otherwise the ranks are started (forks of a server that has imported
    torch: `rank_processes`), and the first failing rank's error is raised here
    once `max_restarts` in-job restarts are spent: a rank that dies, raises, hangs or freezes restarts every
    rank (the run resumes from its newest checkpoint); one that stopped on a UserError does not, since bad input
    stays bad. SIGTERM and SIGUSR2 sent to this launcher reach every rank, as Slurm signals every task."""
    store = serve_store()  # lives as long as this call: the ranks rendezvous through it
    os.environ[LAUNCHED_AT] = repr(time.time())  # where a run's start-up begins (observe/goodput.py)
    if nproc == 1 and not max_restarts:
        return entry(local_rank_env(0, 1, store.port, "run0-0"), *args)
    attempt = Attempt(0)
    while True:
        try:
            return _attempt(entry, nproc, store.port, attempt, args)
        except ProcessException as err:
            if attempt.number >= max_restarts:
                if getattr(err, "exit_code", None) == HANG_EXIT:
                    hung = f"rank {err.error_index} stopped a hung run: the summary is printed above"
                    raise RankFailed(hung) from None
                if isinstance(err, RankFrozen):
                    raise RankFailed(f"rank {err.error_index} {err}") from None
                raise
            attempt = Attempt(attempt.number + 1, time.time())
            announce_restart(f"rank {err.error_index} {_how(err)}", attempt, max_restarts)


class RankFrozen(ProcessException):
    """A rank process frozen where no rank was alive to locate it (`Heartbeats`): every rank was killed."""


def _how(err: ProcessException) -> str:
    """What happened to the rank, for the restart's log line."""
    if isinstance(err, RankFrozen):
        return str(err)
    if isinstance(err, mp.ProcessExitedException):
        return exit_description(err.exit_code)
    return "failed: " + str(err).strip().splitlines()[-1]


def _attempt(entry: Callable[..., Any], nproc: int, port: int, attempt: Attempt, args: tuple) -> None:
    method = rank_processes().get_start_method()  # the fork server, with its imports
    beats = Heartbeats()
    context = mp.start_processes(_started, args=(entry, nproc, port, attempt, args, LauncherState(beats.environ())),
                                 nprocs=nproc, start_method=method, join=False)  # fmt: skip
    with forwarding_stop_signals(context.processes), closing(beats):
        try:
            # once a rank has failed the others cannot finish a step: 5 s to exit, then SIGKILL (a hung rank
            # keeps ignoring SIGTERM, which it treats as a request to stop after its current step)
            while not context.join(timeout=1, grace_period=5):
                if frozen := beats.frozen():
                    raise _killed(context.processes, frozen)
        except mp.ProcessExitedException as err:
            if err.exit_code == USER_ERROR_EXIT:
                raise RankFailed(f"rank {err.error_index} stopped on the error printed above") from None
            raise


def _killed(processes: list, frozen: dict[int, str]) -> RankFrozen:
    """Every rank process killed (a frozen one ignores SIGTERM, and the others wait on it): the error naming
    the frozen ranks, the first as the failed one."""
    for process in processes:
        process.kill()
        process.join()
    first, *others = sorted(frozen)
    what = "; ".join([frozen[first], *(f"rank {r} {frozen[r]}" for r in others)])
    return RankFrozen(what, first, processes[first].pid)


@contextmanager
def single_process_group(timeout_s: int = 600, device: torch.device | None = None) -> Iterator[RankEnv]:
    """A one-rank group in this process (gloo, or nccl for a CUDA `device`), for tools and tests that drive
    the library's parts directly; yields the rank's environment (for `builder.build_run`)."""
    store = serve_store()
    rank_env = local_rank_env(0, 1, store.port, "single")
    with distributed(rank_env, device or torch.device("cpu"), "auto", timeout_s):
        yield rank_env
