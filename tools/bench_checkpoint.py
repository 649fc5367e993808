"""Checkpoint speed against the disk, for a GPT with AdamW state in one process (CPU or CUDA): the raw
sequential write (+ fsync) and cold read of the same number of bytes on the same disk, measured in the
same run, then hpc_train's sync save, the blocking part and the total of an async save, a cold verify
(checksums), a cold load and a cold resume (checksums checked as the files are read for the load, an older
checkpoint there to fall back on) into a new run (as a restarted job: its optimizer state allocated by the
load), each with its ratio to the raw figure. An async save's copy
overlaps the next training step: "blocking" is the time training waited (at the save and before the
next update), "time lost" that plus how much longer the steps trained meanwhile took than the fastest
step alone; "total" is from the save to its commit, with training going on.
DCP's own defaults (`dcp.save`: one writer thread, torch's per-record CRC) are the reference row.
"Cold": the files are evicted from the page cache first (posix_fadvise), so reads come from the disk.
It breaks the sync save down per GB (planning, writes to the OS, hashing, fsync, commit) and gives the CPU
seconds an async save's background work takes. On CPU it then times saves as a run pays them (runs saving
every step against one that does not, beside the sustained raw write of the same bytes): sync and async,
with one rank's compute on every core, on all but one, and with a rank on every core; and, with 2
processes, what an async save blocks at each ZeRO stage against that stage's sync save (`--no-zero`: not;
on a tmpfs the processes' state and the checkpoints share the memory).

    python tools/bench_checkpoint.py --layers 16 --d-model 1536   # ~0.5B parameters, ~6 GB with AdamW
    python tools/bench_checkpoint.py --dir /dev/shm --no-zero      # on a tmpfs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpc_train.builder import build_run
from hpc_train.checkpoint.checkpointer import choose_async, host_stager
from hpc_train.data.batch import Batch
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local, single_process_group
from hpc_train.models.common.decoder import count_params
from hpc_train.train.step import StepOptions, train_step

BLOCK = 16 * 2**20


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def cpu_seconds(fn) -> float:
    """The CPU seconds of this process (every thread) while `fn` runs."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def evict(root: Path) -> None:
    """Drop every file under `root` from the page cache (they are clean: written and fsynced)."""
    for path in [root] if root.is_file() else root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(path: Path, nbytes: int, source: memoryview | None = None) -> None:
    """`nbytes` written and fsynced: one BLOCK over and over (read from the CPU's cache: the strict
    reference), or `source`'s bytes, BLOCK at a time (from memory, as a save's tensors are)."""
    block = os.urandom(BLOCK)
    with open(path, "wb", buffering=0) as f:
        for at in range(0, nbytes, BLOCK):
            f.write(block if source is None else source[at : at + BLOCK])
        os.fsync(f.fileno())


def write_keeping_two(root: Path, i: int, nbytes: int, source: memoryview | None) -> None:
    """The `i`th of a series of raw writes (`raw_write`) that keeps the last two files, as keep_last=2 keeps
    checkpoints: the file before last is deleted after the write."""
    raw_write(root / f"raw{i % 3}.bin", nbytes, source)
    (root / f"raw{(i + 1) % 3}.bin").unlink(missing_ok=True)


def filled_buffer(nbytes: int) -> memoryview:
    """`nbytes` of distinct, random host memory (pages touched): what a raw write from memory reads."""
    return memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()).cast("B")


def raw_read(path: Path) -> None:
    buffer = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def training_state(root: Path, rank_env, model: list[str], device: torch.device, threads: int, extra=()):
    """(config, run, batch, state bytes, parameters): a run of `model` after one step (AdamW's moments exist),
    saving to root/run synchronously (what the sync rows measure: checkpoint.async_save=auto would pick a
    background save on a machine with a core to spare, whose commit then races the next reads), its messages
    silenced."""
    overrides = [*model, "train.micro_batch_size=1", f"run_dir={root}/run", f"checkpoint.io_threads={threads}",
                 f"train.device={device.type}", "checkpoint.async_save=false", *extra]  # fmt: skip
    cfg = load_config(None, overrides)
    run = build_run(cfg, rank_env, device, with_data=False)
    seq = cfg.model.seq_len
    batch = [Batch(*(torch.zeros(1, seq, dtype=torch.long, device=device),) * 2)]
    train_step(run.model, run.optimizer, batch, 1e-4)  # creates the AdamW moments
    for p in run.model.parameters:
        p.grad = None
    run.report = run.checkpointer.report = lambda message: None
    nbytes = sum(t.numel() * t.element_size() for t in run.checkpointer.sharded_tensors().values())
    return cfg, run, batch, nbytes, sum(count_params(chunk) for chunk in run.model.chunks)


