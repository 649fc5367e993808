"""Check 6, QLoRA at the real 7B shape: configs/llama2_7b_qlora.yaml as it is (Llama-2-7B's dimensions,
random weights, the projections in NF4, rank-64 adapters on all of them, full recompute, sequence 2048,
micro batch 1, bf16), one warm-up step (the optimizer state is allocated there), then a step whose peak is
measured (observe/memory.py StepPeak: on CUDA the allocator's max allocated over the step) against the
planner's total. The target: a 7B fine-tune in at most 8 GiB."""

from __future__ import annotations

import tempfile
import time

import torch

from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import single_process_group
from hpc_train.observe.memory import live_storage_bytes
from hpc_train.planner import estimate
from hpc_train.train.step import StepOptions, train_step
from tools.gpu_checks.common import ROOT, Check, gib, sync, torchao_problem

SMOKE_MODEL = ["model.n_layers=2", "model.d_model=128", "model.n_heads=4", "model.ffn_hidden=256",
               "model.vocab_size=512", "model.seq_len=64"]  # fmt: skip
TARGET = 8 * 2**30
TOLERANCE = 0.05


def run(check: Check) -> None:
    problem = torchao_problem()
    if problem is not None:
        check.skip("QLoRA step peak", problem)
        return
    device = check.device
    with tempfile.TemporaryDirectory() as tmp:
        keys = [*(SMOKE_MODEL if check.smoke else []), f"train.device={device.type}", "parallel.nproc=1",
                "logging.progress=none", f"run_dir={tmp}/run"]  # fmt: skip
        cfg = load_config(str(ROOT / "configs" / "llama2_7b_qlora.yaml"), keys)
        m = cfg.model
        check.setup(f"llama {m.n_layers} layers, d {m.d_model}, ffn {m.ffn_hidden}, vocab {m.vocab_size}, micro "
                    f"batch {cfg.train.micro_batch_size} x {m.seq_len}, lora rank {cfg.finetune.lora_rank} on "
                    f"{','.join(cfg.finetune.lora_targets)}, recompute {m.recompute}, "
                    f"{cfg.train.precision}")  # fmt: skip
        with single_process_group(device=device) as rank_env:
            held = frozenset(live_storage_bytes().items()) if device.type != "cuda" else frozenset()
            start = time.perf_counter()
            run = build_run(cfg, rank_env, device, with_data=False)
            sync(device)
            built_s = time.perf_counter() - start
            gen = torch.Generator().manual_seed(0)
            shape = (cfg.train.micro_batch_size, m.seq_len)
            batch = [Batch(*(torch.randint(0, m.vocab_size, shape, generator=gen).to(device) for _ in range(2)))]
            train_step(run.model, run.optimizer, batch, cfg.optim.lr, StepOptions(cfg.optim.grad_clip))
            sync(device)
            start = time.perf_counter()
            result = train_step(run.model, run.optimizer, batch, cfg.optim.lr,
                                StepOptions(cfg.optim.grad_clip, measure_peak=held))  # fmt: skip
            sync(device)
            step_s = time.perf_counter() - start
            loss = result.figures[0].item()
            del run
    plan = estimate(cfg, check_run(cfg, 1, check_paths=False))
    peak = result.memory["step_peak"]
    error = plan.total / peak - 1
    check.row("QLoRA step peak", f"measured {gib(peak)}, planned {gib(plan.total)}; step {step_s:.2f} s "
              f"(built in {built_s:.0f} s), loss {loss:.2f}", f"planner {error:+.1%}",
              "ok" if torch.isfinite(torch.tensor(loss)) else "failed: loss not finite", measured_bytes=peak,
              planned_bytes=plan.total, error=error, step_s=step_s, build_s=built_s, loss=loss)  # fmt: skip
    if not torch.isfinite(torch.tensor(loss)):
        check.fail(f"the QLoRA step's loss is {loss}")
    measured = check.cuda
    check.target("7B QLoRA peaks at no more than 8 GiB", gib(peak) if measured else "not measured",
                 peak <= TARGET if measured else None)  # fmt: skip
    check.target(f"planner within {TOLERANCE:.0%} of the QLoRA peak", f"{error:+.1%}",
                 abs(error) <= TOLERANCE if measured else None)  # fmt: skip
