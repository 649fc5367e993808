"""Rank bootstrap: who am I, from Slurm's or torchrun's environment, and joining the process group.

Under Slurm (an srun step), rank/world/local rank come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID,
MASTER_ADDR is the first host of the expanded SLURM_JOB_NODELIST and MASTER_PORT is derived from the job
id, so every task of the job computes the same rendezvous without talking to the others.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpc_train.errors import UserError

# below Linux's ephemeral range (32768-60999), so no outgoing connection can be holding the derived port
PORT_BASE, PORT_SPAN = 20000, 12000
# Slurm's warning before the time limit (--signal=USR2@<delay>, submitit's choice) and its preemption/cancel
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # slurm | torchrun | local
    # set where a launcher serves the rendezvous store (the local launcher, a restart supervisor, torchrun's
    # agent): join it as a client under this prefix (one per start) instead of having rank 0 bind master_port
    store_prefix: str = ""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5.
    Zero padding is kept; several bracket groups in one name (`r[1-2]n[1-2]`) expand as a product."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, rest = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(f"{prefix}{n:0{width}d}{tail}" for tail in expand_nodelist(rest) or [""])
    return hosts


def slurm_master_port(job_id: str | int) -> int:
    return PORT_BASE + int(job_id) % PORT_SPAN


def detect_rank_env(env: Mapping[str, str] | None = None) -> RankEnv | None:
    """The distributed environment this process was started in, or None when it was started alone."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also when torchrun runs inside a Slurm job)
        return RankEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            node_rank=int(env.get("GROUP_RANK", 0)), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)), source="torchrun",
            # torchrun's agent serves the store on MASTER_PORT: join it, one prefix per torchrun restart
            store_prefix=f"torchrun{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "",
        )  # fmt: skip
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:  # an srun step
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        return RankEnv(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(re.match(r"\d+", tasks_per_node).group()),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=int(env.get("MASTER_PORT") or slurm_master_port(env["SLURM_JOB_ID"])), source="slurm",
        )  # fmt: skip
    return None


def node_name() -> str:
    """This process's node as Slurm knows it (several emulated nodes can share one host name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def describe_rank(rank_env: RankEnv) -> dict[str, int | str]:
    """Where this rank runs, for the run's rank_layout.json (the node name as Slurm knows it)."""
    return {
        "rank": rank_env.rank, "local_rank": rank_env.local_rank, "node_rank": rank_env.node_rank,
        "node": node_name(), "source": rank_env.source,
    }  # fmt: skip


def select_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bound_device(device: torch.device, backend: str) -> torch.device | None:
    """The device NCCL binds its communicator to, with its index (torch refuses a bare "cuda"); none for
    gloo, even with CUDA tensors: a bound gloo group makes DeviceMesh split it, and gloo's options cannot be
    copied for the split (torch 2.11, seen on an H200)."""
    if backend != "nccl" or device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def cpu_threads(rank_env: RankEnv, env: Mapping[str, str] | None = None) -> int:
    """Intra-op threads for a CPU rank: OMP_NUM_THREADS where it is set (the launcher's or the user's choice, as
    under torchrun), else this node's cores shared between its ranks. The node's cores are the ones this
    process may run on, bounded inside a Slurm job by the CPUs it was allocated on the node
    (SLURM_CPUS_ON_NODE): with TaskPlugin=task/none the affinity mask still holds every core, and ranks that
    each take every core oversubscribe the node (tiny steps ran 4x slower so on a loaded 2-core machine)."""
    env = os.environ if env is None else env
    if (explicit := env.get("OMP_NUM_THREADS", "")).isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, node_cores(env) // rank_env.local_world_size)


