"""What a run writes besides its per-step metrics: at the start, where every rank runs
(rank_layout.json), the resolved config, the model and layout and the planner's prediction; at the end,
the consolidated weights for export."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train.bootstrap import describe_rank
from hpc_train.builder import Run
from hpc_train.config import to_yaml
from hpc_train.data.prepare import record_run_tokenizer
from hpc_train.distributed.parallelize import full_state_dict
from hpc_train.distributed.pipeline import bubble_fraction
from hpc_train.models.common.decoder import count_params
from hpc_train.observe.metrics import StepMeter, device_peak_flops
from hpc_train.planner import feature_lines, stage_estimates
from hpc_train.resilience.faults import fault_point

FINAL_MODEL = "model_final.pt"


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # of the steps this run trained (after a resume)
    eval_losses: dict[int, float] = field(default_factory=dict)
    requeued: bool = False


def announce(run: Run, start_step: int) -> StepMeter:
    """Record where every rank runs (rank_layout.json), the resolved config, the model and layout, and the
    planner's prediction; return the meter that measures each step against them."""
    cfg, dims, run_dir = run.cfg, run.mesh.dims, Path(run.cfg.run_dir)
    layout = [None] * dims.world_size  # every rank's place, checked once so a mismatch shows up early
    dist.all_gather_object(layout, {**describe_rank(run.rank_env), **run.mesh.coordinates()})
    global_batch = run.sampler.global_batch_size
    if run.metrics:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "rank_layout.json").write_text(json.dumps(layout, indent=1))
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        if run.train_set is not None:  # generate and export-hf find it here when the data has moved
            record_run_tokenizer(run.train_set, run_dir)
        with torch.device("meta"):  # the whole model's size, without allocating it
            n_params = count_params(run.model.spec.build_stage(cfg.model))
        run.metrics.message(
            f"hpc_train: {cfg.model.arch} {n_params / 1e6:.2f}M params | world {dims.world_size} (pp {dims.pp}, "
            f"dp {dims.dp}{f', cp {dims.cp}' if dims.cp > 1 else ''}, tp {dims.tp}) on {run.device.type} | "
            f"global batch {global_batch} x {cfg.model.seq_len} "
            f"tokens | {run.train_set.prefix} ({len(run.train_set):,} samples)"
        )
        for line in feature_lines(cfg, dims):
            run.metrics.message(f"hpc_train: {line}")
        describe = getattr(run.optimizer, "describe", None)  # where a strategy keeps what (optim.offload=nvme)
        if describe is not None:
            run.metrics.message(f"hpc_train: {describe()}")
    stages = stage_estimates(cfg, dims)
    predicted = stages[0]  # rank 0's, as its measured memory_bytes beside it
    worst = max(stages, key=lambda plan: plan.total)
    most = f"; {worst.total / 2**30:.3f} GiB on pipeline rank {worst.stage}, the most" if worst.stage else ""
    run.report(
        f"planner: {predicted.total / 2**30:.3f} GiB on rank 0 (params {predicted.params / 2**30:.3f}, grads "
        f"{predicted.grads / 2**30:.3f}, optimizer {predicted.optimizer / 2**30:.3f}, activations "
        f"{predicted.activations / 2**30:.3f}){most}; measured values follow in metrics.jsonl's memory_bytes"
    )
    return StepMeter(
        tokens_per_step=global_batch * cfg.model.seq_len,
        flops_per_token=run.model.spec.flops_per_token(cfg.model),
        world_size=dims.world_size,
        peak_flops=device_peak_flops(run.device, cfg.logging.mfu_peak),
        bubble_fraction=bubble_fraction(cfg.parallel, cfg.train.grad_accum),
        predicted={
            "params": predicted.params,
            "grads": predicted.grads,
            "optimizer": predicted.optimizer,
            "activations_per_microbatch": predicted.activations_per_microbatch,
            "total": predicted.total,  # beside memory_bytes' step_peak (logging.measure_peak_step)
            "host": predicted.host,
        },
        first_step=start_step + 1,
    )


def finish(run: Run, result: TrainResult, start_step: int) -> None:
    """The consolidated weights for export (written to a temporary name and renamed: never half-written)."""
    fault_point("consolidate", run.cfg.train.steps, run.rank_env.rank)
    final_state = full_state_dict(run.model) if run.cfg.train.save_final_model else None
    if run.metrics:
        run_dir = Path(run.cfg.run_dir)
        if final_state is not None:
            torch.save(final_state, run_dir / f".{FINAL_MODEL}.tmp")
            os.replace(run_dir / f".{FINAL_MODEL}.tmp", run_dir / FINAL_MODEL)
        final = f"final loss {result.losses[-1]:.4f}" if result.losses else f"already at step {start_step}"
        run.metrics.message(f"done: {final}; metrics in {run_dir / 'metrics.jsonl'}")
        run.metrics.close()
