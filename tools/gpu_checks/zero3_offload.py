"""Check 8, ZeRO-3 (FSDP2) with CPU offload on CUDA: one step at dp 2 with optim.offload=cpu against the same
step without it, from the same weights and batches: the same loss, the same update of every parameter
shard (the offloaded update runs on the host's cores), and the host memory counted three ways: what the step
reports under `host` (shards, their gradients, the optimizer state), the planner's host bytes, and how much
the process's resident memory grew. One GPU holds both ranks: NCCL refuses two ranks on one device, so the
collectives go through gloo (parallel.backend=gloo, which stages CUDA tensors through pinned host memory):
FSDP2's CUDA path and its offload run, their collectives are gloo's, not NCCL's."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local
from hpc_train.placement import local
from hpc_train.planner import estimate
from hpc_train.train.step import StepOptions, train_step
from tools.gpu_checks.common import Check, gib, sync

GPU_MODEL = ["model.n_layers=12", "model.d_model=1024", "model.n_heads=16", "model.seq_len=1024",
             "model.vocab_size=50257", "train.micro_batch_size=2", "train.precision=bf16"]  # fmt: skip
SMOKE_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32",
               "train.micro_batch_size=2"]  # fmt: skip
LAYOUT = ["optim.zero_stage=3", "parallel.nproc=2", "parallel.backend=gloo", "logging.progress=none"]
LR = 1e-3
TOLERANCE = 1e-3  # of the largest update: the host's AdamW against the device's


def resident_bytes() -> int:
    """The process's resident memory now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def one_step(rank_env: RankEnv, keys: list[str], offload: str, device: torch.device) -> dict:
    """A fresh run after one step: the loss, each parameter shard's update, and the memory."""
    cfg = load_config(None, [*keys, f"optim.offload={offload}"])
    gc.collect()
    rss = resident_bytes()
    run = build_run(cfg, rank_env, device, with_data=False)
    before = [local(p).detach().float().cpu().clone() for p in run.model.parameters]
    gen = torch.Generator().manual_seed(rank_env.rank)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    batch = [Batch(*(torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device) for _ in range(2)))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    result = train_step(run.model, run.optimizer, batch, LR, StepOptions(cfg.optim.grad_clip))
    sync(device)
    seconds = time.perf_counter() - start
    updates = [local(p).detach().float().cpu() - b for p, b in zip(run.model.parameters, before, strict=True)]
    plan = estimate(cfg, check_run(cfg, rank_env.world_size, check_paths=False))
    out = {"loss": result.figures[0].item(), "updates": updates, "memory": result.memory, "seconds": seconds,
           "rss_growth": resident_bytes() - rss, "planned_host": plan.host, "planned_total": plan.total,
           "device_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}  # fmt: skip
    del run
    gc.collect()
    return out


def worker(rank_env: RankEnv, keys: list[str], device_type: str, out: str) -> None:
    """Both ranks on the first GPU (or the CPU), gloo between them; rank 0 writes the comparison to `out`."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with distributed(rank_env, device, "gloo", 300):
        plain = one_step(rank_env, keys, "none", device)
        offload = one_step(rank_env, keys, "cpu", device)
    scale = max(u.abs().max().item() for u in plain["updates"])
    error = max((a - b).abs().max().item() for a, b in zip(offload["updates"], plain["updates"], strict=True))
    if rank_env.rank == 0:
        summary = {name: {k: v for k, v in r.items() if k != "updates"} for name, r in
                   (("plain", plain), ("offload", offload))}  # fmt: skip
        Path(out).write_text(json.dumps({**summary, "update_error": error / scale, "update_scale": scale}))


def run(check: Check) -> None:
    keys = [*(SMOKE_MODEL if check.smoke else GPU_MODEL), *LAYOUT, f"train.device={check.device.type}"]
    check.setup(f"{' '.join(k.split('.', 1)[1] for k in keys)}; both ranks on one {check.device.type} device")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zero3.json"
        launch_local(worker, 2, keys, check.device.type, str(out))
        r = json.loads(out.read_text())
    plain, offload = r["plain"], r["offload"]
    same_loss = abs(plain["loss"] - offload["loss"]) <= 1e-6 * max(1.0, abs(plain["loss"]))
    ok = same_loss and r["update_error"] <= TOLERANCE
    check.row("one step, offload vs none", f"loss {offload['loss']:.5f} vs {plain['loss']:.5f}, update error "
              f"{r['update_error']:.1e} of the largest update",
              f"step {offload['seconds']:.2f} s vs {plain['seconds']:.2f} s", "ok" if ok else "failed: parity",
              **{k: r[k] for k in ("update_error", "update_scale")})  # fmt: skip
    if not ok:
        check.fail(f"offload differs: loss {offload['loss']} vs {plain['loss']}, update error {r['update_error']:.1e}")
    host = offload["memory"].get("host", 0)
    if not host:
        check.fail("the offloaded step reported no bytes in host memory")
    versus = f"planner {offload['planned_host'] / host - 1:+.1%}" if host else ""
    check.row("host memory (rank 0)", f"step reports {gib(host)}, planned {gib(offload['planned_host'])}, resident "
              f"grew {gib(offload['rss_growth'])}", versus, reported=host, planned=offload["planned_host"],
              rss_growth=offload["rss_growth"])  # fmt: skip
    if check.cuda:
        check.row("device peak (rank 0)", f"offload {gib(offload['device_peak'])}, none {gib(plain['device_peak'])}",
                  f"planned {gib(offload['planned_total'])} and {gib(plain['planned_total'])}",
                  offload=offload["device_peak"], plain=plain["device_peak"])  # fmt: skip
    else:
        check.skip("device peak (rank 0)", "skipped: needs CUDA")
