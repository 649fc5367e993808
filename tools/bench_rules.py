"""Update rules on the tiny config: the loss curve of each rule (AdamW, Muon) at a few learning rates, same
data, seed and schedule, trained one after another in this process. Prints each run's training loss every
`--every` steps (mean over the window) and its final eval loss, each rule's best learning rate, and how
many steps the best Muon run needs to reach the best AdamW run's final training loss.

    python tools/bench_rules.py                      # configs/tiny.yaml, 1 process, 200 steps
    python tools/bench_rules.py train.steps=400 --lrs 1e-3 3e-3
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hpc_train.job import load_config
from hpc_train.launch.local import launch_sequence
from hpc_train.train.loop import run_training

ROOT = Path(__file__).resolve().parents[1]


def curve(records: list[dict], every: int) -> list[float]:
    losses = [r["loss"] for r in records if "loss" in r]
    return [sum(losses[i : i + every]) / len(losses[i : i + every]) for i in range(0, len(losses), every)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--rules", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(rule, lr): Path(tmp) / f"{rule}_{lr:g}" for rule in args.rules for lr in args.lrs}
        cfgs = [load_config(ROOT / "configs/tiny.yaml", ["parallel.nproc=1", "logging.progress=none",
                                                           "train.save_final_model=false", *args.overrides,
                                                           f"optim.name={rule}", f"optim.lr={lr}",
                                                           f"optim.min_lr={lr / 10}", f"run_dir={run}"])
                for (rule, lr), run in runs.items()]  # fmt: skip
        launch_sequence(run_training, 1, [(cfg,) for cfg in cfgs])
        records = {key: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                   for key, run in runs.items()}  # fmt: skip
    curves = {key: curve(r, args.every) for key, r in records.items()}
    evals = {key: [x["eval_loss"] for x in r if "eval_loss" in x] for key, r in records.items()}
    width = max(len(c) for c in curves.values())
    print(f"training loss, mean of each {args.every} steps; eval loss at the end")
    print(f"{'rule':<7}{'lr':>8}" + "".join(f"{(i + 1) * args.every:>8}" for i in range(width)) + f"{'eval':>8}")
    for (rule, lr), values in curves.items():
        last_eval = evals[(rule, lr)][-1] if evals[(rule, lr)] else float("nan")
        print(f"{rule:<7}{lr:>8g}" + "".join(f"{v:>8.3f}" for v in values) + f"{last_eval:>8.3f}")
    best = {rule: min((k for k in curves if k[0] == rule), key=lambda k: curves[k][-1]) for rule in args.rules}
    for rule, key in best.items():
        print(f"best {rule}: lr {key[1]:g}, final window {curves[key][-1]:.4f}")
    if {"adamw", "muon"} <= best.keys():
        target = curves[best["adamw"]][-1]
        losses = [r["loss"] for r in records[best["muon"]] if "loss" in r]
        window = args.every
        reached = next((i + window for i in range(len(losses) - window + 1)
                        if sum(losses[i : i + window]) / window <= target), None)  # fmt: skip
        print(f"muon reaches adamw's final window loss {target:.4f} after {reached} of {len(losses)} steps"
              if reached else f"muon does not reach adamw's final window loss {target:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
