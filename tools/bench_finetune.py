"""Full fine-tuning, LoRA and QLoRA side by side on one process (CPU, or train.device=cuda): a ~100M-parameter
Llama-shaped model, every method in `--precision` (fp32 by default: CPUs without bf16 matmul units run bf16
about 100x slower), the same batches, each method's exact memory by category (parameters, gradients,
optimizer state, peak saved activations: hpc_train/observe/memory.py, as metrics.jsonl reports them) and its
median step time after a warm-up, with the ratios to full fine-tuning. LoRA uses the finetune defaults
(rank 8 on wq and wv, the LoRA paper's); QLoRA also keeps every frozen projection in NF4. Overrides apply
to every method (e.g. finetune.lora_targets=[wq,wk,wv,wo,w1,w2,w3] train.micro_batch_size=4). The
planner's prediction of each total is printed beside.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from hpc_train.bootstrap import distributed, select_device
from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local
from hpc_train.planner import estimate
from hpc_train.train.step import StepOptions, train_step

MODEL = ["model.vocab_size=8192", "model.n_layers=12", "model.n_heads=12", "model.d_model=768", "model.seq_len=256",
         "train.micro_batch_size=2"]  # fmt: skip
METHODS = {"full": [], "lora": ["finetune.method=lora"], "qlora": ["finetune.method=qlora"]}
PEAK = ("params", "grads", "optimizer", "activations_peak")


def worker(rank_env, cfg, warmup: int, steps: int) -> dict:
    device = select_device(cfg.train.device, rank_env.local_rank)
    with distributed(rank_env, device, "auto", 600):
        run = build_run(cfg, rank_env, device, with_data=False)
        gen = torch.Generator().manual_seed(0)
        shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
        batch = [Batch(torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device),
                       torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device))]  # fmt: skip
        times, result = [], None
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = train_step(run.model, run.optimizer, batch, cfg.optim.lr, StepOptions(cfg.optim.grad_clip))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        trainable = sum(p.numel() for p in run.model.trainable_parameters)
        return {"memory": result.memory, "step_s": statistics.median(times), "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    rows = {}
    for method, extra in METHODS.items():
        cfg = load_config(None, [*MODEL, f"train.precision={args.precision}", *extra, *args.overrides])
        cfg = replace(cfg, train=replace(cfg.train, steps=args.warmup + args.steps))
        figures = launch_local(worker, 1, cfg, args.warmup, args.steps)
        figures["planned"] = estimate(cfg, check_run(cfg, 1, check_paths=False))
        rows[method] = figures
    mib = 2**20
    print(f"{'method':<7} {'trainable':>10} {'params':>8} {'grads':>8} {'optim':>8} {'acts':>8} {'total MiB':>10} "
          f"{'x full':>7} {'planned':>8} {'step s':>8} {'x full':>7}")  # fmt: skip
    full_total = sum(rows["full"]["memory"][k] for k in PEAK)
    for method, r in rows.items():
        m, total = r["memory"], sum(r["memory"][k] for k in PEAK)
        planned = r["planned"]
        planned_total = planned.params + planned.grads + planned.optimizer + planned.activations
        print(f"{method:<7} {r['trainable'] / 1e6:>9.1f}M {m['params'] / mib:>8.1f} {m['grads'] / mib:>8.1f} "
              f"{m['optimizer'] / mib:>8.1f} {m['activations_peak'] / mib:>8.1f} {total / mib:>10.1f} "
              f"{total / full_total:>7.2f} {planned_total / mib:>8.1f} {r['step_s']:>8.2f} "
              f"{r['step_s'] / rows['full']['step_s']:>7.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