def write_times(root: Path, run, nbytes: int, rounds: int = 2, dcp_reference: bool = True) -> tuple[dict, dict]:
    """Seconds of the raw write + fsync of `nbytes` (the best of `rounds`: a strict reference; the file is
    left at root/raw.bin for `read_times`), of DCP's defaults saving the same state (`dcp_reference`) and of
    hpc_train's sync save (step 1); and that save's figures (where its time went)."""
    times = {"raw_write": min(timed(lambda: raw_write(root / "raw.bin", nbytes))[0] for _ in range(rounds))}
    if dcp_reference:
        times["dcp"] = timed(partial(dcp.save, run.checkpointer.sharded_tensors(), checkpoint_id=root / "dcp"))[0]
        shutil.rmtree(root / "dcp")
    times["save"], figures = timed(partial(run.checkpointer.save, 1))
    return times, figures


def read_times(root: Path, fresh, threads: int, rounds: int = 3, names=("raw", "verify", "load", "resume")):
    """Cold reads, interleaved, the best of `rounds` of each (the disk's speed drifts): the raw file, a full
    verify of the newest checkpoint, a load (sizes checked only) and a resume (verified) into `fresh`, a new
    run (each load allocates its optimizer state anew, as a restarted job's)."""
    checkpoints = fresh.checkpointer.store
    reads = dict.fromkeys(names, float("inf"))
    actions = {
        "raw": (lambda: raw_read(root / "raw.bin"), "full"),
        "verify": (lambda: checkpoints.verify(checkpoints.scan()[0], full=True, threads=threads), "full"),
        "load": (fresh.checkpointer.resume, "sizes"),
        "resume": (fresh.checkpointer.resume, "full"),
    }
    for _ in range(rounds):
        for name in names:
            fn, verify = actions[name]
            fresh.cfg.checkpoint.verify = verify
            evict(root)
            reads[name] = min(reads[name], timed(fn)[0])
    return reads


def async_times(fresh, batch: list[Batch]) -> dict[str, float]:
    """An async save of `fresh` (its optimizer state loaded) while it trains: what the training waited
    (`blocking`, at the save and before the next update), that plus how much longer the overlapped steps
    took than the fastest step alone (`lost`), the save's `total` to its commit and the CPU seconds its
    background work took (`cpu`: the process's, less the overlapped steps' at their CPU time alone); the
    second of two saves (the first allocates the host buffers, which later ones reuse)."""
    background = fresh.checkpointer
    background.save(2)
    background.wait()

    def step() -> None:  # waits for an async save's copy before its update, as in training
        train_step(fresh.model, fresh.optimizer, batch, 1e-4, StepOptions(before_update=background.staged))

    t_step = min(timed(step)[0] for _ in range(3))
    cpu_step = min(cpu_seconds(step) for _ in range(3))
    start, cpu_start = time.perf_counter(), time.process_time()
    blocked = background.save(3)
    overlapped = []  # the steps trained while the save is copied, written and committed
    while not background.pending[1].done():
        overlapped.append(timed(step)[0])
    figures = background.wait()
    return {"blocking": blocked["blocked_s"] + figures["staging_wait_s"], "total": time.perf_counter() - start,
            "lost": blocked["blocked_s"] + sum(max(0.0, t - t_step) for t in overlapped),
            "cpu": time.process_time() - cpu_start - len(overlapped) * cpu_step}  # fmt: skip


