"""Local launcher: start `parallel.nproc` ranks on this machine when no Slurm or torchrun started us."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_train.config import ConfigError, JobConfig
from hpc_train.errors import RankFailed, UserError
from hpc_train.launch.bootstrap import STOP_SIGNALS, RankEnv, distributed

USER_ERROR_EXIT = 2


def serve_store() -> dist.TCPStore:
    """The rendezvous store, served by the launcher on a loopback port the OS assigns while binding it (a
    store left to bind itself listens on every interface). Ranks join it as clients, so no port is picked
    ahead of time and lost to another socket before rank 0 binds it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def check_machine(cfg: JobConfig) -> None:
    """A run launched here fits this machine: its device exists and one process per GPU (NCCL's rule), or a
    bounded number of CPU processes (each needs a core's share and its own memory)."""
    problems = []
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        problems.append("train.device=cuda but this machine has no CUDA device visible; use train.device=cpu")
    cores = len(os.sched_getaffinity(0))
    if cuda and torch.cuda.is_available():
        limit, what = torch.cuda.device_count(), f"one per GPU ({torch.cuda.device_count()} here)"
    else:
        limit, what = 4 * cores, f"4 per CPU core ({cores} here)"
    if cfg.parallel.nproc > limit:
        problems.append(f"parallel.nproc={cfg.parallel.nproc} local processes exceed {what}; use parallel.nproc <= "
                        f"{limit}, or `hpc-train submit` to run on a cluster")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def local_rank_env(rank: int, nproc: int, port: int, prefix: str) -> RankEnv:
    return RankEnv(rank, nproc, rank, nproc, 0, "127.0.0.1", port, "local", store_prefix=prefix)


def _spawned(rank: int, entry: Callable[..., Any], nproc: int, port: int, args: tuple) -> None:
    try:
        entry(local_rank_env(rank, nproc, port, "run0"), *args)
    except UserError as err:  # a message, not a traceback; the launcher turns the exit code into RankFailed
        print(f"hpc-train: error: rank {rank}: {err}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def _sequence(rank_env: RankEnv, runs: list[tuple]) -> None:
    for index, (entry, args) in enumerate(runs):
        entry(dataclasses.replace(rank_env, store_prefix=f"run{index}"), *args)


def launch_sequence(entry: Callable[..., Any], nproc: int, arg_lists: list[tuple]) -> None:
    """`entry(rank_env, *args)` for each args in turn, in the same `nproc` worker processes (each run under
    a store prefix of its own): what benchmarks and tests use to try many layouts cheaply."""
    launch_local(_sequence, nproc, [(entry, tuple(args)) for args in arg_lists])


def launch_local(entry: Callable[..., Any], nproc: int, *args: Any) -> Any:
    """Run `entry(rank_env, *args)` on `nproc` ranks. One rank runs in this process and its result is
    returned; several are spawned, and the first failing rank's traceback is raised here. SIGTERM and
    SIGUSR2 sent to this launcher reach every rank, as Slurm signals every task of a job."""
    store = serve_store()  # lives as long as this call: the ranks rendezvous through it
    if nproc == 1:
        return entry(local_rank_env(0, 1, store.port, "run0"), *args)
    context = mp.start_processes(_spawned, args=(entry, nproc, store.port, args), nprocs=nproc,
                                 start_method="spawn", join=False)  # fmt: skip

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
    except mp.ProcessExitedException as err:
        if err.exit_code != USER_ERROR_EXIT:
            raise
        raise RankFailed(f"rank {err.error_index} stopped on the error printed above") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None


@contextmanager
def single_process_group(timeout_s: int = 600) -> Iterator[RankEnv]:
    """A one-rank gloo group in this process, for tools and tests that drive the library's parts directly;
    yields the rank's environment (for `builder.build_run`)."""
    store = serve_store()
    rank_env = local_rank_env(0, 1, store.port, "single")
    with distributed(rank_env, torch.device("cpu"), "gloo", timeout_s):
        yield rank_env