def node_cores(env: Mapping[str, str] | None = None) -> int:
    """The cores this node's ranks share: the ones this process may run on, bounded inside a Slurm
    allocation (however the ranks were started) by the CPUs it holds on the node."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0))
    if env.get("SLURM_CPUS_ON_NODE", "").isdigit():
        cores = min(cores, int(env["SLURM_CPUS_ON_NODE"]))
    return cores


@contextmanager
def distributed(
    rank_env: RankEnv, device: torch.device, backend: str, timeout_s: int, rendezvous_timeout_s: int = 300
) -> Iterator[None]:
    """Join the default process group (nccl on CUDA, gloo on CPU, or as configured) for the block, once every
    rank has arrived (`rendezvous`); leaving it, however it ends, destroys every group and frees them
    before the interpreter exits (`_free_groups`). Leaving it normally, rank 0 waits for every rank to leave:
    it may serve the store, and a rank whose last step needed no collective (dp only) may still be using it."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(rank_env))
    store = rendezvous(rank_env, rendezvous_timeout_s)
    store.set_timeout(timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend=backend, rank=rank_env.rank, world_size=rank_env.world_size, timeout=timedelta(seconds=timeout_s),
        device_id=bound_device(device, backend), store=store,
    )  # fmt: skip
    try:
        yield
    except BaseException as err:
        _free_groups(err)
        raise
    else:  # rank 0 serves the store the others still use until they leave (the watchdog's records): it goes last
        left = [f"hpc_train/left/{r}" for r in range(rank_env.world_size)]
        store.set(left[rank_env.rank], "")
        if rank_env.rank == 0:
            store.wait(left, timedelta(seconds=timeout_s))
    finally:
        dist.destroy_process_group()
        gc.collect()


class RendezvousError(UserError):
    """The ranks could not all meet: the message names the address, who arrived and the usual causes."""


RENDEZVOUS_CAUSES = (
    "usual causes: the master's host name resolves differently (or not at all) on some node; a firewall "
    "blocks the port between the nodes; the tasks disagree on the world size (another --ntasks, or a task "
    "that failed before joining: see its log)"
)


def rendezvous(rank_env: RankEnv, timeout_s: int) -> dist.Store:
    """The job's store, once every rank has marked its arrival in it: served by rank 0 on master_port (or by
    the local launcher or a restart supervisor: `store_prefix`), joined by the others as clients. Waits at
    most `timeout_s` (parallel.rendezvous_timeout_s), then names what failed instead of hanging."""
    where = f"{rank_env.master_addr}:{rank_env.master_port}"
    serves = rank_env.rank == 0 and not rank_env.store_prefix
    try:
        store: dist.Store = dist.TCPStore(rank_env.master_addr, rank_env.master_port, is_master=serves,
                                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
    except Exception as err:  # DistNetworkError and friends: connection refused, timed out, name not resolved
        doing = f"serve the rendezvous store on port {rank_env.master_port}" if serves else f"reach {where}"
        raise RendezvousError(
            f"rank {rank_env.rank}: could not {doing} within parallel.rendezvous_timeout_s={timeout_s}s "
            f"({str(err).strip().splitlines()[0]}); {_resolves(rank_env.master_addr)}; {RENDEZVOUS_CAUSES}"
        ) from None
    if rank_env.store_prefix:
        store = dist.PrefixStore(rank_env.store_prefix, store)
    keys = [f"hpc_train/arrived/{r}" for r in range(rank_env.world_size)]
    store.set(keys[rank_env.rank], socket.gethostname())
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # DistStoreError: the wait timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RendezvousError(
            f"rank {rank_env.rank}: rendezvous at {where}: {rank_env.world_size - len(missing)} of "
            f"{rank_env.world_size} ranks arrived within parallel.rendezvous_timeout_s={timeout_s}s; never "
            f"arrived: rank(s) {', '.join(map(str, missing))}; {RENDEZVOUS_CAUSES}"
        ) from None
    return store


def _resolves(host: str) -> str:
    try:
        return f"{host} resolves to {socket.gethostbyname(host)} here"
    except OSError:
        return f"{host} does not resolve here"


def _free_groups(err: BaseException) -> None:
    """Drop the variables of the frames an error unwound (and of the errors it chains). Those frames hold
    the run, whose meshes and modules hold the process groups in reference cycles; a group still alive at
    interpreter exit is destroyed there, where gloo's worker threads can no longer take the GIL and the
    process aborts ("terminate called without an active exception") instead of exiting with its error."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