def measure(root: Path, rank_env, model: list[str], device: torch.device, threads: int) -> None:
    cfg, run, batch, nbytes, n_params = training_state(root, rank_env, model, device, threads)
    run.checkpointer.save(0)  # an older checkpoint: a resume reads the newest in one pass only with one to fall back on
    writes, figures = write_times(root, run, nbytes)
    del run
    gc.collect()
    cfg.checkpoint.async_save = "true"
    fresh = build_run(cfg, rank_env, device, with_data=False)  # as a restarted job: no optimizer state yet
    fresh.checkpointer.report = lambda message: None
    reads = read_times(root, fresh, threads)
    (root / "raw.bin").unlink()
    checkpoints = fresh.checkpointer.store
    assert checkpoints.verify(checkpoints.scan()[0], full=True, threads=threads).problem is None
    saves = async_times(fresh, batch)  # fresh holds the loaded optimizer state: the same bytes as the sync save

    gb = nbytes / 1e9
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"GPT {n_params / 1e6:.0f}M params + AdamW state = {gb:.2f} GB, 1 process on {where}, "
          f"checkpoint.io_threads={threads}, {root}; reads: the best of 3, loads into a new run")  # fmt: skip
    t_raw_write, t_raw_read, t_save = writes["raw_write"], reads["raw"], writes["save"]
    rows = [
        ("raw write + fsync (disk)", t_raw_write, t_raw_write),
        ("raw read, cold (disk)", t_raw_read, t_raw_read),
        ("dcp.save, DCP defaults", writes["dcp"], t_raw_write),
        ("hpc_train save (sync)", t_save, t_raw_write),
        ("hpc_train async: blocking", saves["blocking"], t_save),
        ("hpc_train async: time lost", saves["lost"], t_save),
        ("hpc_train async: total", saves["total"], t_raw_write),
        ("hpc_train verify, cold", reads["verify"], t_raw_read),
        ("hpc_train load, cold", reads["load"], t_raw_read),
        ("hpc_train resume, cold", reads["resume"], t_raw_read),
    ]
    print(f"{'':<28} {'seconds':>8} {'GB/s':>7}  share of the reference's bandwidth")
    for name, seconds, reference in rows:
        versus = "sync save" if reference == t_save else "raw read" if reference == t_raw_read else "raw write"
        share = f"blocks {seconds / reference:.1%} of a {versus}" if versus == "sync save" else (
            f"{reference / seconds:.0%} of {versus}")  # fmt: skip
        print(f"{name:<28} {seconds:>8.2f} {gb / seconds:>7.2f}  {share}")
    print(f"sync save, seconds per GB: DCP's planning and metadata {figures['plan_s'] / gb:.3f}, data write "
          f"{figures['data_s'] / gb:.3f} (the {threads} writer threads' sums: write to the OS "
          f"{figures['io_s'] / gb:.3f}, xxh3 {figures['hash_s'] / gb:.3f}, fsync {figures['fsync_s'] / gb:.3f}), "
          f"commit {figures['commit_s'] / gb:.3f}")  # fmt: skip
    print(f"async save: its background work took {saves['cpu']:.2f} CPU s ({saves['cpu'] / gb:.2f} per GB) over "
          f"{saves['total']:.2f} s, {saves['cpu'] / saves['total']:.1f} cores on average")  # fmt: skip


