"""Fault tolerance with real processes, real SIGKILLs and real files: bit-exact resume, crashes at every
point of the commit protocol, corrupted checkpoints, and resharding to another layout."""

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from hpc_train.bootstrap import distributed, node_cores, node_name
from hpc_train.builder import build_run
from hpc_train.checkpoint.checkpointer import choose_async, host_stager, open_stager
from hpc_train.checkpoint.local import local_run_root
from hpc_train.checkpoint.safe_load import read_dcp_metadata
from hpc_train.checkpoint.store import CheckpointStore
from hpc_train.cli import main
from hpc_train.config import MEMORY_DIR
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.placement import local
from hpc_train.resilience.faults import SLOW_S
from hpc_train.train.loop import run_training
from hpc_train.train.step import StepOptions, train_step
from tests.conftest import ROOT, TINY_MODEL, max_param_diff, read_final_model, read_metrics, run_cli, streams_to

COMMON = [*TINY_MODEL, "checkpoint.interval=2"]
SP = "parallel.sequence_parallel=true"
TP2_DP2_ZERO1 = ["parallel.tp=2", SP, "train.micro_batch_size=2", "train.grad_accum=2", "optim.zero_stage=1",
                 "optim.bucket_mb=0.05"]  # fmt: skip


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def resumed_from(run_dir) -> list[dict]:
    """Where each resume of this run picked up (recorded in the first metrics record after it)."""
    return [m["resumed_from"] for m in read_metrics(run_dir) if "resumed_from" in m]


def launch(world, *cfgs):
    launch_sequence(run_training, world, [(cfg,) for cfg in cfgs])


@pytest.fixture(scope="module")
def cfg_for(tmp_path_factory, small_corpus):
    base = tmp_path_factory.mktemp("ckpt")

    def make(run: str, *overrides: str):
        return load_config(None, [*COMMON, f"data.train_path={small_corpus}", f"run_dir={base / run}", *overrides])

    return make


@pytest.fixture(scope="module")
def reference(cfg_for):
    """One process, global batch 8, 4 steps, uninterrupted."""
    cfg = cfg_for("reference", "train.steps=4", "train.micro_batch_size=8")
    launch_local(run_training, 1, cfg)
    return cfg.run_dir


