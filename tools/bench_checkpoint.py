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

from hpc_train.builder import build_run
from hpc_train.config import load_config
from hpc_train.launch.local import single_process_group
from hpc_train.models.decoder import count_params
from hpc_train.train.step import train_step

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


def measure(root: Path, rank_env) -> None:
    cfg = load_config(None, [*MODEL, "train.micro_batch_size=1", f"run_dir={root}/run"])
    run = build_run(cfg, rank_env, torch.device("cpu"), with_data=False)
    model, optimizer = run.model, run.optimizer
    batch = [(torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, 32, dtype=torch.long))]
    train_step(model, optimizer, batch, 1e-4, 1.0)  # creates the AdamW moments
    n_params = count_params(model.chunks[0])
    state = {"model": model.chunks[0].state_dict(), "optim": optimizer.optimizer.state_dict()}
    nbytes = sum(t.nbytes for t in model.parameters) * 3  # weights + two moments, fp32
    run.report = run.checkpointer.report = lambda message: None

    t_raw = timed(lambda: raw_write(root / "raw.bin", nbytes))
    t_torch = timed(lambda: torch_save(state, root / "torch_save.pt"))
    t_save = timed(lambda: run.checkpointer.save(1))
    t_load = timed(run.checkpointer.resume)
    shutil.rmtree(root / "run")
    cfg.checkpoint.async_save = True
    background = build_run(cfg, rank_env, torch.device("cpu"), with_data=False).checkpointer
    background.report = run.report
    t_async_block = timed(lambda: background.save(2))
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
        with single_process_group() as rank_env:
            measure(root, rank_env)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
