"""Looking inside a run: step-time breakdown, the planner's prediction beside the measurement, a profiler
window, TensorBoard, the plot tool, and the report written when a step runs out of memory."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, read_metrics


def test_breakdown_profile_tensorboard_and_plot(make_cfg, tmp_path):
    cfg = make_cfg("train.steps=4", "logging.breakdown=true", "logging.profile_steps=[2,3]",
                   "logging.tensorboard=true", "train.eval_interval=2")  # fmt: skip
    launch_local(run_training, 1, cfg)
    records = read_metrics(cfg.run_dir)
    for r in records:
        phases = r["time_breakdown_s"]
        assert {"forward_backward", "grad_reduce", "optimizer", "pipeline_bubble_est", "total"} <= phases.keys()
        assert phases["forward_backward"] > 0 and phases["optimizer"] > 0 and phases["pipeline_bubble_est"] == 0
        assert phases["forward_backward"] + phases["optimizer"] <= phases["total"]
    for r in records[:2]:  # measured on the first two steps; later steps run without the saved-tensor hooks
        assert set(r["memory_bytes"]) == {"params", "grads", "optimizer", "activations_per_microbatch",
                                          "activations_peak"}  # fmt: skip
    assert ["memory_bytes" in r for r in records] == [True, True, False, False]
    assert ["memory_predicted_bytes" in r for r in records] == [True, True, False, False]
    assert records[1]["memory_predicted_bytes"]["params"] == records[1]["memory_bytes"]["params"]
    trace = json.loads((tmp_path / "run/profile/trace_rank00000.json").read_text())
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])
    assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))
    png = tmp_path / "run.png"
    subprocess.run([sys.executable, "tools/plot_run.py", cfg.run_dir, "--out", png], cwd=ROOT, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_out_of_memory_writes_a_memory_report_and_the_groups_are_freed(make_cfg, monkeypatch):
    """Also: a run's process groups (their gloo worker threads) are freed when it ends, however it ends; one
    left to interpreter exit aborts the process there (see bootstrap._free_groups)."""

    def threads() -> int:  # but the rendezvous store's server, which launch_local's frame holds
        names = [Path(f"/proc/self/task/{task}/comm").read_text() for task in os.listdir("/proc/self/task")]
        return sum(name != "pt_tcpstore_uv\n" for name in names)

    launch_local(run_training, 1, make_cfg("train.steps=1", run="warm"))  # torch's own thread pools start
    gc.collect()
    before = threads()
    launch_local(run_training, 1, make_cfg("train.steps=1", run="fine"))
    assert threads() == before
    monkeypatch.setenv("HPC_TRAIN_FAULT", "mid_step@2@0@oom")
    cfg = make_cfg("train.steps=3")
    with pytest.raises(torch.OutOfMemoryError) as failed:
        launch_local(run_training, 1, cfg)
    assert threads() == before and failed.value  # while the error and its traceback are still held
    report = (Path(cfg.run_dir) / "oom_rank00000.txt").read_text()
    assert "out of memory on rank 0 (cpu)" in report and "activations_per_microbatch" in report