def test_single_process_resume_is_bit_exact(cfg_for, reference, capsys):
    """With step 1's checkpoint there to fall back on, step 2's is read in one pass: each byte of its files
    once, the shards hashed as they are read, the small files (.metadata, the rank's) checksummed alone."""
    launch_local(run_training, 1, cfg_for("resumed", "train.steps=2", "train.micro_batch_size=8",
                                          "checkpoint.interval=1"))  # fmt: skip
    run = cfg_for("resumed", "train.steps=4", "train.micro_batch_size=8")
    capsys.readouterr()
    assert len(launch_local(run_training, 1, run).losses) == 2  # this run trained steps 3 and 4 only
    (resumed,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resumed from")]
    found = re.search(r"its files' (\d+) bytes read in one pass, checksums checked as read: (\d+) bytes over "
                      r"the ranks, (\d+) of them for checksums alone", resumed)  # fmt: skip
    files = json.loads((Path(run.checkpoint.dir) / "step_0000002/manifest.json").read_text())["files"]
    small = sum(record["size"] for name, record in files.items() if not name.endswith(".distcp"))
    assert found and [int(n) for n in found.groups()] == [sum(r["size"] for r in files.values())] * 2 + [small]
    assert [r["step"] for r in resumed_from(run.run_dir)] == [2]
    assert losses(run.run_dir) == losses(reference)
    assert max_param_diff(read_final_model(run.run_dir), read_final_model(reference)) == 0.0


@pytest.fixture(scope="module")
def world4_runs(cfg_for, small_corpus):
    """4 ranks: tp2 x dp2 ZeRO-1 uninterrupted, stopped at 2 and resumed, and sources for resharding (the
    ZeRO-3 ones evaluate just before their save: FSDP's units gathered by a forward alone are freed), and the
    reshard rows' 4-rank target, after its source."""
    full = cfg_for("tp2dp2_full", *TP2_DP2_ZERO1, "train.steps=4", "parallel.nproc=4")
    first = cfg_for("tp2dp2_split", *TP2_DP2_ZERO1, "train.steps=2", "parallel.nproc=4")
    resumed = cfg_for("tp2dp2_split", *TP2_DP2_ZERO1, "train.steps=4", "parallel.nproc=4")
    to_tp1 = cfg_for("reshard_tp", *TP2_DP2_ZERO1, "train.steps=2", "parallel.nproc=4")
    dp4 = cfg_for("reshard_dp", "train.micro_batch_size=2", "optim.zero_stage=1", "train.steps=2", "parallel.nproc=4")
    evaluate = ["train.eval_interval=2", f"data.valid_path={small_corpus}_valid"]
    dp4_stage = lambda run, stage: cfg_for(run, "train.micro_batch_size=2", f"optim.zero_stage={stage}",
                                           "optim.bucket_mb=0.05", "train.steps=2", "parallel.nproc=4",
                                           *(evaluate if stage == 3 else []))  # fmt: skip
    muon = lambda run, steps: cfg_for(run, *TP2_DP2_ZERO1, "optim.name=muon", f"train.steps={steps}",
                                      "parallel.nproc=4")  # fmt: skip
    launch(4, full, first, resumed, to_tp1, dp4, dp4_stage("reshard_zero3_zero1", 3),
           dp4_stage("reshard_zero3_tp", 3), dp4_stage("reshard_zero2_zero3", 2),
           muon("muon_full", 4), muon("muon_split", 2), muon("muon_split", 4),
           *(reshard_target(cfg_for, s, t) for s, t in RESHARDS if "parallel.nproc=4" in t))  # fmt: skip
    return {"adamw": (full.run_dir, resumed.run_dir), "muon": (muon("muon_full", 4).run_dir,
                                                               muon("muon_split", 4).run_dir)}  # fmt: skip


@pytest.mark.parametrize("rule", ["adamw", "muon"])
def test_tp2_dp2_zero1_resume_is_bit_exact(world4_runs, rule):
    """Muon's momentum buffers, like AdamW's moments, are saved per parameter from the owned slices."""
    full, resumed = world4_runs[rule]
    assert [(r["step"], r["layout"]["tp"], r["layout"]["dp"]) for r in resumed_from(resumed)] == [(2, 2, 2)]
    assert losses(resumed) == losses(full)
    assert max_param_diff(read_final_model(resumed), read_final_model(full)) == 0.0
    saved = read_dcp_metadata(Path(resumed) / "checkpoints/step_0000002").state_dict_metadata
    momentum = {k for k in saved if k.endswith(".momentum_buffer")}
    assert "optim.layers.0.attn.wq.weight.momentum_buffer" in momentum if rule == "muon" else not momentum
    assert "optim.tok_embeddings.weight.exp_avg" in saved  # the embedding stays with AdamW under either rule


RESHARDS = [  # (source run, target layout): each resumes 4 steps in the target layout from the source's step 2
    ("reshard_tp", ["train.micro_batch_size=8", "parallel.nproc=1"]),  # tp2 x dp2 ZeRO-1 -> 1 process
    ("reshard_dp", ["train.micro_batch_size=4", "optim.zero_stage=1", "parallel.nproc=2"]),  # dp4 -> dp2
    ("reshard_pp", ["train.micro_batch_size=8", "parallel.nproc=1"]),  # pp2 -> pp1
    # context parallelism: cp2 (ring, ZeRO-1) -> 1 process, 1 process -> cp2 (Ulysses)
    ("reshard_cp", ["train.micro_batch_size=8", "parallel.nproc=1"]),
    ("reshard_to_cp", ["parallel.cp=2", "parallel.cp_mode=ulysses", "train.micro_batch_size=8", "parallel.nproc=2"]),
    # across ZeRO stages: 3 dp4 -> 1 dp2, 3 dp4 -> 0 tp2, 2 dp4 -> 3 tp2 x dp2
    ("reshard_zero3_zero1", ["train.micro_batch_size=4", "optim.zero_stage=1", "parallel.nproc=2"]),
    ("reshard_zero3_tp", ["parallel.tp=2", "train.micro_batch_size=8", "parallel.nproc=2"]),
    ("reshard_zero2_zero3", ["optim.zero_stage=3", "parallel.tp=2", "train.micro_batch_size=4", "parallel.nproc=4"]),
]
# the sources world4_runs does not write: name -> (world size, overrides), 2 steps
RESHARD_SOURCES = {
    "reshard_pp": (2, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=2", "parallel.nproc=2"]),
    "reshard_cp": (2, ["parallel.cp=2", "optim.zero_stage=1", "train.micro_batch_size=8", "parallel.nproc=2"]),
    "reshard_to_cp": (1, ["train.micro_batch_size=8"]),
}


def reshard_target(cfg_for, source, target):
    return cfg_for(source, "train.steps=4", *target)


@pytest.fixture(scope="module")
def resharded(cfg_for, world4_runs):
    """The reshard rows' sources and targets, one launch per world size (world4_runs writes the 4-rank sources
    and runs the 4-rank target): the 1-rank sources, then the 2-rank sources and targets, then the 1-rank
    targets. The 2-rank launch also resumes a copy of reshard_dp's step 2 (dp4 x micro batch 2: a global batch
    of 8) at tp2 with micro batch 4 (dp1: 4) for a step; rank 0's output of that launch is returned."""
    sources = {w: [cfg_for(name, *o, "train.steps=2") for name, (world, o) in RESHARD_SOURCES.items() if world == w]
               for w in (1, 2)}  # fmt: skip
    targets = [reshard_target(cfg_for, source, target) for source, target in RESHARDS]
    halved = cfg_for("batch_halved", "parallel.tp=2", "train.micro_batch_size=4", "parallel.nproc=2", "train.steps=3")
    shutil.copytree(cfg_for("reshard_dp").checkpoint.dir, halved.checkpoint.dir)
    launch(1, *sources[1])
    out = Path(halved.run_dir).with_name("launch2.out")
    with stdout_into(out):
        launch(2, *sources[2], *(cfg for cfg in targets if cfg.parallel.nproc == 2), halved)
    launch(1, *(cfg for cfg in targets if cfg.parallel.nproc == 1))
    return out.read_text()


@pytest.mark.parametrize("source, target", RESHARDS)
def test_resharded_resume_continues_the_same_run(cfg_for, reference, resharded, source, target):
    cfg = reshard_target(cfg_for, source, target)
    (origin,) = resumed_from(cfg.run_dir)  # resumed from the other layout's step 2, not trained afresh
    saved_layout = {k: origin["layout"].get(k, 1) for k in ("tp", "pp", "cp", "dp")}
    p = cfg.parallel
    assert origin["step"] == 2
    assert saved_layout != {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.nproc // (p.tp * p.pp * p.cp)}
    assert losses(cfg.run_dir) == pytest.approx(losses(reference), abs=1e-5)
    assert max_param_diff(read_final_model(cfg.run_dir), read_final_model(reference)) <= 1e-5


def test_a_resume_at_another_global_batch_says_so(resharded):
    """Where a resume changes the global batch (tp2 at micro batch 4 halves reshard_dp's 8), one warning names
    both, the keys that give them and how to keep the checkpoint's; the reshards that keep it get none."""
    (warning,) = [line for line in resharded.splitlines() if "global batch changes" in line]
    old = "batch_halved/checkpoints/step_0000002: train.micro_batch_size x train.grad_accum x dp = 2 x 1 x 4"
    assert warning.startswith("warning: the global batch changes on resume, from 8 samples a step (checkpoint ")
    assert f"{old}) to 4 (4 x 1 x 1)" in warning
    assert "To keep 8, set train.grad_accum=2 (train.global_batch_size=8 then refuses" in warning


def train_args(run_dir, corpus, steps, extra=()) -> list[str]:
    return [*COMMON, f"data.train_path={corpus}", f"run_dir={run_dir}", f"train.steps={steps}",
            "train.micro_batch_size=4", "parallel.nproc=2", "logging.progress=lines", *extra]  # fmt: skip


def hpc_train_train(run_dir, corpus, steps, fault=None, extra=()):
    """`hpc-train train` of 2 ranks, meeting `fault` if given."""
    return run_cli("train", *train_args(run_dir, corpus, steps, extra), env={"HPC_TRAIN_FAULT": fault})


@pytest.fixture(scope="module")
def uninterrupted(killed_runs):
    """2 ranks, 6 steps, as `hpc-train train` runs it: the first run of the kill -9 matrix's resume launch."""
    return killed_runs[0] / "uninterrupted"


ASYNC = ["checkpoint.async_save=true"]
KILL_ROWS = [  # fault, extra, resumes from, latest after the kill, left behind by the kill
    ("mid_step@3", [], 2, 2, []),  # killed inside step 3: nothing of it was saved
    ("before_manifest@4", [], 2, 2, ["step_0000004.tmp"]),  # shards written, never committed
    ("before_latest@4", [], 4, 2, ["step_0000004"]),  # committed, `latest` not yet moved: still complete
    ("committed@4", [], 4, 4, ["step_0000004"]),  # committed, killed before step 4's metrics line
    # read every 4th step: step 3's line is written before the save, step 4's held in it
    ("committed@4", ["logging.log_interval=4"], 4, 4, ["step_0000004"]),
    ("staged@4", ASYNC, 2, 2, ["step_0000004.tmp"]),  # async: copied to host memory, nothing written
    ("mid_write@4", ASYNC, 2, 2, ["step_0000004.tmp"]),  # async: killed while writing in the background
    ("before_manifest@4", ASYNC, 2, 2, ["step_0000004.tmp"]),  # async: killed in the background commit
    ("committed@4", ASYNC, 4, 4, ["step_0000004"]),  # async: killed right after its background commit
]


@contextmanager
def stdout_into(path: Path) -> Iterator[None]:
    """The launcher's stdout, which its rank processes inherit, into `path` for the block."""
    with open(path, "w") as f, streams_to(f.fileno()):
        yield


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory, small_corpus):
    """Each row's run (2 ranks, the settings of `hpc_train_train`) killed at its point, each a launch of its
    own (the kill ends it), and what it left in its checkpoints; then, one after another in one launch of 2
    ranks, the uninterrupted run and every killed run resumed (6 steps), rank 0's output kept."""
    base = tmp_path_factory.mktemp("killed")
    crashes = []
    for row, (fault, extra, *_) in enumerate(KILL_ROWS):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HPC_TRAIN_FAULT", fault)
            try:
                launch(2, load_config(None, train_args(base / f"row{row}", small_corpus, 6, extra)))
                failed = False
            except ProcessException:  # a rank died (the launcher raises what the CLI exits with status 1 on)
                failed = True
        checkpoints = base / f"row{row}/checkpoints"
        crashes.append({"failed": failed, "names": {p.name for p in checkpoints.iterdir()},
                        "latest": (checkpoints / "latest").read_text().strip()})  # fmt: skip
    runs = [base / "uninterrupted", *(base / f"row{row}" for row in range(len(KILL_ROWS)))]
    with stdout_into(base / "resumed.out"):
        launch(2, *(load_config(None, train_args(run, small_corpus, 6)) for run in runs))
    return base, crashes, (base / "resumed.out").read_text()


@pytest.mark.parametrize("fault, extra, resumes_from, latest, left_behind", KILL_ROWS)
def test_kill_9_resumes_from_the_last_committed_checkpoint(killed_runs, uninterrupted, fault, extra, resumes_from,
                                                           latest, left_behind):  # fmt: skip
    """2 ranks; rank 0 is killed with SIGKILL at a point of the step, of the write or of the commit protocol
    (for an async save: in the training thread while staging, or in the background thread)."""
    base, crashes, resumed_out = killed_runs
    row = KILL_ROWS.index((fault, extra, resumes_from, latest, left_behind))
    run, crashed = base / f"row{row}", crashes[row]
    assert crashed["failed"]
    assert set(left_behind) <= crashed["names"] and "step_0000002" in crashed["names"]
    assert crashed["latest"] == f"step_{latest:07d}"
    assert f"resumed from {run}/checkpoints/step_{resumes_from:07d}" in resumed_out
    assert [r["step"] for r in resumed_from(run)] == [resumes_from]
    assert losses(run) == losses(uninterrupted)
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))


