"""Training correctness: multi-process runs against a single-process reference, numerically."""

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_train.job import load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.models import get_spec
from hpc_train.resilience import watchdog
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, TINY_MODEL, HostReads, max_param_diff, read_final_model, read_metrics, run_cli

STEPS = 5
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus):
    """One process, global batch 4 (micro batch 4): the run every layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            f"data.train_path={small_corpus}",
            f"run_dir={run_dir}",
            f"train.steps={STEPS}",
            "train.micro_batch_size=4",
        ],
    )
    result = launch_local(run_training, 1, cfg)
    return result.losses, read_final_model(run_dir)


def assert_matches(run_dir, reference) -> None:
    losses, params = reference
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert max(abs(m["loss"] - ref) for m, ref in zip(metrics, losses, strict=True)) <= TOL
    assert max_param_diff(read_final_model(run_dir), params) <= TOL


def test_two_process_data_parallel_matches_single_process(make_cfg, reference):
    cfg = make_cfg(f"train.steps={STEPS}", "train.micro_batch_size=2", "parallel.nproc=2")
    launch_local(run_training, 2, cfg)
    assert_matches(cfg.run_dir, reference)
    metrics = read_metrics(cfg.run_dir)
    assert reference[0][0] > reference[0][-1]  # and it learns
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops", "memory_gb", "consumed_samples"):
        assert all(m[key] > 0 for m in metrics), key
    assert not any("mfu" in m for m in metrics)  # a CPU has no known peak: tokens/s and TFLOP/s only
    times = [m["time"] for m in metrics]  # each step's wall-clock time, in order, and no job id outside Slurm
    assert times == sorted(times) and time.time() - 600 < times[0] and not any("job_id" in m for m in metrics)
    assert metrics[-1]["consumed_samples"] == STEPS * 4
    assert load_config(f"{cfg.run_dir}/config.yaml").train.micro_batch_size == 2  # resolved config saved


def test_ranks_bootstrap_from_slurm_environment(make_cfg, reference, tmp_path):
    """Two `hpc-train train` processes that see only an srun step's variables find each other and train."""
    run_dir = tmp_path / "slurm_env"
    job_id = str(random.randrange(10**6))  # the rendezvous port derives from it
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "SLURM_JOB_ID": job_id,
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_TASKS_PER_NODE": "2",
        }
        cfg = make_cfg()  # same data and model as the reference, given as overrides on the command line
        overrides = [
            *TINY_MODEL,
            f"data.train_path={cfg.data.train_path}",
            f"run_dir={run_dir}",
            f"train.steps={STEPS}",
            "train.micro_batch_size=2",
            "logging.progress=lines",
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpc_train.cli", "train", *overrides],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "world 2 (pp 1, dp 2, tp 1)" in outputs[0]
    assert_matches(run_dir, reference)


def test_gradient_accumulation_matches_large_micro_batch(make_cfg):
    accumulated = launch_local(
        run_training, 1, make_cfg("train.steps=4", "train.micro_batch_size=2", "train.grad_accum=4", run="accum")
    )
    single = launch_local(run_training, 1, make_cfg("train.steps=4", "train.micro_batch_size=8", run="single"))
    assert max(abs(a - b) for a, b in zip(accumulated.losses, single.losses, strict=True)) <= TOL
    diff = max_param_diff(
        read_final_model(make_cfg(run="accum").run_dir), read_final_model(make_cfg(run="single").run_dir)
    )
    assert diff <= TOL


def test_mixed_precision_tracks_fp32(make_cfg):
    """bf16 autocast and fp16 with a dynamic loss scale follow the fp32 loss curve closely for 10 steps."""
    runs = {
        p: launch_local(run_training, 1, make_cfg("train.steps=10", f"train.precision={p}", run=p)).losses
        for p in ("fp32", "bf16", "fp16")
    }
    assert runs["fp32"][-1] < runs["fp32"][0] - 0.2
    for precision in ("bf16", "fp16"):  # close, and not equal: the precision really changed the arithmetic
        assert 1e-6 < max(abs(a - b) for a, b in zip(runs[precision], runs["fp32"], strict=True)) < 0.05, precision
    assert "loss_scale" in read_metrics(make_cfg(run="fp16").run_dir)[-1]


def test_tiny_config_learns_on_the_embedded_corpus(tmp_path):
    """The README's demo: configs/tiny.yaml, 2 processes, the standard-library corpus.
    Measured: loss 5.57 at step 1, eval loss 2.03 at step 100. Threshold: eval loss < 2.4 by step 100."""
    out = run_cli("train", "configs/tiny.yaml", "train.steps=100", f"run_dir={tmp_path}", "logging.progress=lines",
                  "logging.log_interval=50")  # fmt: skip
    assert out.returncode == 0, out.stderr
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 100 and metrics[0]["loss"] > 5.0
    assert metrics[-1]["eval_loss"] < 2.4
    assert "step 100 | loss" in out.stdout
    weights = read_final_model(tmp_path)
    model_cfg = load_config(tmp_path / "config.yaml").model
    model = get_spec(model_cfg.arch).build_stage(model_cfg)
    model.load_state_dict(weights)  # the exported weights load into a fresh model
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))[..., :257]).all()