def run_cost(root: Path, model: list[str], threads: int, steps: int, rounds: int, seq_len: int,
             layout_numbers: tuple[int, ...] = (0, 1, 2)) -> None:  # fmt: skip
    """What saves cost a run (ZeRO-1): the extra wall time and CPU seconds of a run saving every step
    (keep_last=2) over the same run without saves, per save, for a sync and an async save, with one rank's
    compute threads on every core, on all but one (OMP_NUM_THREADS), and with one single-threaded rank per
    core (dp = cores: the ranks fill the machine, as on a CPU cluster), at a sequence length whose
    step is about as long as a save (an async save overlaps one step); beside the sustained raw write
    (+ fsync) of the same bytes on the same disk (a new file per save, the one before last deleted, as the
    runs' keep_last=2 deletes a checkpoint: freeing a GB takes a tmpfs ~0.1 s). Runs are
    interleaved `rounds` times and the least disturbed of each kept: the disk's speed drifts, and writing a GB
    each step makes it slower than one write alone. The raw write is timed twice: one block written over
    and over (from the CPU's cache) and the same number of bytes from distinct memory, as a save reads its
    tensors. `layout_numbers`: which of the three layouts, in that order."""
    cores = len(os.sched_getaffinity(0))
    common = [*model, f"model.seq_len={seq_len}", "train.micro_batch_size=1", "train.eval_interval=0",
              "logging.progress=none", "train.save_final_model=false", "checkpoint.keep_last=2", "optim.warmup_steps=2",
              "optim.zero_stage=1", f"checkpoint.io_threads={threads}", f"train.steps={steps}"]  # fmt: skip
    cmd = [sys.executable, "-m", "hpc_train.cli", "train", "configs/tiny.yaml", *common]
    saves = {"none": ["checkpoint.interval=0"], "sync": ["checkpoint.interval=1"],
             "async": ["checkpoint.interval=1", "checkpoint.async_save=true"]}  # fmt: skip
    layouts = {f"1 rank, compute on {cores} of {cores} cores": (1, cores),
               f"1 rank, compute on {max(1, cores - 1)} of {cores} cores": (1, max(1, cores - 1)),
               f"{cores} ranks (dp{cores}), 1 core each": (cores, 1)}  # fmt: skip
    layouts = {name: layout for i, (name, layout) in enumerate(layouts.items()) if i in layout_numbers}
    walls: dict[tuple[str, str], list[float]] = {(c, s): [] for c in layouts for s in saves}
    cpus: dict[tuple[str, str], list[float]] = {key: [] for key in walls}
    raw: dict[str, list[float]] = {"cache": [], "memory": []}
    nbytes = 0
    for _ in range(rounds):
        for layout, (ranks, compute) in layouts.items():
            for save, overrides in saves.items():
                shutil.rmtree(root / "run", ignore_errors=True)
                before, start = children_cpu_s(), time.perf_counter()
                subprocess.run([*cmd, *overrides, f"parallel.nproc={ranks}", f"run_dir={root / 'run'}"], check=True,
                               capture_output=True, cwd=Path(__file__).resolve().parents[1],
                               env={**os.environ, "OMP_NUM_THREADS": str(compute)})  # fmt: skip
                walls[layout, save].append(time.perf_counter() - start)
                cpus[layout, save].append(children_cpu_s() - before)
                if save == "sync":
                    record = json.loads((root / "run/metrics.jsonl").read_text().splitlines()[-1])
                    nbytes = record["checkpoint"]["total_bytes"]
        source = filled_buffer(nbytes)
        for i in range(2 * steps):
            kept = partial(write_keeping_two, root, i, nbytes, None if i % 2 else source)
            raw["cache" if i % 2 else "memory"].append(timed(kept)[0])
        del source
    for i in range(3):
        (root / f"raw{i}.bin").unlink(missing_ok=True)
    per_raw, from_memory = statistics.mean(raw["cache"]), statistics.mean(raw["memory"])
    print(f"a run saving {nbytes / 1e9:.2f} GB each of {steps} steps (ZeRO-1, keep_last=2), best of {rounds}, per "
          f"save against a run without saves; sustained raw write + fsync of the same number of bytes, deleting "
          f"the file before last, "
          f"{per_raw:.2f} s from the cache, {from_memory:.2f} s from memory (means of {len(raw['cache'])}), "
          f"{cores} cores:")  # fmt: skip
    for layout in layouts:
        print(f"  {layout}: a step without saves takes {min(walls[layout, 'none']) / steps:.2f} s (start-up included)")
        for save in ("sync", "async"):
            extra = (min(walls[layout, save]) - min(walls[layout, "none"])) / steps
            cpu = (min(cpus[layout, save]) - min(cpus[layout, "none"])) / steps
            speed = (f"{per_raw / extra:.0%} of the disk's speed, {from_memory / extra:.0%} from memory"
                     if extra > 0 else "no wall time lost")  # fmt: skip
            cpu_s = f", {cpu:.2f} CPU s ({cpu / (nbytes / 1e9):.2f} per GB)" if layouts[layout][0] == 1 else ""
            print(f"    {save:>5} save: {extra:+.2f} s wall ({speed}){cpu_s}")
        background, why = choose_async(None, *layouts[layout], cores, False)
        print(f"    checkpoint.async_save=auto saves {'async' if background else 'sync'} here ({why.split(': ')[-1]})")