def test_killed_rank_restarts_in_the_job_on_the_same_loss_curve(tmp_path, uninterrupted, small_corpus):
    """parallel.max_restarts=1: rank 1 is killed inside step 5; the launcher restarts both ranks in the same
    run, they resume from step 4 and end on the uninterrupted run's losses; the time lost is logged."""
    out = hpc_train_train(tmp_path, small_corpus, 6, "mid_step@5@1", ["parallel.max_restarts=1"])
    assert out.returncode == 0, out.stderr
    assert "restarting every rank from the newest checkpoint (in-job restart 1 of parallel.max_restarts=1)" in (
        out.stderr)  # fmt: skip
    assert "in-job restart 1: training again" in out.stdout
    assert "trained after the checkpoint of step 4 are redone" in out.stdout
    assert [r["step"] for r in resumed_from(tmp_path)] == [4]
    (restart,) = [m["restart"] for m in read_metrics(tmp_path) if "restart" in m]
    assert restart["attempt"] == 1 and restart["restart_s"] > 0 and restart["redone_s"] > 0
    assert losses(tmp_path) == losses(uninterrupted)
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 7))


def test_memory_checkpoints_lose_at_most_the_step_a_rank_dies_in(tmp_path, uninterrupted, small_corpus):
    """checkpoint.memory_interval=1, saved in the background: rank 1 is killed with SIGKILL in step 4, after
    its copy of step 3 is kept; the in-job restart resumes both ranks from step 3 in memory (newer than the
    shared step 2) and ends on the uninterrupted run's losses. Every save blocked training for its small parts
    only; rank 0's background store is slowed (SLOW_S from step 2 on), and the next step's update waited for
    it; the run's copies are gone from host memory at its end."""
    memory = ["checkpoint.memory_interval=1", "parallel.max_restarts=1", *ASYNC]
    out = hpc_train_train(tmp_path, small_corpus, 6, "local_saved@3@1,local_saved@2@0@slow", memory)
    assert out.returncode == 0 and "resumed from the node-local checkpoints of step 3" in out.stdout, out.stderr
    assert [(r["step"], r["source"]) for r in resumed_from(tmp_path)] == [(3, "local")]
    assert losses(tmp_path) == losses(uninterrupted)
    records = read_metrics(tmp_path)
    assert [m["step"] for m in records] == list(range(1, 7))
    saves = [r["local_checkpoint"] for r in records]  # every step's, in the background; the one before's figures
    assert all(0 < save["blocked_s"] < save["local_s"] + 1e-3 for save in saves)
    done = [save["saved"] for save in saves if "saved" in save]
    assert [d["step"] for d in done] == [1, 2, 4, 5] and all(d["local_bytes"] > 0 for d in done)
    assert done[1]["wait_s"] > SLOW_S / 2, done  # step 3's update waited for step 2's slowed store
    cfg = load_config(None, train_args(tmp_path, small_corpus, 6, memory))
    assert not local_run_root(f"{MEMORY_DIR}/{node_name()}", cfg.name, cfg.checkpoint.dir).exists()


def test_a_restart_before_the_first_commit_and_a_kill_inside_a_prune_leave_one_clean_run(
    tmp_path, uninterrupted, small_corpus
):
    """A rank killed in step 2, before the first checkpoint: the restart trains from scratch, and the first
    start's records are gone from metrics.jsonl (they stayed: steps 1, 1, 2, ...); a run started from scratch
    over one that committed keeps its records in a file of their own. Rank 0 killed inside the
    prune after step 4's commit (keep_last=1: step 2 goes): no half-deleted checkpoint is left (the prune
    renames before it deletes), and the next prune deletes what the kill left. Both end on the uninterrupted
    run's losses."""
    restarts = ["parallel.max_restarts=1", "checkpoint.keep_last=1"]
    for run, fault in (("early", "mid_step@2@1"), ("pruning", "pruned@4@0")):
        out = hpc_train_train(tmp_path / run, small_corpus, 6, fault, restarts)
        assert out.returncode == 0 and "restarting every rank" in out.stderr, out.stderr
        assert [m["step"] for m in read_metrics(tmp_path / run)] == list(range(1, 7))
        assert losses(tmp_path / run) == losses(uninterrupted)
        assert sorted(p.name for p in (tmp_path / run / "checkpoints").iterdir()) == [".lock", "latest", "step_0000006"]
    assert [r["step"] for r in resumed_from(tmp_path / "pruning")] == [4]
    # from scratch over a run that committed (checkpoint.resume=false): its records are kept beside, not mixed
    again = hpc_train_train(tmp_path / "early", small_corpus, 6, None, ["checkpoint.resume=false"])
    (kept,) = (tmp_path / "early").glob("metrics.*.jsonl")
    assert f"training from scratch: the earlier records in metrics.jsonl are kept in {kept.name}" in again.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "early")] == list(range(1, 7))
    assert [json.loads(line)["step"] for line in kept.read_text().splitlines()] == list(range(1, 7))


def corrupt(step_dir, how):
    shard = next(step_dir.glob("__0_*.distcp"))
    if how == "truncated shard":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif how == "flipped bytes":
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "deleted .metadata":
        (step_dir / ".metadata").unlink()
    elif how == "deleted manifest":
        (step_dir / "manifest.json").unlink()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, small_corpus):
    run = tmp_path_factory.mktemp("saved") / "run"
    launch(2, load_config(None, train_args(run, small_corpus, 4)))  # checkpoints at steps 2 and 4
    return run


