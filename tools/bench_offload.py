"""Optimizer offload, measured in one process: a training step of a GPT (one rank, ZeRO-1, fp32) with
`optim.offload` none, cpu and nvme, then a checkpoint save of each; and the nvme update's own throughput
against a raw sequential read plus write of the same bytes on the same disk (the masters and both moments of
every parameter, read and written back once an update, as the offload's files are: O_DIRECT where the disk
takes it, in the ring's chunk size). The raw reference runs in the same process, between the steps.

    python tools/bench_offload.py                               # ~86M parameters (d_model 768, 12 layers)
    python tools/bench_offload.py --dir /mnt/nvme/bench         # on another disk
    python tools/bench_offload.py --rule muon                   # Muon: a second pass over the masters

DeepSpeed's ZeRO-Infinity (its NVMe offload) is not run: it is not a dependency of this project, and its
async I/O op builds only against libaio with a CUDA toolkit, which the CPU machines here do not have.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import load_config
from hpc_train.launch.local import single_process_group
from hpc_train.optim.nvme import StateFiles
from hpc_train.optim.zero_nvme import KEYS
from hpc_train.train.step import train_step


def step_seconds(overrides: list[str], rank_env, steps: int) -> tuple[float, float, float, object]:
    """(the median training step, the median update alone, a synchronous save after them, the run) of `steps`
    steps after a first one."""
    cfg = load_config(None, overrides)
    run = build_run(cfg, rank_env, torch.device("cpu"), with_data=False)
    run.report = lambda message: None
    batch = [Batch(*(torch.zeros(1, cfg.model.seq_len, dtype=torch.long),) * 2)]
    optimizer, updates = run.optimizer, []
    inner = optimizer.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        inner(*args, **kwargs)
        updates.append(time.perf_counter() - start)

    optimizer.step = timed_step
    train_step(run.model, optimizer, batch, 1e-4)  # the first: allocations
    walls, updates[:] = [], []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(run.model, optimizer, batch, 1e-4)
        walls.append(time.perf_counter() - start)
    start = time.perf_counter()
    run.checkpointer.save(steps + 1)
    return statistics.median(walls), statistics.median(updates), time.perf_counter() - start, run


def raw_read_write(directory: Path, numel: int, buffer_bytes: int, rounds: int) -> float:
    """Seconds to read and write back `numel` fp32 elements of three files chunk by chunk, sequentially, in
    one thread, through the same kind of file (O_DIRECT where the offload's files use it): the median of
    `rounds`."""
    files = StateFiles(str(directory), "raw", KEYS, numel, buffer_bytes, pinned=False)
    files.stream(lambda chunk: None, read=False)  # allocated on the disk first, as the offload's are
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for start_at in range(0, numel, files.chunk):
            n = min(files.chunk, numel - start_at)
            for key in files.keys:
                files._io(False, key, start_at, files.slots[0][key][: files._blocks(start_at, n)])
                files._io(True, key, start_at, files.slots[0][key][: files._blocks(start_at, n)])
        times.append(time.perf_counter() - start)
    files.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="the offload directory's disk (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--buffer-mb", type=float, default=256.0, help="optim.offload_buffer_mb")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rule", default="adamw", choices=["adamw", "muon"], help="optim.name")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    model = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", "model.n_heads=12",
             "model.seq_len=256", "train.micro_batch_size=1", "optim.zero_stage=1", "train.device=cpu",
             f"optim.name={args.rule}"]  # fmt: skip
    offloads = {
        "none": [],
        "cpu": ["optim.offload=cpu"],
        "nvme": [
            "optim.offload=nvme",
            f"optim.offload_dir={root}/offload",
            f"optim.offload_buffer_mb={args.buffer_mb}",
        ],  # fmt: skip
    }
    with single_process_group() as rank_env:
        results = {}
        for name, extra in offloads.items():
            results[name] = step_seconds([*model, *extra, f"run_dir={root}/{name}"], rank_env, args.steps)
        files = results["nvme"][3].optimizer.files
        numel, direct, chunk = files.numel, files.direct, files.chunk
        raw = raw_read_write(root, numel, int(args.buffer_mb * 2**20), args.steps)
    params = sum(p.numel() for p in results["none"][3].model.parameters)
    moved = 3 * 4 * numel * 2  # masters and two moments, read and written (Muon: the masters twice)
    moved += 4 * numel * 2 if args.rule == "muon" else 0
    print(f"{params / 1e6:.1f}M parameters, one rank, ZeRO-1, fp32, {args.rule}, CPU; median of {args.steps} steps; "
          f"{moved / 1e9:.2f} GB read + written per nvme update ({'O_DIRECT' if direct else 'buffered'}, "
          f"{chunk * 4 / 2**20:.1f} MiB chunks) in {root}")  # fmt: skip
    base, base_save = results["none"][0], results["none"][2]
    for name, (wall, update, save, _) in results.items():
        print(f"  offload={name:<5} step {wall:.3f} s ({wall / base:.2f}x none), update {update:.3f} s, "
              f"save {save:.2f} s ({save / base_save:.2f}x none)")  # fmt: skip
    update, raw_moved = results["nvme"][1], 3 * 4 * numel * 2
    print(
        f"  nvme update: {moved / update / 1e9:.2f} GB/s; raw sequential read + write of the masters and moments: "
        f"{raw_moved / raw / 1e9:.2f} GB/s ({raw:.3f} s): the update at {moved / update / (raw_moved / raw):.2f} of "
        "the raw speed"
    )


if __name__ == "__main__":
    main()
