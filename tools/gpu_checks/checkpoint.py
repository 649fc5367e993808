"""Check 7, checkpoint speed on a GPU node: the full training state of the configs/gpt_1_3b.yaml model (fp32
weights and AdamW's two moments, about 17 GB) saved and loaded by hpc_train against a raw write (+ fsync)
and cold read of the same bytes on the same disk, and what an async save blocks training for
(tools/bench_checkpoint.py's measurements, once each; the files are evicted from the page cache before
each read). At most two copies of the state are on the disk at once (checkpoint.keep_last=1)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hpc_train.builder import build_run
from hpc_train.launch.local import single_process_group
from tools.bench_checkpoint import async_times, read_times, training_state, write_times
from tools.gpu_checks.common import Check, gb, model_keys

SMOKE_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32"]
TARGET = 0.7  # of the raw write's speed
DISK_SHARE = 2.2  # copies of the state the disk must have room for


def run(check: Check) -> None:
    device = check.device
    model = SMOKE_MODEL if check.smoke else [*model_keys("gpt_1_3b", ("vocab_size", "n_layers", "n_heads",
                                                                      "d_model")), "model.seq_len=64"]  # fmt: skip
    threads = 1 if check.smoke else min(4, os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(dir=check.options.scratch, prefix="gpu_check_ckpt_"))
    try:
        with single_process_group(device=device) as rank_env:
            _measure(check, root, rank_env, model, threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(check: Check, root: Path, rank_env, model: list[str], threads: int) -> None:
    device = check.device
    cfg, state, batch, nbytes, n_params = training_state(root, rank_env, model, device, threads,
                                                         ["checkpoint.keep_last=1"])  # fmt: skip
    free = shutil.disk_usage(root).free
    check.setup(f"{n_params / 1e6:,.0f}M parameters + AdamW state = {gb(nbytes)}, {device.type}, "
                f"checkpoint.io_threads={threads}, {root} ({gb(free)} free)")  # fmt: skip
    if free < DISK_SHARE * nbytes:
        check.skip("checkpoint", f"needs {gb(DISK_SHARE * nbytes)} free on {root}, has {gb(free)}")
        return
    writes, _ = write_times(root, state, nbytes, rounds=1, dcp_reference=False)
    raw_write, save = writes["raw_write"], writes["save"]
    check.row("raw write + fsync (disk)", f"{nbytes / raw_write / 1e9:.2f} GB/s ({raw_write:.1f} s)", seconds=raw_write)
    share = raw_write / save
    check.row("hpc_train save (sync)", f"{nbytes / save / 1e9:.2f} GB/s ({save:.1f} s)",
              f"{share:.0%} of the raw write's speed", seconds=save, share=share)  # fmt: skip
    check.target(f"a save reaches {TARGET} of the raw write speed", f"{share:.2f}",
                 share >= TARGET if check.cuda else None)  # fmt: skip
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cfg.checkpoint.async_save = "true"
    fresh = build_run(cfg, rank_env, device, with_data=False)  # as a restarted job: no optimizer state yet
    fresh.checkpointer.report = lambda message: None
    reads = read_times(root, fresh, threads, rounds=1, names=("raw", "load"))
    (root / "raw.bin").unlink()
    check.row("raw read, cold (disk)", f"{nbytes / reads['raw'] / 1e9:.2f} GB/s ({reads['raw']:.1f} s)",
              seconds=reads["raw"])  # fmt: skip
    check.row("hpc_train load, cold", f"{nbytes / reads['load'] / 1e9:.2f} GB/s ({reads['load']:.1f} s)",
              f"{reads['raw'] / reads['load']:.0%} of the raw read's speed", seconds=reads["load"])  # fmt: skip
    saves = async_times(fresh, batch)
    check.row("hpc_train async save", f"blocks {saves['blocking']:.2f} s, loses {saves['lost']:.2f} s, commits in "
              f"{saves['total']:.1f} s", f"blocks {saves['blocking'] / save:.1%} of a sync save", **saves)  # fmt: skip
