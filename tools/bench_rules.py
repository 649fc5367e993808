"""Update rules on the tiny config: the loss curve of each rule (AdamW, Muon) at a few learning rates, same
data, seed and schedule, trained one after another in this process. Prints each run's training loss every
`--every` steps (mean over the window) and its final eval loss, each rule's best learning rate, and how
many steps the best Muon run needs to reach the best AdamW run's final training loss.

`--low-bit` compares AdamW's fp32 moments with adamw8bit and adamw4bit instead: on the ~86M GPT
(configs/gpt2_124m.yaml with a byte vocabulary, 64-token samples, fp32, one process; on the CPU unless
`train.device=cuda` is given) the optimizer-state bytes per parameter each rule holds after a step and its
step time (median of `--timed` steps; the update alone too) against AdamW's and, on CUDA, the allocator's
peak over the timed steps, measured in the same process;
then each rule's final loss after the tiny config's 200 steps at one learning rate, and its gap to AdamW's.

    python tools/bench_rules.py                      # configs/tiny.yaml, 1 process, 200 steps
    python tools/bench_rules.py train.steps=400 --lrs 1e-3 3e-3
    python tools/bench_rules.py --low-bit --rules adamw adamw8bit adamw4bit --lrs 1e-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpc_train.bootstrap import distributed, select_device
from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.train.loop import run_training
from hpc_train.train.step import StepOptions, train_step

ROOT = Path(__file__).resolve().parents[1]


def tiny_cfg(rule: str, lr: float, run: Path, overrides: list[str]):
    """configs/tiny.yaml in one process under `rule` at `lr` (min_lr a tenth), writing to `run`."""
    settings = [f"optim.name={rule}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}", f"run_dir={run}"]
    base = ["parallel.nproc=1", "logging.progress=none", "train.save_final_model=false", *overrides]
    return load_config(ROOT / "configs/tiny.yaml", [*base, *settings])


def curve(records: list[dict], every: int) -> list[float]:
    losses = [r["loss"] for r in records if "loss" in r]
    return [sum(losses[i : i + every]) / len(losses[i : i + every]) for i in range(0, len(losses), every)]


MODEL_86M = ["model.vocab_size=256", "model.seq_len=64", "train.precision=fp32", "train.device=cpu",
             "train.micro_batch_size=1", "parallel.nproc=1", "optim.zero_stage=0"]  # fmt: skip


def state_and_step_time(rank_env, rule: str, timed: int, overrides: list[str]) -> dict[str, float]:
    """On the ~86M GPT (zero_stage 0: no master weights): the rule's state bytes per trainable parameter
    after a step, and the median step and update times over `timed` steps after two untimed ones (which
    compile the update with optim.compile_update=true)."""
    cfg = load_config(ROOT / "configs/gpt2_124m.yaml", [*MODEL_86M, f"optim.name={rule}", *overrides])
    device = select_device(cfg.train.device, rank_env.local_rank)
    with distributed(rank_env, device, "auto", 600):
        run = build_run(cfg, rank_env, device, with_data=False)
        tokens = torch.randint(0, 256, (1, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(device)
        steps, updates = [], []
        for i in range(2 + timed):
            if i == 2 and device.type == "cuda":  # the timed steps' peak, not the compiling ones'
                torch.cuda.reset_peak_memory_stats(device)
            timings: dict[str, float] = {}
            start = time.perf_counter()
            train_step(run.model, run.optimizer, [Batch(tokens, tokens)], 1e-4, StepOptions(timings=timings))
            if i >= 2:
                steps.append(time.perf_counter() - start)
                updates.append(timings["optimizer"])
        params = sum(p.numel() for p in run.optimizer.params)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return {"params": params, "bytes_per_param": run.optimizer.state_bytes() / params, "device": str(device),
            "step_s": statistics.median(steps), "update_s": statistics.median(updates),
            "peak_gb": peak / 1e9}  # fmt: skip


def low_bit(args: argparse.Namespace) -> None:
    extra = [f"optim.compile_update={args.compile_update}"] if args.compile_update is not None else []
    extra += args.overrides  # train.device=cuda measures on the GPU
    costs = {rule: launch_local(state_and_step_time, 1, rule, args.timed, extra) for rule in args.rules}
    base = costs.get("adamw", next(iter(costs.values())))
    print(f"~86M GPT ({base['params'] / 1e6:.1f}M parameters), one process on {base['device']}: median of "
          f"{args.timed} steps; peak GB: the allocator's peak over the timed steps (CUDA only)")  # fmt: skip
    print(f"{'rule':<10}{'state B/param':>14}{'step s':>9}{'vs adamw':>9}{'update s':>10}{'vs adamw':>9}{'peak GB':>9}")
    for rule, c in costs.items():
        print(f"{rule:<10}{c['bytes_per_param']:>14.3f}{c['step_s']:>9.3f}{c['step_s'] / base['step_s']:>9.2f}"
              f"{c['update_s']:>10.3f}{c['update_s'] / base['update_s']:>9.2f}{c['peak_gb']:>9.3f}")  # fmt: skip
    if args.no_curve:
        return
    lr = args.lrs[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {rule: Path(tmp) / rule for rule in args.rules}
        cfgs = [tiny_cfg(rule, lr, run, args.overrides) for rule, run in runs.items()]
        launch_sequence(run_training, 1, [(cfg,) for cfg in cfgs])
        finals = {rule: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                  for rule, run in runs.items()}  # fmt: skip
    window = {rule: curve(records, args.every)[-1] for rule, records in finals.items()}
    reference = window.get("adamw", next(iter(window.values())))
    print(f"tiny config, lr {lr:g}: training loss, mean of the last {args.every} steps")
    for rule, loss in window.items():
        print(f"{rule:<10}{loss:>9.4f}{100 * (loss - reference) / reference:>+9.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--rules", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--low-bit", action="store_true", help="state bytes, step time and loss gap (docstring)")
    parser.add_argument("--timed", type=int, default=5, help="--low-bit: timed steps per rule")
    parser.add_argument("--compile-update", choices=["true", "false"], help="--low-bit: optim.compile_update")
    parser.add_argument("--no-curve", action="store_true", help="--low-bit: skip the 200-step loss runs")
    args = parser.parse_args()
    if args.low_bit:
        low_bit(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(rule, lr): Path(tmp) / f"{rule}_{lr:g}" for rule in args.rules for lr in args.lrs}
        cfgs = [tiny_cfg(rule, lr, run, args.overrides) for (rule, lr), run in runs.items()]
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