@pytest.mark.parametrize(
    "how, named",
    [
        ("truncated shard", "(truncated?)"),
        ("flipped bytes", "fails its xxh3_128 checksum"),
        ("deleted .metadata", "missing file .metadata"),
        ("deleted manifest", "missing manifest.json"),
    ],
)
def test_corrupted_checkpoint_is_named_and_skipped(saved_run, tmp_path, small_corpus, reference, how, named, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    corrupt(run / "checkpoints/step_0000004", how)
    reports = []
    chosen = CheckpointStore(run / "checkpoints").newest_valid(report=reports.append)
    assert chosen.step == 2
    assert len(reports) == 1 and "step_0000004" in reports[0] and named in reports[0]
    with pytest.raises(SystemExit) as verify:  # `hpc-train ckpt verify`, in this process
        main(["ckpt", "verify", str(run)])
    assert verify.value.code == 1 and named in capsys.readouterr().out
    with pytest.raises(SystemExit) as convert:  # `hpc-train ckpt convert --step 4`: refused, nothing written
        main(["ckpt", "convert", str(run), str(tmp_path / "out.pt"), "--to", "torch", "--step", "4"])
    assert convert.value.code == 2 and named in capsys.readouterr().err and not (tmp_path / "out.pt").exists()
    if how == "flipped bytes":  # and training really continues from step 2, as if nothing happened
        resumed = hpc_train_train(run, small_corpus, 4)
        assert "step_0000004 skipped: __0_" in resumed.stdout and "fails its xxh3_128" in resumed.stdout
        assert "(corrupted; found as it was read)" in resumed.stdout  # in the load's own pass, read whole
        assert [r["step"] for r in resumed_from(run)] == [2]
        assert losses(run) == losses(saved_run)


def test_stale_tmp_is_skipped_and_cleaned(saved_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    stale = run / "checkpoints/step_0000006.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    reports = []
    assert CheckpointStore(run / "checkpoints").newest_valid(report=reports.append).step == 4
    assert "step_0000006.tmp skipped: incomplete save" in reports[0]
    main(["ckpt", "list", str(run)])  # `hpc-train ckpt list`, in this process
    listing = capsys.readouterr().out
    assert "step_0000004" in listing and "(latest)" in listing and "UNUSABLE: incomplete save" in listing
    manifest = json.loads((run / "checkpoints/step_0000004/manifest.json").read_text())
    assert manifest["layout"]["dp"] == 2 and "rank00001.pt" in manifest["files"]
    older = run / "checkpoints/step_0000003.tmp"  # a leftover older than the newest commit goes at the next prune
    older.mkdir()
    assert CheckpointStore(run / "checkpoints").prune(keep_last=3, keep_every=0) == [older]
    assert stale.is_dir() and not older.exists()


def test_keep_last_and_keep_every(saved_run, tmp_path, small_corpus):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    launch(
        2, load_config(None, train_args(run, small_corpus, 12, ["checkpoint.keep_last=2", "checkpoint.keep_every=4"]))
    )
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_0000004", "step_0000008", "step_0000010", "step_0000012"]


class _Weights:  # a ShardedPart of one tensor
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w": torch.arange(4.0)}


def test_older_checkpoints_are_pruned_off_the_training_thread(tmp_path, monkeypatch):
    """keep_last=1, one process: a save returns once its checkpoint is committed, while the deletion of the
    one before (held here until the save has returned) is still going on, on another thread; waiting for it
    then finds the older checkpoint gone. A deletion on the training thread would wait out the hold and fail."""
    from hpc_train.checkpoint.checkpointer import Checkpointer
    from hpc_train.checkpoint.ownership import RunIdentity
    from hpc_train.launch.local import single_process_group

    trainer, release, seen = threading.current_thread(), threading.Event(), []
    prune = CheckpointStore.prune

    def held(store, *args):
        seen.append((threading.current_thread() is trainer, release.wait(timeout=10)))
        return prune(store, *args)

    monkeypatch.setattr(CheckpointStore, "prune", held)
    cfg = load_config(
        None, [*TINY_MODEL, f"run_dir={tmp_path}", "checkpoint.keep_last=1", "checkpoint.async_save=false"]
    )
    first = Path(cfg.checkpoint.dir) / "step_0000001"
    with single_process_group():
        checkpointer = Checkpointer(cfg.checkpoint, 2, RunIdentity(cfg), {}, {"weights": _Weights()}, {}, {},
                                    report=lambda message: None)  # fmt: skip
        checkpointer.claim()
        removed = []
        for step in (1, 2):
            release.clear()
            checkpointer.save(step)
            assert first.is_dir()  # committed, and (step 2) not yet deleted when the save returns
            release.set()
            removed.append(checkpointer.pruned()["removed"])
        checkpointer.release()
    assert seen == [(False, True), (False, True)] and removed == [[], ["step_0000001"]] and not first.exists()


def wait_for_step(run_dir, step, proc=None, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= step:
            return
        assert proc is None or proc.poll() is None, "training ended before the signal"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def test_sigterm_saves_asynchronously_and_resumes(tmp_path, small_corpus):
    """SIGTERM to the local launcher reaches both ranks: at the next log step (every 3rd) they finish the
    step, commit a checkpoint (written by an async save) and exit cleanly; the rerun resumes there and ends on
    the uninterrupted curve."""
    args = [*COMMON, f"data.train_path={small_corpus}", "train.steps=400", "train.micro_batch_size=4",
            "parallel.nproc=2", "checkpoint.interval=0", "checkpoint.async_save=true",
            "logging.progress=lines", "logging.log_interval=3"]  # fmt: skip
    cmd = [sys.executable, "-m", "hpc_train.cli", "train", *args]
    proc = subprocess.Popen([*cmd, f"run_dir={tmp_path / 'run'}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    stopped_at = len(read_metrics(tmp_path / "run"))
    assert stopped_at < 400 and f"checkpoint of step {stopped_at} committed, stopping" in out
    assert stopped_at % 3 == 0  # the stop signal is agreed with the figures, once per log interval
    assert CheckpointStore(tmp_path / "run/checkpoints").newest_valid().step == stopped_at
    steps = f"train.steps={stopped_at + 3}"  # the same schedule: only how far it runs differs
    # the rerun and the uninterrupted run, one after the other in one launch of 2 ranks
    launch(2, *(load_config(None, [*args, f"run_dir={tmp_path / run}", steps, "optim.decay_steps=400"])
                for run in ("run", "uninterrupted")))  # fmt: skip
    assert [r["step"] for r in resumed_from(tmp_path / "run")] == [stopped_at]
    assert losses(tmp_path / "run") == losses(tmp_path / "uninterrupted")


def test_hung_rank_ends_the_job_with_an_error_naming_it(tmp_path, small_corpus):
    """Rank 1 hangs inside step 2: rank 0's collective times out, the error says which rank stopped where,
    and rank 0 writes its stacks, with where the collective was called from."""
    start = time.monotonic()
    out = hpc_train_train(tmp_path, small_corpus, 4, "mid_step@2@1@hang", ["parallel.timeout_s=5"])
    assert out.returncode != 0
    assert "rank 0: a collective timed out after parallel.timeout_s=5s" in out.stderr
    assert "rank 1 started step 2 (the others finished the backward pass of step 2)" in out.stderr
    stacks = (tmp_path / "hang/rank00000.txt").read_text()
    assert f"this rank's stacks in {tmp_path / 'hang/rank00000.txt'}" in out.stderr
    assert "rank 0: a collective timed out" in stacks and "hpc_train/train/step.py" in stacks, stacks
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(("release", "digest"), [("08c1275", "sha256"), ("1364ba4", "xxh3_128")])
def test_checkpoint_written_by_an_earlier_release_resumes_on_its_loss_curve(tmp_path, capfd, release, digest):
    """The checkpoints of 08c1275 (llama, dp2 ZeRO-1) and 1364ba4 (gpt2, tp2 + SP ZeRO-1), in
    tests/fixtures, still load, and training goes on exactly as that release itself went on from them; their
    layout (written before context parallelism, without cp) is the same layout, not a reshard."""
    fixture = ROOT / f"tests/fixtures/checkpoint_{release}"
    expected = json.loads((fixture / "expected.json").read_text())
    shutil.copytree(fixture / "step_0000002", tmp_path / "run/checkpoints/step_0000002")
    cfg = load_config(None, [*expected["overrides"], f"data.train_path={fixture / 'data'}", "train.steps=6",
                             f"run_dir={tmp_path / 'run'}"])  # fmt: skip
    launch_local(run_training, 2, cfg)
    out = capfd.readouterr().out
    assert "resumed from" in out and "resharded" not in out
    assert "has no content fingerprint (prepared before datasets recorded one" in out  # its counts decide
    metrics = read_metrics(tmp_path / "run")
    resumed = [m["resumed_from"] for m in metrics if "resumed_from" in m]
    assert [{"step": r["step"], "layout": r["layout"]} for r in resumed] == expected["resumed_from"]
    assert [m["step"] for m in metrics] == [3, 4, 5, 6]
    for m in metrics:
        assert m["loss"] == pytest.approx(expected["losses"][str(m["step"])], abs=1e-6), m["step"]
        assert m["grad_norm"] == pytest.approx(expected["grad_norms"][str(m["step"])], abs=1e-6), m["step"]
    checkpoints = CheckpointStore(tmp_path / "run/checkpoints")
    old, new = (checkpoints.verify(info) for info in checkpoints.scan()[-1::-2])  # step 2 (its release's), step 6
    assert old.problem is None and digest in old.manifest["files"][".metadata"]
    assert new.problem is None and "xxh3_128" in new.manifest["files"][".metadata"]


FROZEN = ("tok_embeddings.weight", "layers.1.attn_norm.weight")


def _frozen_checks(rank_env, cfg):
    """tp=2, ZeRO-1: frozen weights (set to values no init produces, as pretrained ones would be) are
    saved and restored bit-exact; they are never in the optimizer and never move while training."""
    cpu = torch.device("cpu")
    with distributed(rank_env, cpu, "gloo", 120):
        run = build_run(cfg, rank_env, cpu)
        params = dict(run.model.named_parameters)
        with torch.no_grad():
            for name in FROZEN:
                local(params[name]).mul_(3.0)  # the vocabulary padding rows stay zero
        frozen = {name: local(params[name]).clone() for name in FROZEN}
        assert not {id(params[n]) for n in FROZEN} & {id(p) for p in run.optimizer.params}
        batch = run.train_set.batch(run.sampler.next_micro_batches()[0])
        train_step(run.model, run.optimizer, [batch], 1e-3)
        assert all(torch.equal(local(params[n]), frozen[n]) for n in FROZEN)
        run.checkpointer.save(1)

        fresh = build_run(cfg, rank_env, cpu)  # initialized anew: the frozen weights are back at their init
        fresh_params = dict(fresh.model.named_parameters)
        assert not torch.equal(local(fresh_params[FROZEN[0]]), frozen[FROZEN[0]])
        assert fresh.checkpointer.resume().step == 1
        for name, value in frozen.items():
            assert torch.equal(local(fresh_params[name]), value), name
        for name, p in params.items():
            assert torch.equal(local(fresh_params[name]), local(p)), name

        # resumed with nothing frozen: the ZeRO masters of the weights that were frozen (no optimizer
        # state saved) take the loaded weights, not the new run's init; a save before any update holds
        # every parameter's state
        thawed = build_run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, freeze=[])), rank_env, cpu)
        assert thawed.checkpointer.resume().step == 1
        thawed_params = dict(thawed.model.named_parameters)
        names = {id(p): n for n, p in thawed_params.items()}
        states = thawed.optimizer.param_states()
        assert {names[id(p)] for p in thawed.optimizer.params} >= set(FROZEN)
        for p, state in zip(thawed.optimizer.params, states, strict=True):
            assert torch.equal(local(state["master"]), local(p)), names[id(p)]
            assert set(state) == {"master", "exp_avg", "exp_avg_sq"}, names[id(p)]
        thawed.checkpointer.save(2)
        dist.barrier()


def test_frozen_parameters_survive_save_and_resume_bit_exact(cfg_for):
    cfg = cfg_for("frozen", "parallel.tp=2", SP, "optim.zero_stage=1", "train.micro_batch_size=2",
                  f"train.freeze=[{FROZEN[0]}, {FROZEN[1]}]")  # fmt: skip
    launch_local(_frozen_checks, 2, cfg)


def _zero_async_save_checks(rank_env, cfg):
    """dp=2, ZeRO-1, async save: each parameter's state is sent to one dp rank, which writes it, so a rank
    holds about half the state for a save, not all of it; the save leaves its copy to the next step (not
    copied at the save), and what it commits is the state of its step although that next step changed it.
    A resume loads a rank's owned half only, not every parameter's whole state."""
    cpu = torch.device("cpu")
    with distributed(rank_env, cpu, "gloo", 120):
        run = build_run(cfg, rank_env, cpu)
        batch = lambda: [run.train_set.batch(run.sampler.next_micro_batches()[0])]
        train_step(run.model, run.optimizer, batch(), 1e-3)
        params = run.optimizer.params
        states = run.optimizer.param_states()
        written = [i for i, state in enumerate(states) if state]
        every = [None, None]
        dist.all_gather_object(every, written)
        assert sorted(every[0] + every[1]) == list(range(len(params)))  # each parameter's state written once
        total, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
        assert sum(params[i].numel() for i in written) <= total / 2 + largest
        assert all(set(states[i]) == {"master", "exp_avg", "exp_avg_sq"} for i in written)

        run.checkpointer.save(1)
        assert run.checkpointer.staging is not None  # copied while the next step trains
        train_step(run.model, run.optimizer, batch(), 1e-3, StepOptions(before_update=run.checkpointer.staged))
        run.checkpointer.wait()
        fresh = build_run(cfg, rank_env, cpu)
        part, loaded_into = fresh.checkpointer.sharded["optim"], []
        template = part.template
        part.template = lambda stored: loaded_into.append(template(stored)) or loaded_into[-1]
        assert fresh.checkpointer.resume().step == 1
        held = sum(getattr(t, "values", t).numel() for t in loaded_into[0].values())
        assert held == 3 * fresh.optimizer.master.numel()  # the owned masters and moments, no more
        loaded = fresh.optimizer.param_states()
        for i in written:
            assert all(torch.equal(loaded[i][k], states[i][k]) for k in states[i]), i
        dist.barrier()


def test_a_stager_torch_closed_after_its_copy_is_replaced():
    """torch 2.11's DefaultStager closes itself at the end of each copy (pytorch/pytorch#183413), and its next
    copy fails with `KeyError: <class 'type'>` (an async save's second save on the GPU machine's torch): an
    async save takes a new stager where the last one was closed, and keeps an open one."""
    stager, state = host_stager(), {"w": torch.arange(4.0)}
    assert open_stager(stager) is stager and torch.equal(stager.stage(state).result()["w"], state["w"])
    stager._state_dict_stager.close()  # as torch 2.11's DefaultStager._stage does after each copy
    with pytest.raises(KeyError, match="<class 'type'>"):
        stager.stage(state).result()
    fresh = open_stager(stager)
    assert fresh is not stager and torch.equal(fresh.stage(state).result()["w"], state["w"])


@pytest.mark.parametrize("records", ["raw", "torch.save"])
def test_a_flat_range_of_a_stored_tensor_is_read_alone(tmp_path, monkeypatch, records):
    """What ZeRO-1/2 resume of a parameter's state on a rank: its owned range of the flattened elements (a
    partial row, whole rows, a partial row), straight from the file into one buffer, and no other byte of
    it; at a tp shard's offsets, with the vocabulary's padding rows (never stored) left zero. From RAW
    records (what hpc_train writes: the tensors' bytes and nothing else) and from torch.save records
    (what it wrote before); from RAW records also a box across rows and a change of dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from hpc_train.checkpoint import dcp_io
    from hpc_train.checkpoint.safe_load import RAW
    from hpc_train.checkpoint.slices import FlatSlice, SliceLoadPlanner, flat_boxes, flat_slice

    stored = torch.arange(6 * 5 * 4, dtype=torch.float32).view(6, 5, 4)
    state = {"w": stored, "b": torch.ones(3, dtype=torch.bfloat16)}
    if records == "raw":
        writer = dcp_io.ChecksummedWriter(tmp_path, 2, 0, 0)
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert {info.transform_descriptors[0] for info in read_dcp_metadata(tmp_path).storage_data.values()} == {RAW}
        shards = {name: record["size"] for name, record in writer.records.items() if name.endswith(".distcp")}
        assert sorted(shards.values()) == [3 * 2, 6 * 5 * 4 * 4]  # two threads, one tensor's bytes each
        with pytest.raises(dcp.api.CheckpointException, match="Unknown extension name='hpc_train.raw'"):  # stock DCP
            dcp.load({"w": torch.empty(6, 5, 4)}, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    else:
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    read, read_exactly = [], dcp_io._read_exactly

    def counted(f, view, name):
        read.append(len(view))
        read_exactly(f, view, name)

    def load(state, slices):
        dcp.load(state, storage_reader=dcp_io.ParallelReader(tmp_path, 2), planner=SliceLoadPlanner(slices),
                 no_dist=True)  # fmt: skip

    monkeypatch.setattr(dcp_io, "_read_exactly", counted)
    assert [sizes for _, sizes, _ in flat_boxes(stored.shape, 13, 70)] == [(1, 1, 3), (1, 1, 4), (3, 5, 4), (1, 1, 3)]
    owned = flat_slice(stored.shape, 13, 70, (0, 0, 0), None)
    sharded = flat_slice((4, 5, 4), 30, 50, (4, 0, 0), 6)  # rows 4-7 of 8, the last two padding
    load({}, {"w": owned})
    assert torch.equal(owned.values, stored.reshape(-1)[13:83]) and sum(read) == 70 * 4
    read.clear()
    load({}, {"w": sharded})
    assert torch.equal(sharded.values, torch.cat([stored.reshape(-1)[110:], torch.zeros(40)])) and sum(read) == 40
    if records == "raw":
        columns = FlatSlice(
            torch.empty(6 * 2 * 4), [(ChunkStorageMetadata(torch.Size((0, 1, 0)), torch.Size((6, 2, 4))), 0)]
        )
        converted = {"w": torch.empty(6, 5, 4, dtype=torch.bfloat16), "b": torch.empty(3)}
        load(converted, {})
        assert torch.equal(converted["w"], stored.bfloat16()) and torch.equal(converted["b"], torch.ones(3))
        load({}, {"w": columns})
        assert torch.equal(columns.values.view(6, 2, 4), stored[:, 1:3])

        def checked(state, slices):  # a resume's read: every file's checksum checked once, in the same pass
            reader = dcp_io.ParallelReader(tmp_path, 2, writer.records)
            dcp.load(state, storage_reader=reader, planner=SliceLoadPlanner(slices), no_dist=True)
            return reader.checks

        whole = checked({"w": torch.empty(6, 5, 4), "b": torch.empty(3, dtype=torch.bfloat16)}, {})
        assert whole.verified == set(writer.records) and whole.loaded == sum(shards.values())
        assert whole.checked == writer.records[".metadata"]["size"]  # the shards hashed as read
        part = checked({}, {"w": flat_slice(stored.shape, 13, 70, (0, 0, 0), None)})
        assert part.verified == set(writer.records) and part.loaded == 70 * 4  # a range: every file checked alone
        assert part.checked == sum(record["size"] for record in writer.records.values())
        name = next(n for n, size in shards.items() if size > 6)
        flipped = bytearray((tmp_path / name).read_bytes())
        flipped[100] ^= 1
        (tmp_path / name).write_bytes(flipped)
        assert "fails its xxh3_128 checksum (corrupted; found as it was read)" in checked({"w": torch.empty(6, 5, 4)},
                                                                                        {}).problem  # fmt: skip


def test_zero_async_save_sends_each_state_to_one_writer_and_overlaps_its_copy(cfg_for):
    cfg = cfg_for("zero_async", "optim.zero_stage=1", "parallel.nproc=2", "train.micro_batch_size=2",
                  "optim.bucket_mb=0.05", *ASYNC)  # fmt: skip
    launch_local(_zero_async_save_checks, 2, cfg)


def _rewrite_manifest(step_dir, edit):
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _rehash(step_dir, name):
    """What an attacker does after replacing a file: the manifest is unsigned, so it is updated to match."""
    from hpc_train.checkpoint.integrity import file_digest

    record = {"size": (step_dir / name).stat().st_size, "xxh3_128": file_digest(step_dir / name, "xxh3_128")}
    _rewrite_manifest(step_dir, lambda m: m["files"].__setitem__(name, record))


def _plant(step_dir, how, marker):
    """A checkpoint made unusable in one way; `marker` is the file a payload would create."""
    import pickle

    from hpc_train.checkpoint.safe_load import _MetadataUnpickler
    from tests.test_hardening import Payload

    manifest = json.loads((step_dir / "manifest.json").read_text())
    if how == "payload in a rank file":
        torch.save({"format": 3, "step": 4, "rng": Payload(marker)}, step_dir / "rank00001.pt")
        _rehash(step_dir, "rank00001.pt")
    elif how in ("payload in .metadata", "bytes entry in .metadata", "shard outside the checkpoint"):
        if how == "payload in .metadata":
            data = pickle.dumps(Payload(marker))
        else:
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            metadata = _MetadataUnpickler(open(step_dir / ".metadata", "rb")).load()
            key = next(iter(metadata.state_dict_metadata))
            if how == "bytes entry in .metadata":
                metadata.state_dict_metadata[key] = BytesStorageMetadata()
            else:
                next(iter(metadata.storage_data.values())).relative_path = "../../step_0000002/__0_0.distcp"
            data = pickle.dumps(metadata)
        (step_dir / ".metadata").write_bytes(data)
        _rehash(step_dir, ".metadata")
    elif how == "unlisted file":
        (step_dir / "extra.distcp").write_bytes(b"x")
    elif how in ("name with ..", "absolute name"):
        name = "../step_0000002/__0_0.distcp" if how == "name with .." else "/etc/hostname"
        _rewrite_manifest(step_dir, lambda m: m["files"].__setitem__(name, {"size": 1, "sha256": "0" * 64}))
    elif how == "symbolic link":
        (step_dir / "rank00001.pt").unlink()
        (step_dir / "rank00001.pt").symlink_to(step_dir.parent / "step_0000002/rank00001.pt")
    elif how == "non-UTF-8 manifest":
        (step_dir / "manifest.json").write_bytes(b"\xff\xfe{")
    elif how == "manifest without files":
        _rewrite_manifest(step_dir, lambda m: m.pop("files"))
    elif how == "manifest with a string size":
        _rewrite_manifest(step_dir, lambda m: m["files"][".metadata"].__setitem__("size", "12"))
    elif how == "manifest of another step":
        _rewrite_manifest(step_dir, lambda m: m.__setitem__("step", 99))
    elif how == "manifest is a list":
        (step_dir / "manifest.json").write_text(json.dumps([manifest]))
    assert manifest


@pytest.mark.parametrize(
    "how, named",
    [
        ("payload in a rank file", "holds something other than tensors and plain values, refused"),
        ("payload in .metadata", "refused to load posix.system"),
        ("bytes entry in .metadata", "refused to load torch.distributed.checkpoint.metadata.BytesStorageMetadata"),
        ("shard outside the checkpoint", "which is not a shard file of this checkpoint"),
        ("unlisted file", "holds files its manifest does not list: extra.distcp"),
        ("name with ..", "is not a plain name inside the checkpoint"),
        ("absolute name", "'/etc/hostname' is not a plain name"),
        ("symbolic link", "rank00001.pt is a symbolic link"),
        ("non-UTF-8 manifest", "unreadable manifest.json"),
        ("manifest without files", "malformed manifest.json: 'files' missing"),
        ("manifest with a string size", "the record of .metadata needs an integer size"),
        ("manifest of another step", "manifest.json is of step 99, not 4"),
        ("manifest is a list", "malformed manifest.json: not an object"),
    ],
)
def test_unsafe_or_malformed_checkpoint_is_named_and_skipped(saved_run, tmp_path, how, named, capsys):
    """Verification is closed and runs nothing: each problem is named, the checkpoint skipped for the
    previous good one, and no payload runs (also not in `ckpt verify` / `ckpt inspect`)."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_run, run)
    _plant(run / "checkpoints/step_0000004", how, marker)
    reports = []
    assert CheckpointStore(run / "checkpoints").newest_valid(report=reports.append).step == 2
    assert len(reports) == 1 and "step_0000004 skipped" in reports[0] and named in reports[0], reports
    with pytest.raises(SystemExit) as verify:
        main(["ckpt", "verify", str(run)])
    main(["ckpt", "inspect", str(run)])
    out = capsys.readouterr().out
    assert verify.value.code == 1 and named in out and "step_0000002 (step 2" in out  # inspect: the newest usable
    assert not marker.exists()


@pytest.mark.parametrize("how", ["file named like a step", "symlink named like a step"])
def test_step_entries_that_are_not_directories_are_skipped(saved_run, tmp_path, how):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    entry = run / "checkpoints/step_0000009"
    if how == "file named like a step":
        entry.write_text("junk")
    else:
        entry.symlink_to(run / "checkpoints/step_0000004")
    reports = []
    assert CheckpointStore(run / "checkpoints").newest_valid(report=reports.append).step == 4
    assert "step_0000009 skipped: not a directory" in reports[0]
    assert CheckpointStore(run / "checkpoints").prune(1, 0) == [run / "checkpoints/step_0000002"]
    assert entry.is_symlink() or entry.is_file()  # never deleted through


def test_convert_writes_files_that_stock_torch_dcp_and_safetensors_read(saved_run, tmp_path, capsys):
    """`hpc-train ckpt convert` of a dp2 run's newest checkpoint, read back with stock functions alone: a
    torch.save file (`torch.load(weights_only=True)`), a safetensors file (`load_file`, the step and version
    in its metadata) and a DCP directory (stock `dcp.load`, `dcp_to_torch_save`), every tensor equal, in
    dtype too, to what our reader loads from the checkpoint, the model's to the run's final weights. Stock
    `dcp.load` still refuses the checkpoint itself (its RAW records): the outputs are rewritten, not copied.
    `--step` picks another; an existing OUT is refused by name and left as it was."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TensorMeta

    import hpc_train
    from hpc_train.checkpoint.dcp_io import ParallelReader
    from hpc_train.checkpoint.export import chosen_checkpoint, convert

    def empty_like_stored(metadata):  # DCP's entries of tensors (not the step, a bytes entry of the stock one)
        stored = metadata.state_dict_metadata.items()
        return {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored if isinstance(m, TensorMeta)}

    original = saved_run / "checkpoints/step_0000004"
    with pytest.raises(dcp.api.CheckpointException, match="Unknown extension name='hpc_train.raw'"):
        dcp.load(empty_like_stored(read_dcp_metadata(original)), checkpoint_id=original, no_dist=True)
    with pytest.raises(dcp.api.CheckpointException, match="Unknown extension name='hpc_train.raw'"):
        dcp_to_torch_save(original, tmp_path / "refused.pt")  # so the docs say: convert first
    ours = empty_like_stored(read_dcp_metadata(original))
    dcp.load(ours, storage_reader=ParallelReader(original, 2), no_dist=True)
    final = read_final_model(saved_run)
    assert {f"model.{k}" for k in final} <= ours.keys() and any(k.startswith("optim.") for k in ours)
    for key, t in final.items():  # the vocabulary's tensors are stored without their padding rows
        assert torch.equal(ours[f"model.{key}"], t[: len(ours[f"model.{key}"])] if t.dim() else t), key

    def assert_as_ours(loaded):
        assert loaded.keys() == ours.keys()
        for key, t in ours.items():
            assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key

    info = chosen_checkpoint(saved_run)  # the newest, verified
    assert convert(info, tmp_path / "state.pt", "torch").tensors == len(ours)
    whole = torch.load(tmp_path / "state.pt", weights_only=True)
    assert whole.pop("step") == 4
    assert_as_ours(whole)
    convert(info, tmp_path / "state.safetensors", "safetensors")
    assert_as_ours(load_file(tmp_path / "state.safetensors"))
    with safe_open(tmp_path / "state.safetensors", "pt") as f:
        assert f.metadata()["step"] == "4" and f.metadata()["hpc_train_version"] == hpc_train.__version__
    main(["ckpt", "convert", str(saved_run), str(tmp_path / "dcp"), "--to", "dcp"])
    assert f"wrote {tmp_path / 'dcp'} (dcp, step 4 of {original}): {len(ours)} tensors" in capsys.readouterr().out
    stock = {**empty_like_stored(dcp.FileSystemReader(tmp_path / "dcp").read_metadata()), "step": 0}
    dcp.load(stock, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert stock.pop("step") == 4
    assert_as_ours(stock)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "from_dcp.pt")
    from_dcp = torch.load(tmp_path / "from_dcp.pt", weights_only=True)
    assert from_dcp.pop("step") == 4
    assert_as_ours(from_dcp)

    convert(chosen_checkpoint(saved_run, step=2), tmp_path / "step2.pt", "torch")
    assert torch.load(tmp_path / "step2.pt", weights_only=True)["step"] == 2
    before = (tmp_path / "state.pt").read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(["ckpt", "convert", str(saved_run), str(tmp_path / "state.pt"), "--to", "torch"])
    assert refused.value.code == 2 and f"{tmp_path / 'state.pt'} already exists" in capsys.readouterr().err
    assert (tmp_path / "state.pt").read_bytes() == before
    written = ["dcp", "from_dcp.pt", "state.pt", "state.safetensors", "step2.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == written  # no temporary file left


def test_payload_in_a_shard_is_refused_on_resume(saved_run, tmp_path, small_corpus):
    """A shard's bytes replaced by a pickle payload, its records marked torch.save records as before RAW (those
    are read with weights_only=True): resume stops with a message naming the checkpoint, and nothing runs."""
    import pickle

    from tests.test_hardening import Payload

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_run, run)
    step_dir = run / "checkpoints/step_0000004"
    shard = next(step_dir.glob("__0_*.distcp"))
    shard.write_bytes(pickle.dumps(Payload(marker)).ljust(shard.stat().st_size, b"\0"))
    metadata = read_dcp_metadata(step_dir)
    for info in metadata.storage_data.values():
        info.transform_descriptors = None
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    for name in (shard.name, ".metadata"):
        _rehash(step_dir, name)
    out = hpc_train_train(run, small_corpus, 6)
    assert out.returncode == 2 and not marker.exists()
    assert f"loading checkpoint {step_dir} failed" in out.stderr and "Traceback" not in out.stderr


def test_another_model_or_data_is_refused_and_nothing_is_touched(saved_run, tmp_path, small_corpus):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    bigger = hpc_train_train(run, small_corpus, 6, extra=["model.n_layers=4"])  # refused before any rank starts
    assert bigger.returncode == 2 and "model.n_layers: 2 in the checkpoint, 4 here" in bigger.stderr, bigger.stderr
    other_data = tmp_path / "other"
    from hpc_train.data.prepare import prepare_data, stdlib_sources

    prepare_data(stdlib_sources()[40:60], str(other_data), progress=False)
    moved = hpc_train_train(run, other_data, 6)  # refused by the ranks, which know the data's size
    assert moved.returncode != 0 and "training data: {'tokens'" in moved.stderr, moved.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_nonfinite_training_stops_and_keeps_the_finite_checkpoints(tmp_path, small_corpus):
    """An absurd learning rate: step 1 is finite and saved, step 2 is not; the run stops naming the step, no
    non-finite state is committed and nothing good is pruned (keep_last=1)."""
    diverge = ["optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0", "optim.grad_clip=0",
               "checkpoint.interval=1", "checkpoint.keep_last=1"]  # fmt: skip
    out = hpc_train_train(tmp_path, small_corpus, 6, extra=[*diverge, "parallel.max_restarts=1"])
    assert out.returncode == 2 and "step 2: the gradient norm is nan; stopping" in out.stderr, out.stderr
    assert "in-job restart" not in out.stderr  # it would stop again: not restarted
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step")) == ["step_0000001"]
    skipping = hpc_train_train(tmp_path / "skip", small_corpus, 6, extra=[*diverge, "train.skip_nonfinite=2"])
    assert "step 2: the gradient norm is nan; step skipped (1 of train.skip_nonfinite=2)" in skipping.stdout
    assert "step 4: the gradient norm is nan; stopping" in skipping.stderr


# tp2_zero1: dp 1, where ZeRO-1 saves its live masters, DTensors of views into one flat buffer
ZERO = {"dp": [], "zero1": ["optim.zero_stage=1"], "tp2_zero1": ["optim.zero_stage=1", "parallel.tp=2"]}


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory, small_corpus):
    """For dp, ZeRO-1 and tp2 x ZeRO-1 (2 ranks, the settings of `hpc_train_train`): 4 steps saving
    asynchronously, in one launch; then a run resumed (saving synchronously) from a copy of each one's step-2
    checkpoint, in another."""
    base = tmp_path_factory.mktemp("async")
    with stdout_into(base / "async.out"):
        launch(2, *(load_config(None, train_args(base / name / "run", small_corpus, 4, [*ASYNC, *zero]))
                    for name, zero in ZERO.items()))  # fmt: skip
    for name in ZERO:
        shutil.copytree(base / name / "run/checkpoints/step_0000002", base / name / "resumed/checkpoints/step_0000002")
    with stdout_into(base / "resumed.out"):  # checkpoint.async_save=auto
        launch(2, *(load_config(None, train_args(base / name / "resumed", small_corpus, 4, zero))
                    for name, zero in ZERO.items()))  # fmt: skip
    return base


@pytest.mark.parametrize("zero", list(ZERO))
def test_async_save_in_flight_resumes_bit_exact(async_runs, zero):
    """Step 2's checkpoint is copied and written in the background while step 3 trains (and changes the
    weights; ZeRO's state, sent to its writers at the save, is copied then too); a run resumed from it
    (saving synchronously)
    retraces steps 3 and 4 exactly."""
    tmp_path = async_runs / zero
    assert [r["step"] for r in resumed_from(tmp_path / "resumed")] == [2]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "run")[2:]
    # what each save cost, on the record of the step that started it; the background commit's figures on
    # the record of the step it finished during (the last one, waited for, on its own step's record)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "checkpoint" in r] == [2, 4]
    assert all(r["checkpoint"]["blocked_s"] > 0 for r in records if "checkpoint" in r)
    committed = [r["checkpoint_committed"] for r in records if "checkpoint_committed" in r]
    assert [c["step"] for c in committed] == [2] and committed[0]["total_bytes"] > committed[0]["bytes"] > 0
    last = records[-1]["checkpoint"]
    assert last["step"] == 4 and last["blocked_s"] > 0 and last["write_s"] > 0 and last["commit_s"] > 0
    sync = read_metrics(tmp_path / "resumed")[-1]["checkpoint"]
    assert sync["write_s"] > 0 and sync["gb_per_s"] > 0
    # the start-up log warns where the background work finds no idle core (2 ranks x (1 + 1 thread) on CI's 2);
    # auto saves in the background where each rank has a core free for it, or a GPU computes, and says so
    forced, out = choose_async(True, 2, 1, node_cores(), False), (async_runs / "async.out").read_text()
    assert forced[0] and ((forced[1] in out) if forced[1] else "checkpoint.async_save:" not in out)
    assert choose_async(True, 1, 1, 2, False) == (True, None)
    assert "= 4 threads on 2 cores" in choose_async(True, 2, 1, 2, False)[1]
    background, note = choose_async(None, 2, 1, node_cores(), False)
    assert note.startswith("checkpoint.async_save=auto: saving ") and note in (async_runs / "resumed.out").read_text()
    assert background == (node_cores() >= 4)
    assert [choose_async(None, *layout)[0] for layout in ((1, 1, 2, False), (2, 1, 2, False), (8, 1, 2, True))] == [
        True, False, True]  # fmt: skip
    # where the save's time went: DCP's planning and data write within the write, the writer threads' time
    # in writes, hashing and fsync (thread-seconds), gathering the state within what training waited
    assert min(sync[k] for k in ("plan_s", "data_s", "io_s", "hash_s", "fsync_s", "state_s")) > 0
    assert sync["plan_s"] + sync["data_s"] <= sync["write_s"] and sync["state_s"] + sync["write_s"] <= sync["blocked_s"]
    assert sync["total_bytes"] == pytest.approx(committed[0]["total_bytes"], rel=0.01)  # the same state


def test_full_disk_names_the_path_and_the_reason(tmp_path, small_corpus):
    """A checkpoint.dir on a 300 KB file system: the save fails on every rank with the OS's reason."""
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(full)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        out = hpc_train_train(tmp_path / "run", small_corpus, 2, extra=[f"checkpoint.dir={full}/ck"])
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"saving checkpoint of step 2 into {full}/ck/step_0000002.tmp failed" in out.stderr
    assert "No space left on device" in out.stderr
