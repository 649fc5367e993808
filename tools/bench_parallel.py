"""Step time and tokens/s of each (pp, dp, tp) layout against the single-process run, same model and
global batch, in one run. Each layout trains for --steps steps; the median step time after --warmup
steps is reported, with the overhead ratio layout / single process.

On CPU the layouts share the machine's cores (the single process gets all of them, each of N ranks
1/N), so the ratio measures what parallelism costs here: communication, pipeline bubble, per-rank
overheads. On a GPU machine pass train.device=cuda to measure NCCL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hpc_train.config import load_config
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training

SP = "parallel.sequence_parallel=true"
# name -> (world size, overrides); the global batch is micro_batch_size x grad_accum x dp = 16 everywhere
LAYOUTS = {
    "single": (1, ["train.micro_batch_size=16"]),
    "dp2": (2, ["train.micro_batch_size=8"]),
    "tp2": (2, ["parallel.tp=2", SP, "train.micro_batch_size=16"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=4"]),
    "pp2_interleaved": (
        2,
        [
            "parallel.pp=2",
            "parallel.virtual_stages=2",
            "parallel.schedule=interleaved_1f1b",
            "train.micro_batch_size=4",
            "train.grad_accum=4",
        ],
    ),  # fmt: skip
    "tp2_dp2": (4, ["parallel.tp=2", SP, "train.micro_batch_size=8"]),
    "pp2_tp2": (4, ["parallel.pp=2", "parallel.tp=2", SP, "train.micro_batch_size=4", "train.grad_accum=4"]),
    "pp2_dp2": (4, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=2"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", SP, "train.micro_batch_size=4", "train.grad_accum=2"]),
}
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.seq_len=128"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[], help="extra key=value for every layout")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            world, extra = LAYOUTS[name]
            cfg = load_config(None, [*MODEL, f"train.steps={args.steps}", "train.eval_interval=0",
                                     "logging.progress=none", "train.save_final_model=false",
                                     f"run_dir={Path(tmp) / name}", f"parallel.nproc={world}", *extra,
                                     *args.overrides])  # fmt: skip
            launch_local(run_training, world, cfg)
            lines = (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()
            times = [json.loads(line)["step_time_s"] for line in lines][args.warmup :]
            rows.append((name, world, statistics.median(times)))
    tokens = 16 * 128
    base = next((t for n, _, t in rows if n == "single"), rows[0][2])
    print(f"{'layout':<16} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'vs single':>10}")
    for name, world, step_time in rows:
        print(f"{name:<16} {world:>5} {step_time * 1e3:>9.1f} {tokens / step_time:>10,.0f} {step_time / base:>10.2f}")


if __name__ == "__main__":
    main()
