"""train.fp8 against bf16 on one process: the same model, data, seed and schedule trained in bf16 and with
float8 projections (tensorwise and rowwise), one after another in this process. Prints each recipe's
largest per-step loss gap to bf16, the largest gap of the `--every`-step means, the mean of the last
window, and the seconds each run took. tests/test_fp8.py asserts the gap on the test model over fewer
steps.

    python tools/bench_fp8_curve.py                         # the test model (2 layers, d 64), 200 steps
    python tools/bench_fp8_curve.py --config configs/tiny.yaml train.steps=500
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training

TEST_MODEL = ["model.n_layers=2", "model.n_heads=4", "model.d_model=64", "model.seq_len=32", "optim.warmup_steps=2",
              "train.steps=200"]  # fmt: skip
RUNS = {"bf16": [], "fp8 tensorwise": ["train.fp8=tensorwise"], "fp8 rowwise": ["train.fp8=rowwise"]}


def means(losses: list[float], every: int) -> list[float]:
    return [sum(losses[i : i + every]) / len(losses[i : i + every]) for i in range(0, len(losses), every)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--config", default=None, help="a YAML config (default: the test model on a small corpus)")
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = [] if args.config else TEST_MODEL
        if args.config is None:  # the tests' corpus: 40 standard-library files
            prepare_data(stdlib_sources()[:40], f"{tmp}/corpus", "byte", valid_every=10, progress=False)
            base += [f"data.train_path={tmp}/corpus"]
        curves, seconds = {}, {}
        for name, extra in RUNS.items():
            keys = [*base, "parallel.nproc=1", "train.precision=bf16", "train.eval_interval=0",
                    "train.save_final_model=false", "logging.progress=none", f"run_dir={tmp}/{name.replace(' ', '_')}",
                    *args.overrides, *extra]  # fmt: skip
            start = time.perf_counter()
            launch_local(run_training, 1, load_config(args.config, keys))
            seconds[name] = time.perf_counter() - start
            records = (Path(tmp) / name.replace(" ", "_") / "metrics.jsonl").read_text().splitlines()
            curves[name] = [json.loads(line)["loss"] for line in records]
    bf16 = curves["bf16"]
    last = means(bf16, args.every)[-1]
    print(f"\n{len(bf16)} steps; bf16 first {bf16[0]:.4f}, last {args.every}-step mean {last:.4f}")
    print(f"{'':<16}{'max step gap':>14}{f'max {args.every}-mean gap':>18}{'last mean':>11}{'seconds':>9}")
    for name, losses in curves.items():
        gap = max(abs(a - b) for a, b in zip(losses, bf16, strict=True))
        window = max(abs(a - b) for a, b in zip(means(losses, args.every), means(bf16, args.every), strict=True))
        print(f"{name:<16}{gap:>14.4f}{window:>18.4f}{means(losses, args.every)[-1]:>11.4f}{seconds[name]:>9.1f}")


if __name__ == "__main__":
    main()
