"""Operating at scale: the slow rank is named, a hung rank is located with the stacks of every rank, the
doctor tests an allocation, a rendezvous that cannot complete says why, a loss spike is rolled back past
its data (the in-job restart after a rank dies is in test_checkpoint, next to the other resume tests; under
Slurm in test_slurm)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from hpc_train.checkpoint.local import partner_ranks
from hpc_train.checkpoint.store import CheckpointStore
from hpc_train.config.schema import SpikeGuardConfig
from hpc_train.data.prepare import load_datasets
from hpc_train.data.sampler import ResumableSampler, merge_ranges
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.observe.goodput import account
from hpc_train.planner import stage_estimates
from hpc_train.resilience.faults import fault_point
from hpc_train.resilience.preemption import REQUEUE, StopRequest
from hpc_train.resilience.spikes import Rollbacks, SpikeDetector, SpikeStop
from hpc_train.resilience.stragglers import find_stragglers
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, TINY_MODEL, max_param_diff, read_final_model, read_metrics, run_cli


def test_a_rank_is_compared_with_its_peers_not_itself():
    """Each rank against the median of the other ranks doing the same work: at dp=2 a rank 1.3x its one peer
    is past a 0.2 threshold (with itself in the median, 1.3 / 1.15 = 1.13 was not); at dp=1 nobody has a
    peer, so nobody is named; ranks of different stages are never compared."""
    assert [s["rank"] for s in find_stragglers([1.0, 1.3], [(0,), (0,)], 0.2)] == [1]
    assert find_stragglers([1.0, 1.3], [(0,), (0,)], 0.2)[0]["median_s"] == 1.0
    assert find_stragglers([1.0, 1.1], [(0,), (0,)], 0.2) == []
    assert find_stragglers([5.0], [(0,)], 0.2) == []  # dp=1
    assert find_stragglers([1.0, 3.0], [(0,), (1,)], 0.2) == []  # pp2 x dp1: two stages, no peers
    slow = find_stragglers([1.0, 1.0, 2.0, 1.6], [(0,)] * 4, 0.2)  # dp4: slowest first
    assert [(s["rank"], s["slower"]) for s in slow] == [(2, 2.0), (3, 1.6)]


def test_slow_rank_is_named_and_plotted(make_cfg, monkeypatch, capfd, tmp_path):
    """At dp=2 (one peer each) rank 1, 0.2 s slower per step from step 2 on, is named in both intervals."""
    monkeypatch.setenv("HPC_TRAIN_FAULT", "compute@2@1@slow")  # rank 1 computes 0.2 s longer from step 2 on
    cfg = make_cfg("parallel.nproc=2", "train.steps=6", "train.micro_batch_size=2", "logging.straggler_interval=3")
    launch_local(run_training, 2, cfg)
    reports = [r for r in read_metrics(cfg.run_dir) if "stragglers" in r]
    assert [r["step"] for r in reports] == [3, 6]
    for report in reports:
        assert [s["rank"] for s in report["stragglers"]] == [1], report
        assert report["stragglers"][0]["slower"] > 1.5 and report["stragglers"][0]["device"] == "cpu"
        assert len(report["rank_compute_s"]) == len(report["rank_step_s"]) == 2
        # its peers wait for it, so their steps are as slow as rank 1's: only compute tells them apart
        assert min(report["rank_step_s"]) > max(report["rank_compute_s"])
    assert "stragglers over steps 4-6: rank 1 (host " in capfd.readouterr().out
    png = tmp_path / "run.png"
    subprocess.run([sys.executable, "tools/plot_run.py", cfg.run_dir, "--out", png], cwd=ROOT, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stopped_rank_is_located_with_every_stack(tmp_path, small_corpus):
    """Rank 1 freezes (SIGSTOP) in step 3: within hang_timeout_s the run ends, every rank has a file in
    run_dir/hang (rank 0's Python stack, rank 1's state) and the summary names rank 1 and where rank 0 waits."""
    run = tmp_path / "run"
    start = time.monotonic()
    overrides = [*TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={run}", "parallel.nproc=2", "train.steps=6"]
    out = run_cli("train", *overrides, "parallel.hang_timeout_s=5", env={"HPC_TRAIN_FAULT": "mid_step@3@1@stop"})
    assert time.monotonic() - start < 5 + 60
    assert out.returncode == 2 and "rank 0 stopped a hung run" in out.stderr, out.stderr
    summary = (run / "hang/summary.txt").read_text()
    assert summary in out.stderr
    assert "ranks that never arrived: 1 (the others finished the backward pass of step 3)" in summary
    rank0 = next(line for line in summary.splitlines() if line.strip().startswith("rank 0 "))
    rank1 = next(line for line in summary.splitlines() if line.strip().startswith("rank 1 "))
    assert "finished the backward pass of step 3" in rank0 and "hpc_train/" in rank0, rank0
    assert "started step 3" in rank1 and "stopped (state T)" in rank1, rank1
    assert 'File "' in (run / "hang/rank00000.txt").read_text()
    assert "no Python stack" in (run / "hang/rank00001.txt").read_text()


def test_frozen_rank_without_peers_is_found_by_its_launcher(tmp_path, small_corpus):
    """One rank (parallel.max_restarts=1: a process of its own) freezes (SIGSTOP) in step 3: its watchdog is
    frozen with it and no peer's can notice, so the launcher, which no longer hears its heartbeat, kills it
    within hang_timeout_s and a tick, names it, and restarts it: the run resumes from step 2 and completes."""
    run = tmp_path / "run"
    out = run_cli("train", *TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={run}", "parallel.nproc=1",
                  "train.steps=4", "checkpoint.interval=2", "parallel.hang_timeout_s=3", "parallel.max_restarts=1",
                  "checkpoint.async_save=false", env={"HPC_TRAIN_FAULT": "mid_step@3@0@stop"},
                  timeout_s=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    frozen = r"rank 0 froze \(pid \d+, stopped\): no sign of life for [3-6]s \(parallel.hang_timeout_s=3s\)"
    assert re.search(frozen + r".*\(in-job restart 1 of parallel.max_restarts=1\)", out.stderr), out.stderr
    assert f"resumed from {run}/checkpoints/step_0000002 (step 2)" in out.stdout
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


def test_hung_rank_is_located_and_the_run_restarts(tmp_path, small_corpus):
    """Rank 1 hangs inside step 3 (in Python: its watchdog still runs): both ranks write their stacks, the
    summary names where each one waits, and with parallel.max_restarts=1 the run restarts from step 2 and
    completes."""
    run = tmp_path / "run"
    out = run_cli("train", *TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={run}", "parallel.nproc=2",
                  "train.steps=4", "checkpoint.interval=2", "parallel.hang_timeout_s=5", "parallel.max_restarts=1",
                  env={"HPC_TRAIN_FAULT": "mid_step@3@1@hang"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "rank 0 exited with status 3" in out.stderr or "rank 1 exited with status 3" in out.stderr
    assert "(in-job restart 1 of parallel.max_restarts=1)" in out.stderr
    (kept,) = run.glob("hang-*/summary.txt")  # moved aside by the restarted run
    summary = kept.read_text()
    rank1 = next(line for line in summary.splitlines() if line.strip().startswith("rank 1 "))
    assert "in fault_point (hpc_train/resilience/faults.py:" in rank1, summary
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    lost = account(run)["lost_s"]  # goodput: the hang until it was caught (5 s), lost with step 3; the restart
    assert lost["redone"] > 5 and lost["restart"] > 0, lost


@pytest.mark.parametrize(
    ("fault", "steps", "doing", "rank1_at"),
    [
        ("save@2@1@hang", 4, "the checkpoint save of step 2 did not finish within 12s",
         "saving the checkpoint of step 2"),
        ("mid_step@1@1@hang", 4, "step 1 did not finish within 12s (parallel.hang_timeout_s=3s)", "started step 1"),
        ("consolidate@3@1@hang", 3, "the final consolidation of step 3 did not finish within 12s",
         "consolidating the final weights after step 3"),  # under tp=2: its shards are gathered
        ("resume@0@1@hang", 4, "the resume did not finish within 12s", "not started training"),
    ],
    ids=["save", "first_step", "final_consolidation", "resume"],
)  # fmt: skip
def test_a_hang_outside_a_steady_step_is_located(tmp_path, small_corpus, fault, steps, doing, rank1_at):
    """Rank 1 hangs inside a checkpoint save, the first step of the process, the final consolidation or a
    resume (each has collectives): the watchdog fires there too (after 4x parallel.hang_timeout_s), every
    rank writes its stacks, the summary names what was unfinished and where rank 1 waits, and no
    checkpoint of a hung save is committed."""
    run = tmp_path / "run"
    overrides = [*TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={run}", "parallel.nproc=2",
                 "checkpoint.interval=2", "parallel.hang_timeout_s=3"]  # fmt: skip
    if fault.startswith("resume"):  # a checkpoint of step 2 to resume from (launched from this process)
        launch_local(run_training, 2, load_config(None, [*overrides, "train.steps=2"]))
    tp = ["parallel.tp=2"] if fault.startswith("consolidate") else []
    out = run_cli("train", *overrides, *tp, f"train.steps={steps}", env={"HPC_TRAIN_FAULT": fault})
    assert out.returncode == 2 and re.search(r"rank \d stopped a hung run", out.stderr), out.stderr
    summary = (run / "hang/summary.txt").read_text()
    assert f"hang: {doing}" in summary, summary
    rank1 = next(line for line in summary.splitlines() if line.strip().startswith("rank 1 "))
    assert rank1_at in rank1 and "in fault_point (hpc_train/resilience/faults.py:" in rank1, summary
    assert 'File "' in (run / "hang/rank00000.txt").read_text()
    if fault.startswith("save"):
        assert CheckpointStore(run / "checkpoints").newest_valid() is None


def test_doctor_reports_every_rank_and_every_group(tmp_path):
    out = run_cli("doctor", "configs/tiny.yaml", "parallel.nproc=4", "parallel.tp=2", f"run_dir={tmp_path}", "--local")
    assert out.returncode == 0, out.stderr
    assert "doctor: 4 ranks (pp 1, dp 2, cp 1, tp 2) joined through 127.0.0.1:" in out.stdout
    assert all(f"    {r}  " in out.stdout for r in range(4))
    for role, size in (("world", 4), ("dp", 2), ("tp", 2)):
        assert f"  {role:<6} ({size} ranks per group): " in out.stdout
    assert "doctor: every rank joined and every group reduced" in out.stdout


def test_rendezvous_names_the_missing_rank_and_the_unreachable_master(make_cfg):
    """A task alone in a world of 2 (torchrun's variables): rank 0 waits parallel.rendezvous_timeout_s and
    names rank 1; rank 1 without a master names the address it could not reach. Both with the usual causes."""
    cfg = make_cfg()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for rank, expected in (
        (0, f"rank 0: rendezvous at 127.0.0.1:{port}: 1 of 2 ranks arrived within parallel.rendezvous_timeout_s=3s; "
            "never arrived: rank(s) 1"),
        (1, f"rank 1: could not reach 127.0.0.1:{port} within parallel.rendezvous_timeout_s=3s"),
    ):  # fmt: skip
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = run_cli("train", *TINY_MODEL, f"data.train_path={cfg.data.train_path}", f"run_dir={cfg.run_dir}",
                      "parallel.rendezvous_timeout_s=3", env=env, timeout_s=120)  # fmt: skip
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert "usual causes: the master's host name resolves differently" in out.stderr
        assert "Traceback" not in out.stderr


def test_the_spike_detector_watches_medians_of_clean_steps():
    """A step is a spike when its loss (or gradient norm) exceeds the ratio x the median of the last `window`
    clean steps, once that many were seen; spikes and skipped steps never join the history; ratio 0 unwatches."""
    detector = SpikeDetector(SpikeGuardConfig(enabled=True, window=3, loss_ratio=1.5, grad_norm_ratio=0), "cpu")

    def seen(loss: float, skipped: bool = False, grad_norm: float = 1.0) -> bool:
        return bool(detector.observe(torch.tensor(loss), torch.tensor(grad_norm), torch.tensor(skipped)))

    assert [seen(x) for x in (4.0, 2.0, 3.0)] == [False] * 3  # filling the window
    assert seen(4.4) is False and seen(5.0, skipped=True) is False  # median 3 (then 3: the skipped one left out)
    assert seen(4.6) is True and seen(4.6) is True  # 4.6 > 1.5 x 3, and still: a spike is not kept
    assert seen(3.0, grad_norm=1e9) is False  # the gradient norm is not watched (ratio 0)
    assert detector.medians() == {"loss_median": 3.0, "grad_norm_median": 1.0}
    restored = SpikeDetector(SpikeGuardConfig(enabled=True, window=3), "cpu")
    restored.load_state_dict(detector.state_dict())  # a checkpoint part: a rollback restores the medians
    assert restored.medians() == detector.medians() and int(restored.kept) == int(detector.kept) == 5


def test_too_many_rollbacks_stop_the_run_naming_them():
    rollbacks = Rollbacks(SpikeGuardConfig(enabled=True, max_rollbacks=2, rollback_window=100))
    rollbacks.done += [{"spike_step": 10, "skipped_samples": (72, 80)},
                       {"spike_step": 150, "skipped_samples": (1192, 1200)}]  # fmt: skip
    rollbacks.check(170, (1352, 1360))  # the one at step 10 is out of the window
    rollbacks.done.append({"spike_step": 170, "skipped_samples": (1352, 1360)})
    with pytest.raises(
        SpikeStop,
        match=r"3 spikes within .*rollback_window=100 steps, more than .*max_rollbacks=2: "
        r"step 150 \(samples 1192-1200\); step 170 .*; step 180 \(samples 1432-1440\)",
    ):
        rollbacks.check(180, (1432, 1440))
    assert Rollbacks(SpikeGuardConfig(skip="since_checkpoint")).skipped_range(56, 8, 32) == (32, 56)
    assert Rollbacks(SpikeGuardConfig(skip="step")).skipped_range(56, 8, 32) == (48, 56)


def test_skipped_ranges_join_and_are_read_past_from_inside():
    """Overlapping and adjacent ranges join (two rollbacks since one checkpoint); a sampler standing inside a
    range (a resume) reads past its end."""
    assert merge_ranges([[32, 56]], [[32, 72], [72, 80], [8, 16]]) == [[8, 16], [32, 80]]
    sampler = ResumableSampler(1000, 4, 2, 0, 1, 0, skipped=[[8, 16], [12, 24]])  # joined as given
    [sampler.next_micro_batches() for _ in range(3)]
    assert sampler.consumed_samples == 28  # 0-4, 4-8, then 24-28
    inside = ResumableSampler(1000, 4, 4, 0, 1, 0, consumed_samples=12, skipped=[[8, 24]])
    assert inside.next_micro_batches()[0].tolist() == inside.global_indices(24, 4).tolist()


SPIKE_RUN = ["train.steps=12", "train.micro_batch_size=2", "checkpoint.interval=4", "logging.log_interval=4"]
POISONED = {"HPC_TRAIN_FAULT": "batch@7@0@spike"}  # the stream's 7th global batch: loss and gradients x 1000


TP2_DP2_ZERO1 = ["parallel.nproc=4", "parallel.tp=2", "parallel.sequence_parallel=true", "optim.zero_stage=1"]


# node-local checkpoints every 3 steps: written from the same host copy, the newest save a rollback restores
LOCAL_EVERY_3 = ["checkpoint.local_interval=3", "parallel.max_restarts=1"]


@pytest.mark.parametrize(
    "layout, skip, skipped, source, to_step",
    [([], "since_checkpoint", [8, 14], "memory", 4),
     (["train.spike_guard.memory_copy=false"], "step", [12, 14], "disk", 4),
     ([*TP2_DP2_ZERO1, *LOCAL_EVERY_3], "step", [24, 28], "memory", 6)],
    ids=["one_process", "one_process_disk", "tp2_dp2_zero1_local"],
)  # fmt: skip
def test_a_loss_spike_is_rolled_back_past_its_data(layout, skip, skipped, source, to_step, tmp_path, small_corpus):
    """A poisoned batch read at step 7 spikes the loss: every rank rolls back to the newest checkpoint, step
    4's (read from disk, or from the copy each save keeps in host memory, which the planner counts exactly)
    or, with node-local checkpoints, step 6's local one (written from that same copy), skips the spiking
    step's batch (or every batch since the checkpoint), and trains on to step 12. Its weights are those of a
    run told to skip the same samples from the start (data.skip_samples: it never reads the poisoned batch),
    exactly, and metrics.jsonl names what was skipped, by dataset index."""
    if "checkpoint.local_interval=3" in layout:
        layout = [*layout, f"checkpoint.local_dir={tmp_path / 'local'}"]
    base = [*TINY_MODEL, f"data.train_path={small_corpus}", *SPIKE_RUN, *layout]
    guard = ["train.spike_guard.enabled=true", "train.spike_guard.window=4", f"train.spike_guard.skip={skip}"]
    guarded = run_cli("train", *base, *guard, f"run_dir={tmp_path / 'guarded'}", env=POISONED)
    assert guarded.returncode == 0 and "loss spike at step 7: loss " in guarded.stdout, guarded.stderr
    assert (
        f"rolled back to the checkpoint of step {to_step} (from {source}), samples {skipped[0]}-{skipped[1]} of the "
        "stream skipped" in guarded.stdout
    )
    run_cli("train", *base, f"data.skip_samples=[{skipped}]", f"run_dir={tmp_path / 'reference'}", env=POISONED)
    assert max_param_diff(read_final_model(tmp_path / "guarded"), read_final_model(tmp_path / "reference")) == 0.0
    records, reference = read_metrics(tmp_path / "guarded"), read_metrics(tmp_path / "reference")
    assert [r["step"] for r in records] == list(range(1, 13))  # the rolled-back steps' records replaced
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in reference]
    assert [r["step"] for r in records if "rollback" in r] == [to_step + 1]  # on the first step trained again
    (rollback,) = records[to_step]["rollback"]
    assert rollback["spike_step"] == 7 and rollback["to_step"] == to_step and rollback["skipped_samples"] == skipped
    assert rollback["from"] == source and rollback["rollback_s"] > 0
    assert account(tmp_path / "guarded")["lost_s"]["rollback"] > rollback["rollback_s"]  # and the steps dropped
    assert rollback["loss"] > 100 * rollback["loss_median"]
    assert rollback["grad_norm"] > 100 * rollback["grad_norm_median"]
    cfg = load_config(None, base)
    sampler = ResumableSampler(len(load_datasets(cfg.data, cfg.model, progress=False)[0]), 1, 1, 0, 1, cfg.train.seed)
    assert rollback["skipped_indices"] == sampler.global_indices(skipped[0], skipped[1] - skipped[0]).tolist()
    copied = [r["checkpoint"].get("memory_copy_bytes") for r in records if "checkpoint" in r]
    if source == "memory":  # rank 0's copy, at every save: what the planner counts
        dims = ParallelDims(tp=2, dp=2) if layout else ParallelDims()
        planned = stage_estimates(load_config(None, [*base, *guard]), dims)[0]
        assert copied == [planned.host_copy] * 3 == [planned.params + planned.optimizer] * 3
        assert all(r["checkpoint"]["memory_copy_s"] > 0 for r in records if "checkpoint" in r)
        local = [r["local_checkpoint"]["local_bytes"] - planned.host_copy for r in records if "local_checkpoint" in r]
        assert (len(local), all(0 < header < 2**16 for header in local)) == ((3, True) if to_step == 6 else (0, True))
    else:
        assert copied == [None] * 3


def test_a_spike_before_the_first_checkpoint_is_reported_and_trained_on(tmp_path, small_corpus):
    guard = ["train.spike_guard.enabled=true", "train.spike_guard.window=4", "checkpoint.interval=8"]
    out = run_cli("train", *TINY_MODEL, f"data.train_path={small_corpus}", "train.steps=8", "logging.log_interval=4",
                  *guard, f"run_dir={tmp_path}", env=POISONED)  # fmt: skip
    assert out.returncode == 0 and "loss spike at step 7: loss " in out.stdout, out.stderr
    assert "no checkpoint to roll back to yet, training on" in out.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))


def test_a_corrupt_local_copy_on_one_node_falls_back_to_the_step_before(tmp_path, small_corpus):
    """One node (each rank its own partner: no replica): rank 0's own local copy of step 3 has a flipped byte
    and rank 1 is killed in step 4; the in-job restart passes over step 3, naming the file, and resumes from
    the local step 2 on every rank (it crashed on the missing replica). Beside it lie the local copies of steps
    5 and 6 of another run of the same name and layout (another learning rate and run_dir), killed as a node
    crash kills it: they are neither read (they were: "resumed from step 6") nor pruned; and a rerun of that
    run after its user went back to its step 4 does not take its old local step 6 for its own. A run that ends
    leaves no local copy of its own."""
    local = tmp_path / "local"
    common = [*TINY_MODEL, f"data.train_path={small_corpus}", "parallel.nproc=2", "train.micro_batch_size=2",
              "checkpoint.interval=4", "parallel.max_restarts=1", f"checkpoint.local_dir={local}",
              "checkpoint.local_interval=1"]  # fmt: skip
    other = [*common, "train.steps=8", "optim.lr=1e-3", f"run_dir={tmp_path / 'other'}"]
    # a non-finite loss ends a run without a restart, its local copies left as a crash leaves them
    crashed = run_cli("train", *other, env={"HPC_TRAIN_FAULT": "loss@7@0@nan"})
    assert crashed.returncode != 0 and "step 7: " in crashed.stderr + crashed.stdout
    (other_root,) = local.iterdir()
    assert sorted(p.name for p in other_root.glob("step_*")) == ["step_0000005", "step_0000006"]
    run = tmp_path / "run"
    out = run_cli("train", *common, f"run_dir={run}", "train.steps=5",
                  env={"HPC_TRAIN_FAULT": "local_saved@3@0@corrupt,mid_step@4@1"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    (resumed,) = [r["resumed_from"] for r in read_metrics(run) if "resumed_from" in r]
    assert (resumed["step"], resumed["source"]) == (2, "local"), resumed
    (passed_over,) = resumed["passed_over"]
    assert passed_over.startswith("rank 0: ") and "step_0000003/rank00000.pt fails its xxh3_128" in passed_over
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5]
    assert list(local.iterdir()) == [other_root]  # its own copies deleted at its end, the other run's kept
    assert sorted(p.name for p in other_root.glob("step_*")) == ["step_0000005", "step_0000006"]
    # the other run's user goes back to its step 4 (the shared checkpoint it has) and runs it again, killed in
    # step 6: its restart resumes from its new local step 5, not the old job's step 6
    again = run_cli("train", *other, env={"HPC_TRAIN_FAULT": "mid_step@6@1"})
    assert again.returncode == 0, again.stderr
    assert [r["resumed_from"]["step"] for r in read_metrics(tmp_path / "other") if "resumed_from" in r] == [4, 5]
    assert list(local.iterdir()) == []


def test_local_copies_have_a_partner_on_another_node_and_faults_need_the_test_switch(
    tmp_path, monkeypatch, small_corpus
):
    """The partner that keeps a rank's local copy is on the next node under any task distribution (it was
    `rank + ranks per node`: on the same node under srun -m cyclic); one node, or nodes with different numbers
    of ranks, keep no partner copies. An unset variable in checkpoint.local_dir stops the run with an error
    (it trained, in a directory named `$UNSET...`). With local_dir/<name> as checkpoint.dir, the local
    prune keeps off the shared checkpoints (it deleted all but two of them). HPC_TRAIN_FAULT does nothing
    without the test switch HPC_TRAIN_TESTING=1."""
    assert partner_ranks(["n1", "n1", "n2", "n2"]) == [2, 3, 0, 1]  # block
    assert partner_ranks(["n1", "n2", "n1", "n2"]) == [1, 0, 3, 2]  # cyclic
    assert partner_ranks(["n1", "n2", "n3"]) == [1, 2, 0]
    assert partner_ranks(["n1", "n1"]) == [0, 1] and partner_ranks(["n1", "n1", "n2"]) == [0, 1, 2]
    monkeypatch.delenv("UNSET_FOR_TEST", raising=False)
    run = [*TINY_MODEL, f"data.train_path={small_corpus}", "train.steps=6", "checkpoint.interval=2",
           "checkpoint.local_interval=1", "parallel.max_restarts=1", "name=ckpt"]  # fmt: skip
    unset = run_cli("train", *run, "checkpoint.local_dir=$UNSET_FOR_TEST/x", f"run_dir={tmp_path / 'unset'}",
                    cwd=tmp_path)  # fmt: skip
    assert unset.returncode == 2 and "$UNSET_FOR_TEST/x holds a variable this node does not set" in unset.stderr
    assert not any("UNSET" in p.name for p in tmp_path.iterdir())
    shared = run_cli("train", *run, f"checkpoint.local_dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                     f"run_dir={tmp_path / 'run'}")  # fmt: skip
    assert shared.returncode == 0, shared.stderr
    kept = [info.step for info in CheckpointStore(tmp_path / "ckpt").scan() if info.problem is None]
    assert kept == [6, 4, 2]  # checkpoint.keep_last=3; local steps 1, 3 and 5 in between
    monkeypatch.setenv("HPC_TRAIN_FAULT", "loss@3@0@nan")
    assert fault_point("loss", 3, 0) == "nan"
    monkeypatch.delenv("HPC_TRAIN_TESTING")
    assert fault_point("loss", 3, 0) == ""


def test_a_users_stop_outweighs_the_time_limit_warning():
    """Real signals to this process: Slurm's warning alone asks for a requeue; a user's SIGTERM, before or
    after a warning, is kept as the weightier stop (what the ranks then agree on: stop, no requeue)."""
    stop = StopRequest().install()
    try:
        assert stop.level == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.level == REQUEUE
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)  # the warning after the user's stop
        assert stop.level > REQUEUE
    finally:
        stop.uninstall()
