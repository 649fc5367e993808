"""What memory checkpoints at every step (checkpoint.memory_interval=1) cost a run's steps, against the same
run without them, in runs of `hpc-train train` on this machine, in three layouts: one rank with a core free
(its compute threads on all cores but one: where checkpoint.async_save=auto saves in the background), one
rank whose threads fill every core, and one single-threaded rank per core (dp = cores); with `--slurm`, also
two nodes of the local Slurm cluster, one rank each, where each save also goes to the partner node. A run's
step period is the mean time between the starts of its steps after the first `--skip` (start-up and the
first allocation of the host buffers left out). Runs are interleaved `--rounds` times and the least
disturbed of each kept. Prints each layout's period without and with, their ratio, and what the saves did:
the time training was blocked (the small parts copied) and the update's wait for the rest.

    python tools/bench_memory_checkpoint.py [--steps 24] [--rounds 3] [--slurm] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# about 30M parameters with AdamW (0.36 GB of state a rank): a save is a real copy, a step a few tenths of a second
MODEL = ["model.n_layers=6", "model.n_heads=8", "model.d_model=512", "model.seq_len=256", "train.micro_batch_size=2"]
MEMORY = ["checkpoint.memory_interval=1", "parallel.max_restarts=1"]


def period(records: list[dict], skip: int) -> float:
    """Mean seconds between the starts of the steps after the first `skip`."""
    times = [r["time"] for r in records if r["step"] > skip]
    return (times[-1] - times[0]) / (len(times) - 1)


def save_figures(records: list[dict], skip: int) -> dict[str, float]:
    """Means over the saves past `skip`: the time training was blocked, and what the update waited."""
    saves = [r["local_checkpoint"] for r in records if r["step"] > skip and "local_checkpoint" in r]
    done = [s.get("saved", s) for s in saves]
    return {"blocked_s": statistics.mean(s.get("blocked_s", s.get("local_s", 0.0)) for s in saves),
            "wait_s": statistics.mean(d.get("wait_s", 0.0) for d in done),
            "bytes": statistics.mean(d.get("local_bytes", 0) for d in done)}  # fmt: skip


def run(run_dir: Path, overrides: list[str], ranks: int, threads: int, slurm: bool) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = "submit" if slurm else "train"
    layout = ["slurm.nodes=2", "slurm.tasks_per_node=1"] if slurm else [f"parallel.nproc={ranks}"]
    extra = ["--wait"] if slurm else []
    subprocess.run([sys.executable, "-m", "hpc_train.cli", command, "configs/tiny.yaml", *overrides, *layout,
                    f"run_dir={run_dir}", *extra], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # fmt: skip
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slurm", action="store_true", help="also two nodes of the local Slurm cluster")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs (the model's, ...)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    common = [*MODEL, "train.eval_interval=0", "logging.progress=none", "logging.log_interval=1",
              "train.save_final_model=false", f"train.steps={args.steps}", f"checkpoint.interval={args.steps}",
              "optim.warmup_steps=2", *args.overrides]  # fmt: skip
    layouts = {f"1 rank, compute on {max(1, cores - 1)} of {cores} cores (a core free)": (1, max(1, cores - 1), False),
               f"1 rank, compute on {cores} of {cores} cores": (1, cores, False),
               f"{cores} ranks (dp{cores}), 1 core each": (cores, 1, False)}  # fmt: skip
    if args.slurm:
        layouts["2 Slurm nodes, 1 rank and 1 core each (saves also sent to the partner)"] = (2, 1, True)
    found: dict[tuple[str, str], list[tuple[float, dict]]] = {(name, kind): [] for name in layouts for kind in "nm"}
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        for _ in range(args.rounds):
            for name, (ranks, threads, slurm) in layouts.items():
                for kind, overrides in (("n", []), ("m", MEMORY)):
                    records = run(Path(tmp) / "run", [*common, *overrides], ranks, threads, slurm)
                    figures = save_figures(records, args.skip) if kind == "m" else {}
                    found[name, kind].append((period(records, args.skip), figures))
    print(f"memory checkpoints at every step against none: {args.steps} steps, periods past step {args.skip}, best "
          f"of {args.rounds}, {cores} cores, {' '.join(MODEL + args.overrides)}")  # fmt: skip
    for name in layouts:
        without = min(p for p, _ in found[name, "n"])
        with_memory, figures = min(found[name, "m"], key=lambda pair: pair[0])
        print(f"  {name}: {without:.3f} s a step without, {with_memory:.3f} s with ({with_memory / without - 1:+.1%}); "
              f"a save {figures['bytes'] / 1e9:.2f} GB a rank, training blocked {figures['blocked_s'] * 1e3:.1f} ms, "
              f"the update waited {figures['wait_s'] * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
