"""Checkpoint speed on CPU for a ~100M-parameter GPT with AdamW state (one process): hpc_train's save
(DCP shards + sha256 manifest + atomic commit), the blocking part of an async save, and a verified load,
against `torch.save` of the same state and against the disk's write bandwidth measured in the same run
(a raw write + fsync of the same number of bytes). Prints seconds, GB/s and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hpc_train.checkpoint.checkpointer import Checkpointer
from hpc_train.config import load_config
from hpc_train.distributed.mesh import build_mesh
from hpc_train.distributed.parallelize import parallelize
from hpc_train.distributed.zero import build_optimizer
from hpc_train.launch.local import single_process_group
from hpc_train.model.gpt import count_params
from hpc_train.train.loop import train_step

MODEL = ["model.n_layers=14", "model.d_model=768", "model.n_heads=12", "model.seq_len=32"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_write(path: Path, nbytes: int) -> None:
    block = os.urandom(8 * 2**20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block) + 1):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def measure(root: Path) -> None:
    cfg = load_config(None, [*MODEL, "train.micro_batch_size=1", f"run_dir={root}/run"])
    model = parallelize(cfg, build_mesh("cpu", 1, 1, 1), torch.device("cpu"))
    optimizer = build_optimizer(model.parameters, cfg.optim, model.group("dp"))
    batch = [(torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, 32, dtype=torch.long))]
    train_step(model, optimizer, batch, 1e-4, 1.0)  # creates the AdamW moments
    n_params = count_params(model.chunks[0])
    state = {"model": model.chunks[0].state_dict(), "optim": optimizer.optimizer.state_dict()}
    nbytes = sum(t.nbytes for t in model.parameters) * 3  # weights + two moments, fp32
    progress = {"step": 1, "consumed_samples": 1, "loss_scaler": None}
    quiet = lambda message: None

    t_raw = timed(lambda: raw_write(root / "raw.bin", nbytes))
    t_torch = timed(lambda: torch_save(state, root / "torch_save.pt"))
    sync = Checkpointer(cfg, model, optimizer, quiet)
    t_save = timed(lambda: sync.save(1, progress))
    t_load = timed(sync.resume)
    shutil.rmtree(root / "run")
    cfg.checkpoint.async_save = True
    background = Checkpointer(cfg, model, optimizer, quiet)
    t_async_block = timed(lambda: background.save(2, progress))
    t_async_total = t_async_block + timed(background.wait)

    gb = nbytes / 1e9
    print(f"GPT {n_params / 1e6:.1f}M params + AdamW state = {gb:.2f} GB (fp32), 1 process, {root}")
    rows = [
        ("raw write + fsync (disk)", t_raw),
        ("torch.save + fsync", t_torch),
        ("hpc_train save (sync)", t_save),
        ("hpc_train async: blocking", t_async_block),
        ("hpc_train async: total", t_async_total),
        ("hpc_train load (verified)", t_load),
    ]
    print(f"{'':<28} {'seconds':>8} {'GB/s':>7} {'vs torch.save':>14} {'vs disk':>8}")
    for name, seconds in rows:
        print(f"{name:<28} {seconds:>8.2f} {gb / seconds:>7.2f} {seconds / t_torch:>14.2f} {seconds / t_raw:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt_"))
    try:
        with single_process_group():
            measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
