"""In-job restart: a rank process that dies, raises or hangs restarts every rank of the run from its newest
checkpoint, up to `parallel.max_restarts` times, without going back to the queue (torchrun's
--max-restarts, for Slurm's one-task-per-rank jobs). The local launcher restarts its own children; under
Slurm every srun task runs `supervise`, which starts its rank as a child process and restarts it together
with the others'. The supervisors agree through a store that rank 0's supervisor serves on the job's
port and that outlives every rank process; each start of the ranks rendezvouses under a prefix of its own.
A rank that stopped on a UserError (bad input, a non-finite loss) is not restarted: it would stop again."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from typing import Any

import torch.distributed as dist

from hpc_train.bootstrap import STOP_SIGNALS, RankEnv, node_name, rendezvous
from hpc_train.errors import USER_ERROR_EXIT, RankFailed, UserError
from hpc_train.resilience.bad_nodes import blame
from hpc_train.resilience.watchdog import Heartbeats

KEY = "hpc_train/restart/{}/{}"  # attempt, what
FIRST_FAILURE = "the first rank to fail: "  # what a failed job's error names, in every rank's log (launch/slurm.py)
NODE_SIGNALS = (signal.SIGKILL, signal.SIGBUS)  # a rank killed by these blames its node (the OOM killer, hardware)


@dataclass(frozen=True)
class Attempt:
    """Which start of the ranks this is (0, then one per in-job restart), and when the previous one failed:
    exported to the ranks as HPC_TRAIN_RESTART and HPC_TRAIN_FAILED_AT (train/loop.py logs the time lost,
    faults.py injects faults into the first start only)."""

    number: int
    failed_at: float = 0.0

    def export(self) -> None:
        os.environ.update(HPC_TRAIN_RESTART=str(self.number), HPC_TRAIN_FAILED_AT=repr(self.failed_at))


# What every rank process imports (torch, DTensor, DCP, the training loop and what it builds): imported once,
# by the fork server that `rank_processes` starts, whose forks then start in milliseconds instead of each
# importing torch again (seconds of CPU a rank, every start and every in-job restart). torch._dynamo is
# imported lazily by torch itself (the first nn.init call of a model build), 0.9 s of CPU in every rank.
RANK_IMPORTS = ["torch._dynamo", "hpc_train.train.loop", "hpc_train.builder"]


def rank_processes() -> BaseContext:
    """How launchers start rank processes: forked from a server that has imported RANK_IMPORTS and nothing
    else (no threads, no CUDA, no process group: what makes a plain fork of the launcher unsafe). The server
    starts with the first rank and serves every later one; a fork gets the launcher's environment and
    output streams as they are at its start (`LauncherState`), not the server's."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["hpc_train.resilience.fork_server", *RANK_IMPORTS])  # it ignores stops
    return context


