"""Check 9, activation offload: model.activation_offload=full against none on one GPU, eager, bf16, a 1.3B
shape at a micro batch whose activations dominate: the first step's loss (the same tensors come back: equal
bit for bit), the step time (the copies to the host and back on a side stream, next to compute), and the
measured peak against the planner's drop of the device's activations (observe/memory.py StepPeak: on CUDA
the allocator's max allocated over the step)."""

from __future__ import annotations

import tempfile
import time

from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import single_process_group
from hpc_train.planner import estimate
from hpc_train.train.step import StepOptions, train_step
from tools.bench_gpu import random_batch
from tools.gpu_checks.common import Check, gib, model_keys, sync

SMOKE_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512", "model.seq_len=64"]
CUDA_MODEL = ["train.micro_batch_size=4", "train.precision=bf16", "optim.zero_stage=1"]
STEPS = 3  # the last one measured


def measure(check: Check, keys: list[str], mode: str) -> dict:
    device = check.device
    cfg = load_config(None, [*keys, f"model.activation_offload={mode}"])
    with single_process_group(device=device) as rank_env:
        run = build_run(cfg, rank_env, device, with_data=False)
        batch = [Batch(*random_batch(cfg, device))]
        losses, seconds = [], 0.0
        for step in range(STEPS):
            options = StepOptions(cfg.optim.grad_clip, measure_peak=frozenset() if step == STEPS - 1 else None)
            sync(device)
            start = time.perf_counter()
            result = train_step(run.model, run.optimizer, batch, cfg.optim.lr, options)
            sync(device)
            seconds = time.perf_counter() - start
            losses.append(result.figures[0].item())
        moved = result.features.get("activation_offload", {})
        del run
    plan = estimate(cfg, check_run(cfg, 1, check_paths=False))
    return {"loss": losses[0], "step_s": seconds, "peak": result.memory["step_peak"], "planned": plan.total,
            "planned_activations": plan.activations, "moved": moved.get("bytes", 0)}  # fmt: skip


def run(check: Check) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shape = SMOKE_MODEL if check.smoke else [*model_keys("gpt_1_3b"), *CUDA_MODEL]
        keys = [*shape, f"train.device={check.device.type}", "parallel.nproc=1", "logging.progress=none",
                "train.eval_interval=0", f"run_dir={tmp}/run"]  # fmt: skip
        check.setup(f"{' '.join(shape)}, eager, {STEPS} steps (the last one's peak measured)")
        kept = measure(check, keys, "none")
        moved = measure(check, keys, "full")
    check.row("kept on the device", f"step {kept['step_s']:.3f} s, peak {gib(kept['peak'])}",
              f"planned {gib(kept['planned'])}", **kept)  # fmt: skip
    same = moved["loss"] == kept["loss"]
    drop, planned_drop = kept["peak"] - moved["peak"], kept["planned_activations"] - moved["planned_activations"]
    check.row("offloaded (full)", f"step {moved['step_s']:.3f} s ({moved['step_s'] / kept['step_s']:.2f}x), peak "
              f"{gib(moved['peak'])}, {gib(moved['moved'])} through host memory",
              f"peak {gib(drop)} lower, planned {gib(planned_drop)} lower",
              "ok" if same else "failed: the loss differs", drop=drop, planned_drop=planned_drop, **moved)  # fmt: skip
    if not same:
        check.fail(f"offloaded first-step loss {moved['loss']} != {kept['loss']} kept")
    if not moved["moved"]:
        check.fail("nothing went through the offload hooks")
