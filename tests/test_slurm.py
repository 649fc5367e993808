"""The Slurm path against the real local cluster (slurm/local-cluster.sh; `make test` starts it).
Real sbatch, real srun, real accounting: no mocks. In CI a missing cluster fails these tests."""

import json
import os
import subprocess
import sys
import time

import pytest

from hpc_train.cli import main
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, TINY_MODEL, read_metrics


def cluster_nodes_idle() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    states = out.stdout.split()
    return out.returncode == 0 and len(states) >= 2 and all(s.startswith(("idle", "mix", "alloc")) for s in states)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if not cluster_nodes_idle():
        message = "the local Slurm cluster is not running: `make test` starts it (slurm/local-cluster.sh start)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def job_count() -> int:
    out = subprocess.run(["sacct", "-a", "-n", "-X", "-S", "now-1days", "-o", "JobID"], capture_output=True, text=True)
    return len(out.stdout.split())


def hpc_train(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_train.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


TWO_BY_TWO = ["slurm.nodes=2", "slurm.tasks_per_node=2"]


def test_dry_run_prints_the_job_and_submits_nothing(capsys, tmp_path):
    before = job_count()
    main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, "slurm.partition=debug", "slurm.time=0-02:30:00",
          "slurm.account=proj", "slurm.extra={mail-type: END}", "slurm.setup=[module load cuda]",
          f"run_dir={tmp_path}", "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    expected = [
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=debug", "#SBATCH --time=150",
        "#SBATCH --account=proj", "#SBATCH --signal=USR2@120", "#SBATCH --mail-type=END", "module load cuda",
        "--kill-on-bad-exit=1", "4 ranks as (pp=1, dp=4, tp=1)", "-m submitit.core._submit", "# ---- resolved config",
    ]  # fmt: skip
    for line in expected:
        assert line in out, line
    assert "srun --unbuffered" in out
    assert job_count() == before and not (tmp_path / "slurm").exists()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=4", "slurm.nodes=3", "slurm.tasks_per_node=1"], "world size 3 is not divisible by tp x pp"),
        (["parallel.dp=3"], "parallel.dp=3 but world size 4"),
        (["slurm.gpus_per_node=4"], "slurm.gpus_per_node=4 but slurm.tasks_per_node=2"),
        (["slurm.time=2h"], "slurm.time='2h' is not a Slurm time limit"),
        (["parallel.pp=2"], "train.grad_accum=1 gives 1 micro-batches"),
        (["data.train_path=/nonexistent/x"], "/nonexistent/x.bin' does not exist"),
    ],
)
def test_invalid_submissions_are_refused_before_sbatch(capsys, overrides, expected):
    before = job_count()
    with pytest.raises(SystemExit) as exit_info:
        main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, *overrides])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err
    assert job_count() == before


def test_two_node_job_matches_local_launcher(make_cfg, tmp_path):
    """2 nodes x 2 tasks, dp=4: the same losses as the local launcher's 4 processes, every rank in its place."""
    common = [*TINY_MODEL, "train.steps=3", "train.micro_batch_size=2", f"data.train_path={make_cfg().data.train_path}"]
    local = make_cfg("train.steps=3", "train.micro_batch_size=2", "parallel.nproc=4", run="local")
    launch_local(run_training, 4, local)
    start = time.monotonic()
    job = hpc_train("submit", *common, *TWO_BY_TWO, f"run_dir={tmp_path / 'slurm'}", "logging.progress=lines", "--wait")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "finished: COMPLETED" in job.stdout and "step 3 | loss" in job.stdout  # rank 0's progress, streamed
    losses = [m["loss"] for m in read_metrics(tmp_path / "slurm")]
    assert losses == [m["loss"] for m in read_metrics(local.run_dir)]
    layout = json.loads((tmp_path / "slurm" / "rank_layout.json").read_text())
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["node"], r["dp"], r["source"]) for r in layout] == [
        (0, 0, 0, "n1", 0, "slurm"),
        (1, 1, 0, "n1", 1, "slurm"),
        (2, 0, 1, "n2", 2, "slurm"),
        (3, 1, 1, "n2", 3, "slurm"),
    ]
    print(f"slurm job: {time.monotonic() - start:.1f}s")


def test_crashing_job_is_reported_failed_with_the_rank_error(make_cfg, tmp_path):
    """The data is found broken only on the node (truncated after its index was written)."""
    corpus = tmp_path / "broken"
    prepared = hpc_train("prepare-data", str(ROOT / "hpc_train/*.py"), "--output", str(corpus))
    assert prepared.returncode == 0, prepared.stderr
    os.truncate(f"{corpus}.bin", 100)
    start = time.monotonic()
    job = hpc_train("submit", *TINY_MODEL, *TWO_BY_TWO, f"data.train_path={corpus}", f"run_dir={tmp_path / 'run'}",
                    "train.steps=3", "--wait", timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert job.returncode == 1
    assert "finished: FAILED" in job.stdout
    assert "the dataset is truncated" in job.stderr and "rank " in job.stderr
    assert elapsed < 60, elapsed


def test_sbatch_template_runs_the_same_entry_point(make_cfg, tmp_path):
    cfg = make_cfg()
    env = {**os.environ, "HPC_TRAIN_PYTHON": sys.executable}
    out = subprocess.run(
        ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out",
         "slurm/train.sbatch", *TINY_MODEL, f"data.train_path={cfg.data.train_path}", f"run_dir={tmp_path / 'run'}",
         "train.steps=2", "logging.progress=lines"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(read_metrics(tmp_path / "run")) == 2
    log = next(tmp_path.glob("slurm-*.out")).read_text()
    assert "world 2 (pp 1, dp 2, tp 1)" in log and "step 2 | loss" in log


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-o", "State"], capture_output=True, text=True).stdout
    return out.split()[0] if out.split() else ""


def test_preempted_job_saves_requeues_and_resumes(make_cfg, tmp_path):
    """A running job gets Slurm's warning signal: every rank finishes its step, a checkpoint is committed,
    the job requeues itself, restarts, resumes from it and ends with the uninterrupted run's losses."""
    corpus = make_cfg().data.train_path
    common = [*TINY_MODEL, f"data.train_path={corpus}", "train.steps=150", "train.micro_batch_size=4"]
    run_dir = tmp_path / "preempted"
    submitted = hpc_train("submit", *common, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.time=00:30:00",
                          f"run_dir={run_dir}")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split("submitted job ")[1].split(":")[0]
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= 5):
        assert time.monotonic() < deadline and sacct_state(job_id) in ("PENDING", "RUNNING", ""), sacct_state(job_id)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    states = []
    while (state := sacct_state(job_id)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline + 60, states
        states.append(state)
        time.sleep(0.5)
    assert state == "COMPLETED", states
    (origin,) = [m["resumed_from"] for m in read_metrics(run_dir) if "resumed_from" in m]
    assert 5 <= origin["step"] < 150
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 151))
    log = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert "requeued job" in log and "resumed from" in log
    uninterrupted = make_cfg("train.steps=150", "train.micro_batch_size=4", "parallel.nproc=2", run="straight")
    launch_local(run_training, 2, uninterrupted)
    assert [m["loss"] for m in read_metrics(run_dir)] == [m["loss"] for m in read_metrics(uninterrupted.run_dir)]