def children_cpu_s() -> float:
    """CPU seconds of every waited-for descendant process so far (user + system): a one-rank run's; several
    ranks start from a fork server that is not waited for, so theirs are not counted."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def zero_stage_blocking(rank_env, root: Path, model: list[str], threads: int) -> None:
    """dp=2 (2 processes): for each ZeRO stage, the time an async save blocks training (at the save and
    before the next update) against the same stage's sync save."""
    from hpc_train.bootstrap import distributed

    device = torch.device("cpu")
    rows = []
    with distributed(rank_env, device, "gloo", 600):
        for stage in (0, 1, 2, 3):
            overrides = [*model, "train.micro_batch_size=1", f"run_dir={root}/zero{stage}", "parallel.nproc=2",
                         f"checkpoint.io_threads={threads}", f"optim.zero_stage={stage}"]  # fmt: skip
            cfg = load_config(None, overrides)
            run = build_run(cfg, rank_env, device, with_data=False)
            run.report = run.checkpointer.report = lambda message: None
            seq = cfg.model.seq_len
            batch = [Batch(*(torch.zeros(1, seq, dtype=torch.long, device=device),) * 2)]
            train_step(run.model, run.optimizer, batch, 1e-4)
            sync = min(timed(partial(run.checkpointer.save, step))[0] for step in (1, 2))
            background = run.checkpointer  # made asynchronous, as checkpoint.async_save=true makes it
            background.stager, background.async_group = host_stager(), dist.new_group(backend="gloo")
            blocked = []
            for step in (3, 4):  # the first async save allocates its host buffers
                figures = background.save(step)
                train_step(run.model, run.optimizer, batch, 1e-4, StepOptions(before_update=background.staged))
                waited = background.staging_wait_s
                background.wait()
                blocked.append(figures["blocked_s"] + waited)
            rows.append((stage, sync, blocked[-1]))
            dist.barrier()
    if rank_env.rank == 0:
        print(
            "dp=2 (2 processes), each ZeRO stage: what an async save blocks (at the save + before the next "
            "update) against its sync save"
        )
        for stage, sync, blocked in rows:
            print(f"  zero_stage={stage}: sync save {sync:.2f} s, async blocks {blocked:.2f} s ({blocked / sync:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--threads", type=int, default=4, help="checkpoint.io_threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--run-steps", type=int, default=8, help="steps of the runs with and without saves")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the run comparison")
    parser.add_argument("--run-seq-len", type=int, default=256, help="sequence length of those runs")
    parser.add_argument("--no-zero", action="store_true", help="skip the ZeRO stages' async blocking (2 processes)")
    parser.add_argument(
        "--run-only",
        action="store_true",
        help="only the run comparison, one rank on every core (no single-save figures, no ZeRO part)",
    )
    parser.add_argument("--layouts", default=None, help="--run-only: which layouts, e.g. 0,1,2 (default 0)")
    args = parser.parse_args()
    model = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
             f"model.n_heads={max(1, args.d_model // 128)}", "model.seq_len=32"]  # fmt: skip
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt_"))
    try:
        if not args.run_only:
            with single_process_group() as rank_env:
                measure(root, rank_env, model, torch.device(args.device), args.threads)
        if args.device == "cpu":
            numbers = tuple(map(int, (args.layouts or ("0" if args.run_only else "0,1,2")).split(",")))
            run_cost(root, model, args.threads, args.run_steps, args.rounds, args.run_seq_len, numbers)
            if not (args.no_zero or args.run_only):
                launch_local(zero_stage_blocking, 2, root, model, args.threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
