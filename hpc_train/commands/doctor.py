"""`hpc-train doctor`: test an allocation before training on it. Every rank joins (the rendezvous names who
did not), reports its node and device, and one all-reduce per group of the layout (world, dp, tp, pp)
measures its bus bandwidth; rank 0 prints the table, slowest group per role."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hpc_train.bootstrap import RankEnv, distributed, node_name, select_device
from hpc_train.config import JobConfig
from hpc_train.distributed.mesh import ROLES, Mesh
from hpc_train.job import check_run

ITERATIONS = 5


def run_doctor(rank_env: RankEnv, cfg: JobConfig) -> None:
    start = time.monotonic()
    device = select_device(cfg.train.device, rank_env.local_rank)
    p = cfg.parallel
    with distributed(rank_env, device, p.backend, p.timeout_s, p.rendezvous_timeout_s):
        joined_s = time.monotonic() - start
        name = f"{device} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)
        dims = check_run(cfg, rank_env.world_size, check_paths=False)
        mesh = Mesh(dims, device.type)
        nbytes = (256 if device.type == "cuda" else 8) * 2**20
        groups = {"world": dist.group.WORLD, **{role: mesh.group(role) for role in ROLES if mesh.size(role) > 1}}
        seconds = {role: _all_reduce_seconds(group, nbytes, device) for role, group in groups.items()}
        mine = {"rank": rank_env.rank, "node": node_name(), "device": name, "joined_s": joined_s,
                "seconds": seconds}  # fmt: skip
        everyone: list = [None] * rank_env.world_size
        dist.all_gather_object(everyone, mine)
        if rank_env.rank == 0:
            print(report(everyone, mesh, nbytes, f"{rank_env.master_addr}:{rank_env.master_port}"), flush=True)


def _all_reduce_seconds(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> float:
    """Seconds of one all-reduce of `nbytes` in `group` (after a warm-up, mean of ITERATIONS)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buffer, group=group)
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        dist.all_reduce(buffer, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / ITERATIONS


def report(everyone: list[dict], mesh: Mesh, nbytes: int, master: str) -> str:
    """The doctor's table: every rank's place, and per role the slowest group's all-reduce bus bandwidth
    (2 (n - 1) / n x bytes / seconds, the figure nccl-tests prints)."""
    lines = [f"doctor: {len(everyone)} ranks ({', '.join(f'{k} {v}' for k, v in mesh.dims.as_dict().items())}) "
             f"joined through {master}", f"{'rank':>5}  {'node':<12} {'joined s':>8}  device"]  # fmt: skip
    lines += [f"{r['rank']:>5}  {r['node']:<12} {r['joined_s']:>8.2f}  {r['device']}" for r in everyone]
    lines.append(f"all-reduce of {nbytes / 2**20:.0f} MiB, bus bandwidth of the slowest group per role:")
    for role in everyone[0]["seconds"]:
        size = len(everyone) if role == "world" else mesh.size(role)
        slowest = max(everyone, key=lambda r: r["seconds"][role])
        seconds = slowest["seconds"][role]
        busbw = 2 * (size - 1) / size * nbytes / seconds / 1e9
        lines.append(f"  {role:<6} ({size} ranks per group): {busbw:8.2f} GB/s, {seconds * 1e3:.1f} ms (slowest: "
                     f"the group of rank {slowest['rank']} on {slowest['node']})")  # fmt: skip
    lines.append("doctor: every rank joined and every group reduced")
    return "\n".join(lines)