def test_a_step_whose_loss_alone_is_nonfinite_is_dropped_on_every_rank(make_cfg, monkeypatch, capfd):
    """A NaN planted into rank 0's loss at step 2 (its gradients stay finite) under dp2 ZeRO-1: the step is
    logged as skipped and really is, on both ranks (each updates its own half of the weights): the weights
    after it are, bit for bit, those of a run that stopped after step 1."""
    monkeypatch.setenv("HPC_TRAIN_FAULT", "loss@2@0@nan")
    layout = ["optim.zero_stage=1", "parallel.nproc=2", "train.micro_batch_size=2", "train.skip_nonfinite=1"]
    one, two = make_cfg(*layout, "train.steps=1", run="one"), make_cfg(*layout, "train.steps=2", run="two")
    launch_sequence(run_training, 2, [(one,), (two,)])
    assert "step 2: the loss is nan; step skipped (1 of train.skip_nonfinite=1)" in capfd.readouterr().out
    assert [r.get("skipped", False) for r in read_metrics(two.run_dir)] == [False, True]
    assert max_param_diff(read_final_model(two.run_dir), read_final_model(one.run_dir)) == 0.0


def counted_host_reads(rank_env, cfg) -> None:
    """run_training counting this rank's host reads by step (the loop's `watchdog.record(step, 0)` starts a
    step), written to run_dir/host_reads_<rank>.json."""
    counter, record = HostReads(), watchdog.record

    def starts(step: int, phase: int, rollbacks: int = 0) -> None:
        if phase == 0:
            counter.step = step
        record(step, phase, rollbacks)

    watchdog.record = starts
    try:
        with counter:
            run_training(rank_env, cfg)
    finally:
        watchdog.record = record
    (Path(cfg.run_dir) / f"host_reads_{rank_env.rank}.json").write_text(json.dumps(counter.by_step))


MOE_KEYS = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
            "model.moe.num_shared_experts=1", "model.moe.aux_loss_coef=0.01",
            "model.moe.bias_update_rate=0.01"]  # fmt: skip
EP2 = ["parallel.ep=2", "parallel.nproc=2", "train.micro_batch_size=2", "train.grad_accum=2"]


@pytest.mark.parametrize(
    "keys, step_reads, interval_reads",
    [
        (["train.precision=fp16", "optim.zero_stage=1"], 0, 2),
        (["optim.name=muon", "train.precision=bf16"], 0, 2),
        # routing, the grouped GEMM, statistics, aux loss and bias updates stay on the device; the layers'
        # figures are read with the interval's, one read per step
        (MOE_KEYS, 0, 2 + 4),
        # expert parallelism: the all-to-all split sizes, once per MoE layer (2) and micro-batch (2)
        ([*MOE_KEYS, *EP2], 2 * 2, 2 + 4),
    ],
    ids=["fp16_zero1", "muon_bf16", "moe", "moe_ep2"],
)
def test_the_loop_reads_the_device_once_per_log_interval(make_cfg, keys, step_reads, interval_reads):
    """Loss, gradient norm, fp16's overflow flag and scale, the skip decision and the clipping stay on the
    device: 8 steps at logging.log_interval=4 read it only at steps 4 and 8 (the figures of the interval's
    steps at once, and the agreed peak memory and stop flag), and every step is still recorded. An MoE
    model's steps read nothing either, but for the split sizes under expert parallelism."""
    cfg = make_cfg(*keys, "train.steps=8", "logging.log_interval=4", "train.save_final_model=false",
                   "optim.grad_clip=0.5", "logging.straggler_interval=0")  # fmt: skip
    launch_local(counted_host_reads, cfg.parallel.nproc, cfg)
    for rank in range(cfg.parallel.nproc):
        by_step = json.loads((Path(cfg.run_dir) / f"host_reads_{rank}.json").read_text())
        per_step = {step: by_step.get(str(step), 0) for step in range(1, 9)}
        expected = {step: step_reads + (interval_reads if step in (4, 8) else 0) for step in range(1, 9)}
        assert per_step == expected, rank
    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