class LauncherState:
    """The launcher's environment and stdout/stderr when a rank starts: what a spawned process inherits,
    handed to a fork of the server, which has its own from when it started. Pickling it for a process being
    started duplicates the two file descriptors into that process (multiprocessing's DupFd)."""

    def __init__(self, environ: dict[str, str] | None = None, streams: tuple = ()) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.streams = streams

    def __reduce__(self) -> tuple:
        return LauncherState, (self.environ, (reduction.DupFd(1), reduction.DupFd(2)))

    def adopt(self) -> None:
        """In the rank process: the launcher's environment, and its stdout and stderr on fds 1 and 2."""
        os.environ.clear()
        os.environ.update(self.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, stream in zip((1, 2), self.streams, strict=True):
            duplicate = stream.detach()
            os.dup2(duplicate, fd)
            os.close(duplicate)


def run_rank(
    rank_env: RankEnv, entry: Callable[..., Any], attempt: Attempt, args: tuple, launcher: LauncherState
) -> None:
    """The body of a rank process that its launcher may restart: a UserError is printed as a message and
    becomes exit status USER_ERROR_EXIT, which the launcher does not restart."""
    for stop_signal in STOP_SIGNALS:  # the fork server ignores them (resilience/fork_server.py); a rank does not
        signal.signal(stop_signal, signal.SIG_DFL)
    launcher.adopt()
    attempt.export()
    # what the process imported (torch's ~300k objects) is never garbage: frozen, the collection each run
    # makes when it leaves its process group (bootstrap.distributed) skips it (0.25 s less per run)
    gc.freeze()
    try:
        entry(rank_env, *args)
    except UserError as err:
        print(f"hpc-train: error: rank {rank_env.rank}: {err}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def announce_restart(what: str, attempt: Attempt, max_restarts: int) -> None:
    print(f"hpc-train: {what}; restarting every rank from the newest checkpoint (in-job restart "
          f"{attempt.number} of parallel.max_restarts={max_restarts})", file=sys.stderr, flush=True)  # fmt: skip


def exit_description(exitcode: int) -> str:
    """A rank process's end in words: 'was killed by SIGKILL', 'exited with status 1'."""
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def run_task(entry: Callable[..., Any], rank_env: RankEnv, cfg: Any) -> None:
    """A rank started by srun or torchrun: supervised under Slurm when in-job restarts are allowed (and
    where they are spent, every rank's error names the first rank to fail, its node and how it ended),
    else `entry(rank_env, cfg)` in this process (srun then reports each task's end, and torchrun has its own
    --max-restarts)."""
    if rank_env.source == "slurm" and cfg.parallel.max_restarts:
        supervise(entry, rank_env, cfg)
    else:
        entry(rank_env, cfg)


def supervise(entry: Callable[..., Any], rank_env: RankEnv, cfg: Any) -> None:
    """One srun task of a job with `parallel.max_restarts` > 0: run rank `rank_env.rank` as a child process,
    and start every rank again when any of them fails, up to max_restarts times."""
    store = rendezvous(rank_env, cfg.parallel.rendezvous_timeout_s)  # every supervisor is here
    store.set_timeout(timedelta(seconds=cfg.parallel.timeout_s))
    attempt = Attempt(0)
    try:
        while (failure := _attempt(entry, rank_env, cfg, attempt, store)) is not None:
            failed_at, user_error, what = failure
            if user_error:
                raise RankFailed(f"{FIRST_FAILURE}{what} on the error printed in its log")
            if attempt.number >= cfg.parallel.max_restarts:
                spent = f"; the parallel.max_restarts={cfg.parallel.max_restarts} in-job restarts are spent"
                raise RuntimeError(f"{FIRST_FAILURE}{what}{spent if cfg.parallel.max_restarts else ''}")
            attempt = Attempt(attempt.number + 1, failed_at)
            if rank_env.rank == 0:
                announce_restart(what, attempt, cfg.parallel.max_restarts)
    finally:
        _leave(store, rank_env)


def _attempt(entry: Callable[..., Any], rank_env: RankEnv, cfg: Any, attempt: Attempt, store: dist.Store):
    """Start this rank and watch it and the others. None when every rank finished (or was stopped by a
    signal forwarded to it); else (when, whether a user error, what) of the first failure, as every
    supervisor agreed on it through the store."""
    failed = KEY.format(attempt.number, "failed")
    done = KEY.format(attempt.number, "done")
    rank = dataclasses.replace(rank_env, store_prefix=f"attempt{attempt.number}")
    # a rank alone has no peer to locate it when frozen (with peers, theirs do, with every stack)
    beats = Heartbeats() if rank_env.world_size == 1 else None
    launcher = LauncherState(beats.environ() if beats else None)
    child = rank_processes().Process(target=run_rank, args=(rank, entry, attempt, (cfg,), launcher))
    child.start()
    with forwarding_stop_signals([child]) as forwarded, closing(beats) if beats else nullcontext():
        try:
            frozen = None
            while child.exitcode is None and not store.check([failed]) and not frozen:
                child.join(0.5)
                frozen = beats and beats.frozen()
            if frozen:
                child.kill()
                child.join()
            code = child.exitcode
            if code == 0 or (code is not None and -code in forwarded):  # finished, or stopped before it could save
                store.add(done, 1)
                while store.add(done, 0) < rank_env.world_size and not store.check([failed]):
                    time.sleep(0.5)
                if not store.check([failed]):
                    return None
            elif code is not None:
                how = frozen[rank_env.rank] if frozen else exit_description(code)
                what = f"rank {rank_env.rank} on {node_name()} {how}"
                mine = f"{time.time()!r} {'user' if code == USER_ERROR_EXIT else 'crash'} {what}"
                if store.compare_set(failed, "", mine).decode() == mine and -code in NODE_SIGNALS and not frozen:
                    blame(cfg.run_dir, node_name(), what)
            failed_at, kind, what = store.get(failed).decode().split(" ", 2)
            return float(failed_at), kind == "user", what
        finally:
            if child.is_alive():  # another rank failed: this one cannot finish its step
                child.kill()
                child.join()


@contextmanager
def forwarding_stop_signals(processes: list) -> Iterator[list[int]]:
    """Within the block, SIGTERM and SIGUSR2 sent to this launcher reach each of `processes` still running,
    as Slurm signals every task; yields the signals forwarded so far."""
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        forwarded.append(signum)
        for process in processes:
            if process.exitcode is None:
                with suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield forwarded
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _leave(store: dist.Store, rank_env: RankEnv, wait_s: float = 30.0) -> None:
    """Rank 0's supervisor serves the store: it leaves last, once the others have read what they need (or
    after wait_s: a supervisor that is gone never says so)."""
    with suppress(Exception):  # the store may be gone with rank 0's node: leaving must not hide the error
        store.add("hpc_train/restart/left", 1)
        deadline = time.monotonic() + wait_s
        while rank_env.rank == 0 and time.monotonic() < deadline:
            if store.add("hpc_train/restart/left", 0) >= rank_env.world_size:
                return
            time.sleep(0.2)
