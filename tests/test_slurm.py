"""The Slurm path. The dry run and the refusals need no Slurm and always run; the jobs run against the
real local cluster (slurm/local-cluster.sh; `make test` starts it). Real sbatch, real srun, real
accounting: no mocks. In CI a missing cluster fails the tests that need it."""

import getpass
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from hpc_train.checkpoint.local import local_run_root
from hpc_train.cli import main
from hpc_train.config import MEMORY_DIR, check_values
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import load_config
from hpc_train.launch import queue, slurm
from hpc_train.launch.local import launch_local
from hpc_train.observe.metrics import last_step
from hpc_train.planner import stage_estimates
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, TINY_MODEL, read_metrics, run_cli, wandb_offline_runs


def job_count() -> int:
    """Jobs in accounting over the last day. Without accounting nothing could show that a refused submission
    reached Slurm, so the test does not pass: it is skipped (in CI, where the cluster runs, it fails)."""
    try:
        out = subprocess.run(["sacct", "-a", "-n", "-X", "-S", "now-1days", "-o", "JobID"], capture_output=True,
                             text=True, timeout=20)  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0:
        message = "Slurm accounting (sacct) does not answer: `make test` starts the local cluster"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return len(out.stdout.split())


TWO_BY_TWO = ["slurm.nodes=2", "slurm.tasks_per_node=2"]


def test_dry_run_prints_the_job_and_submits_nothing(capsys, tmp_path):
    before = job_count()
    main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, "slurm.partition=debug", "slurm.time=0-02:30:00",
          "slurm.account=root", "slurm.extra={mail-type: END}", "slurm.setup=[module load cuda]",
          f"run_dir={tmp_path}", "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    expected = [
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=debug", "#SBATCH --time=150",
        "#SBATCH --account=root", "#SBATCH --signal=USR2@120", "#SBATCH --mail-type=END", "module load cuda",
        "--kill-on-bad-exit=1", "4 ranks as (pp=1, dp=4, cp=1, tp=1)", "-m submitit.core._submit",
        "# ---- resolved config",
    ]  # fmt: skip
    for line in expected:
        assert line in out, line
    assert "srun --unbuffered" in out and f"#SBATCH --comment=hpc_train:{tmp_path}\n" in out  # the run's job
    assert job_count() == before and not (tmp_path / "slurm").exists()
    # submit and `train` here run configs/tiny.yaml with different world sizes: the dry run says so, and how
    main(["submit", "configs/tiny.yaml", f"run_dir={tmp_path}", "--dry-run"])
    assert capsys.readouterr().out.startswith(
        "# note: this job runs 1 rank(s) (slurm.nodes x slurm.tasks_per_node = 1 x 1), global batch 8; `hpc-train "
        "train` here would run parallel.nproc=2, global batch 16 (submit does not use parallel.nproc): set "
        "slurm.tasks_per_node=2 for the same run\n# hpc_train dry run"
    )
    main(["submit", "configs/tiny.yaml", "slurm.tasks_per_node=2", f"run_dir={tmp_path}", "--dry-run"])
    assert "# note" not in capsys.readouterr().out


def test_partition_limits_are_read_before_submitting(capsys):
    """The local cluster's partition `short` (n1 and n2, at most 1 node a job, 10 minutes, no GPUs), an
    account the user has no association with, and a partition that does not exist: each one line, nothing
    submitted (a job past a partition's limits would otherwise wait forever)."""
    before = job_count()
    for overrides in (["slurm.partition=short", "slurm.time=00:30:00", "slurm.gpus_per_node=2", "slurm.account=nosuch"],
                      ["slurm.partition=gpu"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, *overrides, "--dry-run"])
        assert exit_info.value.code == 2
    # the user's accounts (root's is root; a user with none has no account checked)
    assoc = ["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account"]
    accounts = subprocess.run(assoc, capture_output=True, text=True, check=True).stdout.split()
    account = [f"hpc-train: error: slurm.account=nosuch: not an account {getpass.getuser()} may charge; use one of "
               f"{', '.join(sorted(set(accounts)))} (sacctmgr show assoc user=$USER)"] if accounts else []  # fmt: skip
    assert capsys.readouterr().err.splitlines() == [
        "hpc-train: error: slurm.nodes=2 but partition short has 2 nodes, at most 1 a job: the job would wait "
        "forever; use slurm.nodes <= 1 (more slurm.tasks_per_node) or another partition",
        "hpc-train: error: slurm.time=00:30:00 exceeds partition short's limit of 00:10:00; use slurm.time <= "
        "00:10:00 (the job requeues itself at its time limit and resumes)",
        "hpc-train: error: slurm.gpus_per_node=2 but partition short's nodes have no GPUs; use "
        "slurm.gpus_per_node=0 (a CPU job) or a GPU partition",
        *account,
        "hpc-train: error: slurm.partition=gpu: no partition gpu on this cluster; use one of debug, short (sinfo "
        "lists them)",
    ]
    assert job_count() == before


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=4", "slurm.nodes=3", "slurm.tasks_per_node=1"], "world size 3 is not divisible by tp x pp"),
        (["parallel.dp=3"], "parallel.dp=3 but world size 4"),
        (["slurm.gpus_per_node=4"], "slurm.gpus_per_node=4 but slurm.tasks_per_node=2"),
        (["slurm.time=2h"], "slurm.time='2h' is not a Slurm time limit"),
        (["parallel.pp=2"], "train.grad_accum=1 gives 1 micro-batches"),
        (["data.train_path=/nonexistent/x"], "/nonexistent/x.bin' does not exist"),
        # the host memory of a node's ranks against the node's (8000 MB on the local cluster; sinfo says so): a
        # 1.6B model's cpu-offloaded AdamW state on GPUs' hosts, a tiny CPU job in what slurm.mem asks for
        (["model.d_model=4096", "model.n_layers=8", "model.n_heads=16", "optim.zero_stage=1", "optim.offload=cpu",
          "slurm.gpus_per_node=2"], "more than the 8000 MB a node has (sinfo, partition debug): use optim.offload="),
        (["slurm.mem=100M"], "MB each: the planner's host bytes, on a CPU job all a rank holds), more than the 100 MB "
                             "a node has (slurm.mem=100M)"),
    ],
)  # fmt: skip
def test_invalid_submissions_are_refused_before_sbatch(capsys, overrides, expected):
    before = job_count()
    with pytest.raises(SystemExit) as exit_info:
        main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, *overrides])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err
    assert job_count() == before


INJECTED = "x\\ntouch {marker}"  # YAML double-quoted: a real newline, then a shell command
# (override, the key its one problem line names): every config value that reaches the sbatch script
INJECTIONS = [
    (f'name="{INJECTED}"', "name="),
    (f'slurm.job_name="{INJECTED}"', "slurm.job_name="),
    (f'slurm.partition="{INJECTED}"', "slurm.partition="),
    (f'slurm.account="{INJECTED}"', "slurm.account="),
    (f'slurm.qos="{INJECTED}"', "slurm.qos="),
    (f'slurm.constraint="{INJECTED}"', "slurm.constraint="),
    (f'slurm.mem="{INJECTED}"', "slurm.mem="),
    (f'slurm.extra={{mail-type: "{INJECTED}"}}', "slurm.extra['mail-type']="),
    ('slurm.extra={"a b": END}', "slurm.extra key 'a b'"),
    ('slurm.extra={"x\\ny": END}', "slurm.extra key 'x\\ny'"),
    (f'slurm.log_dir="{INJECTED}"', "slurm.log_dir="),
    (f'run_dir="{INJECTED}"', "run_dir="),
    (f'slurm.setup=[module load cuda, "{INJECTED}"]', "slurm.setup[1]="),
]
OTHER_PROBLEMS = [
    ("slurm.partition='de bug'", "slurm.partition="),
    ('slurm.account="it\'s"', "slurm.account="),
    ("slurm.mem=lots", "slurm.mem="),
    ("slurm.log_dir=/tmp/logs-%j", "slurm.log_dir="),
    ("slurm.extra={array: 0-3}", "slurm.extra key 'array': an array's tasks would all run one run"),  # four copies
    ("slurm.extra={comment: x}", "slurm.extra key 'comment': hpc_train sets the job's comment"),
    ("slurm.cpus_per_task=0", "slurm.cpus_per_task="),
    ("slurm.signal_delay_s=3600", "slurm.signal_delay_s="),
]
BAD_FIELDS = INJECTIONS + OTHER_PROBLEMS


def injected(override: str, tmp_path) -> str:
    """The override with its shell command aimed at a file of this test (which must never appear)."""
    return override.replace("{marker}", str(tmp_path / "pwned"))


def refused_lines(capsys, overrides: list[str]) -> list[str]:
    """The error lines of a dry run that must be refused (exit code 2) before anything is written."""
    with pytest.raises(SystemExit) as exit_info:
        main(["submit", "configs/tiny.yaml", *TWO_BY_TWO, "slurm.time=01:00:00", *overrides, "--dry-run"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert all(line.startswith("hpc-train: error: ") for line in lines), lines
    return lines


@pytest.mark.parametrize("override, key", BAD_FIELDS, ids=[key for _, key in BAD_FIELDS])
def test_values_that_would_break_the_sbatch_script_are_refused(capsys, tmp_path, override, key):
    before = job_count()
    lines = refused_lines(capsys, [f"run_dir={tmp_path}", injected(override, tmp_path)])
    assert len(lines) == 1 and key in lines[0], lines
    assert job_count() == before and list(tmp_path.iterdir()) == []


def test_every_bad_value_is_reported_at_once(capsys, tmp_path):
    """One line per problem, so a user fixes them all in one go (name is not used once job_name is set)."""
    fields = [(o, k) for o, k in INJECTIONS[1:] if not o.startswith("slurm.extra")] + OTHER_PROBLEMS[-2:]
    extra = 'slurm.extra={mail-type: "x\\ny", "a b": END}'
    keys = [key for _, key in fields] + ["slurm.extra['mail-type']=", "slurm.extra key 'a b'"]
    lines = refused_lines(capsys, [*(injected(override, tmp_path) for override, _ in fields), extra])
    assert len(lines) == len(keys), lines
    for key in keys:
        assert sum(key in line for line in lines) == 1, key
    assert not (tmp_path / "pwned").exists()


def test_script_from_valid_fields_has_only_the_expected_lines(tmp_path):
    setup = ["module load cuda", "export NCCL_DEBUG=WARN"]
    cfg = load_config("configs/tiny.yaml", [
        "slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.gpus_per_node=2", "slurm.cpus_per_task=4",
        "slurm.mem=200G", "slurm.time=01:00:00", "slurm.partition=gpu", "slurm.account=proj-1",
        "slurm.qos=normal", "slurm.constraint=a100", "slurm.exclusive=true", "slurm.job_name=pretrain.v2",
        "slurm.extra={mail-type: END, mail-user: me@example.org}", f"slurm.setup={setup}",
        f"run_dir={tmp_path / 'with space'}",
    ])  # fmt: skip
    check_values(cfg)  # no field is refused
    logs = tmp_path / "with space" / "slurm"
    directives = [
        "account=proj-1", f"comment='hpc_train:{tmp_path / 'with space'}'", "constraint=a100", "cpus-per-task=4",
        f"error='{logs}/%j_0_log.err'", "exclusive",
        "gpus-per-node=2", "job-name=pretrain.v2", "mail-type=END", "mail-user=me@example.org", "mem=200G",
        "nodes=2", "ntasks-per-node=2", "open-mode=append", f"output='{logs}/%j_0_log.out'", "partition=gpu",
        "qos=normal", "signal=USR2@120", "time=60", "wckey=submitit",
    ]  # fmt: skip
    srun = shlex.join(["srun", "--unbuffered", "--output", f"{logs}/%j_%t_log.out", "--error",
                       f"{logs}/%j_%t_log.err", "--kill-on-bad-exit=1"])  # fmt: skip
    command = f"{srun} {shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(logs))}"
    fixed = {"#!/bin/bash", "", "# Parameters", "# setup", "# command", "export SUBMITIT_EXECUTOR=slurm"}
    lines = slurm.sbatch_script(cfg).splitlines()
    assert sorted(line for line in lines if line.startswith("#SBATCH")) == [f"#SBATCH --{d}" for d in directives]
    assert [line for line in lines if not line.startswith("#SBATCH") and line not in fixed] == [*setup, command]


def test_dry_run_needs_no_slurm(tmp_path):
    """No srun or sbatch on PATH (a laptop, a login node without Slurm): the dry run still prints the script."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    assert shutil.which("srun", path=str(empty_bin)) is None and shutil.which("sbatch", path=str(empty_bin)) is None
    run_dir = tmp_path / "run"
    out = run_cli("submit", "configs/tiny.yaml", *TWO_BY_TWO, f"run_dir={run_dir}", "--dry-run",
                  env={"PATH": str(empty_bin)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = load_config(ROOT / "configs/tiny.yaml", [*TWO_BY_TWO, f"run_dir={run_dir}"])
    assert f"of the job beside it) ----\n{slurm.sbatch_script(cfg)}\n" in out.stdout
    assert "#SBATCH --nodes=2" in out.stdout and "srun --unbuffered" in out.stdout
    assert not run_dir.exists()


def test_dry_run_script_is_the_one_submit_hands_to_sbatch(tmp_path, monkeypatch):
    """submitit's own executor (it wants srun on PATH: a stand-in is enough) writes the same script."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_bin))
    cfg = load_config("configs/tiny.yaml", [*TWO_BY_TWO, "slurm.setup=[module load cuda]", f"run_dir={tmp_path}"])
    executor = slurm.executor_for(cfg)
    assert type(executor).__name__ == "SlurmExecutor"
    script = executor._make_submission_file_text(executor._submitit_command_str, uid="x")
    assert slurm.sbatch_script(cfg) == script


@pytest.mark.usefixtures("cluster")
def test_two_node_job_matches_local_launcher(make_cfg, tmp_path, monkeypatch):
    """2 nodes x 2 tasks, dp=4: the same losses as the local launcher's 4 processes, every rank in its place.
    Rank 2 is late to record its progress after the last step, which at dp=4 needs no collective: rank 0,
    which serves the store, leaves only after it."""
    common = [*TINY_MODEL, "train.steps=3", "train.micro_batch_size=2", f"data.train_path={make_cfg().data.train_path}"]
    local = make_cfg("train.steps=3", "train.micro_batch_size=2", "parallel.nproc=4", run="local")
    launch_local(run_training, 4, local)
    monkeypatch.setenv("HPC_TRAIN_FAULT", "finished@3@2@late")  # sbatch passes the environment to the job
    start = time.monotonic()
    job = run_cli("submit", *common, *TWO_BY_TWO, f"run_dir={tmp_path / 'slurm'}", "logging.progress=lines", "--wait")
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


@pytest.mark.usefixtures("cluster")
def test_crashing_job_names_the_first_rank_to_fail(make_cfg, tmp_path, monkeypatch):
    """A failure only on the node (every input checked fine at submission): rank 3, on the second node, is
    killed outright inside step 2 (it leaves nothing in its own log), and the other ranks then fail on the
    lost connection. The error names rank 3, its node and the signal (srun's first report), not rank 0's
    connection error. Where ranks are supervised (parallel.max_restarts), the supervisors' agreed line does:
    test_killed_rank_restarts_inside_the_allocation."""
    monkeypatch.setenv("HPC_TRAIN_FAULT", "mid_step@2@3")  # sbatch passes the environment to the job
    start = time.monotonic()
    job = run_cli("submit", *TINY_MODEL, *TWO_BY_TWO, f"data.train_path={make_cfg().data.train_path}",
                  f"run_dir={tmp_path / 'run'}", "train.steps=3", "--wait")  # fmt: skip
    elapsed = time.monotonic() - start
    assert job.returncode == 1
    assert "finished: FAILED" in job.stdout
    job_id = job.stdout.split("submitted job ")[1].split(":")[0]
    assert job.stderr.startswith(
        f"the first rank to fail: rank 3 on n2 was killed by SIGKILL\nrank 3's stderr ({tmp_path}/run/slurm/"
        f"{job_id}_3_log.err):\n  (nothing: the process was killed from outside it)"
    ), job.stderr
    assert elapsed < 60, elapsed


@pytest.mark.usefixtures("cluster")
def test_sbatch_template_and_the_dry_runs_script_run_the_same_entry_point(make_cfg, tmp_path, capsys):
    """Two ways to call sbatch yourself, submitted side by side: slurm/train.sbatch on two nodes, and the
    script a dry run prints for doing so, from another directory, on one node with two tasks. (Their ends
    are read from accounting: `sbatch --wait` polls at growing intervals, up to half a minute late.)"""
    cfg = make_cfg()
    env = {**os.environ, "HPC_TRAIN_PYTHON": sys.executable}
    common = [*TINY_MODEL, f"data.train_path={cfg.data.train_path}", "train.steps=2", "logging.progress=lines"]
    template = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out",
         "slurm/train.sbatch", *common, f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, env=env, check=True,
    ).stdout.strip()  # fmt: skip
    main(["submit", "configs/tiny.yaml", *common, "slurm.tasks_per_node=2", f"run_dir={tmp_path / 'by_hand'}",
          "--dry-run"])  # fmt: skip
    printed = capsys.readouterr().out
    script = printed.split("`sbatch` it ----\n")[1].split("# ---- resolved config")[0]
    assert "#SBATCH --comment=hpc_train:" in script and "submitit" not in script
    (tmp_path / "by_hand" / "slurm").mkdir(parents=True)
    (tmp_path / "job.sbatch").write_text(script)
    by_hand = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job.sbatch")], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    deadline = time.monotonic() + 180
    while not all(sacct_state(job).startswith(("COMPLETED", "FAILED", "CANCELLED")) for job in (template, by_hand)):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert sacct_state(template) == sacct_state(by_hand) == "COMPLETED"
    for run, log in (("by_hand", tmp_path / "by_hand" / "slurm" / f"{by_hand}_0_log.out"),
                     ("run", tmp_path / f"slurm-{template}.out")):  # fmt: skip
        assert len(read_metrics(tmp_path / run)) == 2
        assert "world 2 (pp 1, dp 2, tp 1)" in log.read_text() and "step 2 | loss" in log.read_text()


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-o", "State"], capture_output=True, text=True).stdout
    return out.split()[0] if out.split() else ""


@pytest.mark.usefixtures("cluster")
def test_preempted_job_saves_requeues_and_resumes(make_cfg, tmp_path):
    """A running job gets Slurm's warning signal: every rank finishes its step, a checkpoint is committed,
    the job requeues itself, restarts, resumes from it and ends with the uninterrupted run's losses. Its
    goodput names the time between the requeue and the restart (queue), and W&B, offline, keeps one run (the
    run's own id) across both starts, logging every step."""
    from hpc_train.observe.goodput import account
    from hpc_train.observe.wandb_log import wandb_run_id

    corpus = make_cfg().data.train_path
    common = [*TINY_MODEL, f"data.train_path={corpus}", "train.steps=150", "train.micro_batch_size=4"]
    run_dir = tmp_path / "preempted"
    wandb = ["logging.wandb.project=hpc-train-tests", "logging.wandb.mode=offline"]
    submitted = run_cli("submit", *common, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.time=00:30:00",
                        *wandb, f"run_dir={run_dir}", "name=preempted")  # fmt: skip
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
    goodput = account(run_dir)
    assert goodput["lost_s"]["queue"] > 0 and 0 < goodput["goodput"] < 1, goodput
    assert read_metrics(run_dir)[-1]["goodput"]["lost_s"]["queue"] == goodput["lost_s"]["queue"]
    ((run_id, starts),) = wandb_offline_runs(run_dir).items()
    assert run_id == wandb_run_id("preempted", run_dir) and len(starts) == 2, starts
    (_, before), (_, after) = starts
    assert before[-1] >= origin["step"] and after == list(range(origin["step"] + 1, 151)), starts


@pytest.mark.usefixtures("cluster")
def test_stop_saves_and_ends_the_job_without_requeueing(make_cfg, tmp_path):
    """A user's stop. The run's first job, followed by `--wait`, gets a plain `scancel` (SIGTERM): every rank
    saves and the job ends CANCELLED, never requeued, and `--wait` says so. While it runs, `status` shows it
    and a second job for its run directory is refused. Its second job, submitted again with in-job restarts
    (its ranks supervised), resumes and is stopped by `hpc-train stop`: it saves and ends COMPLETED. Each
    step's record names its job."""
    corpus = make_cfg().data.train_path
    run_dir = tmp_path / "stopped"
    job = [*TINY_MODEL, f"data.train_path={corpus}", "train.steps=100000", "train.micro_batch_size=4",
           "checkpoint.interval=100000", "slurm.nodes=2", "slurm.tasks_per_node=1", f"run_dir={run_dir}"]  # fmt: skip
    before = job_count()

    def running_past(step: int) -> None:  # until the run records a step past `step`
        deadline = time.monotonic() + 90
        while last_step(run_dir) is None or last_step(run_dir) <= step:
            assert time.monotonic() < deadline
            time.sleep(0.2)

    def cancel() -> None:  # whatever happened, no job of this run is left behind
        for queued in queue.jobs_of(str(run_dir)):
            subprocess.run(["scancel", queued.job_id], check=False)

    waiting = subprocess.Popen([sys.executable, "-m", "hpc_train.cli", "submit", *job, "--wait"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        running_past(2)
        first = read_metrics(run_dir)[0]["job_id"]
        status = run_cli("status")  # every run with a job in the queue
        assert [str(run_dir), first, "RUNNING"] in [line.split()[:3] for line in status.stdout.splitlines()]
        again = run_cli("submit", *job)
        assert (
            again.returncode == 2
            and (
                f"hpc-train: error: job {first} (RUNNING) already runs {run_dir}: a second job would write the same run"
            )
            in again.stderr
        ), again.stderr
        subprocess.run(["scancel", first], check=True)
        out, err = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
        cancel()
    assert waiting.returncode == 0, out + err
    stopped = int(re.search(r"^job \d+ stopped on request at step (\d+), saved", out, re.MULTILINE).group(1))
    assert f"job {first} stopped on request at step {stopped}, saved (Slurm state CANCELLED)" in out
    assert "requeued" not in out and sacct_state(first).startswith("CANCELLED")  # sacct's 'CANCELLED by 0'+
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:07d}"
    assert job_count() == before + 1  # the refused submission reached no Slurm

    while queue.jobs_of(str(run_dir)):  # until the stopped job has left the queue (COMPLETING: refused)
        time.sleep(0.2)
    # supervised (parallel.max_restarts): the stop signal reaches every process of the step, the rank's fork
    # server too, which must outlive it for the supervisor to learn that its rank stopped cleanly
    second = run_cli("submit", *job, "parallel.max_restarts=1")
    assert second.returncode == 0, second.stderr
    second_id = second.stdout.split("submitted job ")[1].split(":")[0]
    try:
        running_past(stopped + 2)
        halted = run_cli("stop", str(run_dir))
        # the time-limit warning right after, likely inside the same step: the user's stop still wins
        subprocess.run(["scancel", "--signal=USR2", second_id], check=True)
        while queue.jobs_of(str(run_dir)):
            time.sleep(0.2)
        waited = run_cli("stop", str(run_dir), "--wait")  # nothing left to stop: the status
    finally:
        cancel()
    assert halted.stdout == f"job {second_id} (RUNNING): asked its ranks to save and stop\n", halted.stdout
    assert waited.stdout.startswith(f"no job in the queue runs {run_dir}\n"), waited.stdout
    row = waited.stdout.splitlines()[-1].split()
    assert row[:4] == [str(run_dir), second_id, "COMPLETED", "(not"], waited.stdout
    assert sacct_state(second_id) == "COMPLETED"
    log = (run_dir / "slurm" / f"{second_id}_0_log.out").read_text()
    assert "requeued" not in log and "(SIGTERM: scancel, `hpc-train stop` or a preemption)" in log
    records = read_metrics(run_dir)
    last = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert records[stopped]["resumed_from"]["step"] == stopped
    assert [r["job_id"] for r in records] == [first] * stopped + [second_id] * (last - stopped)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:07d}"


@pytest.mark.usefixtures("cluster")
def test_killed_rank_restarts_inside_the_allocation(make_cfg, tmp_path, monkeypatch):
    """parallel.max_restarts=1, shared checkpoints every 3 steps and memory ones every step (each node's own,
    in host memory): after the memory save of step 5 the rank on the second node loses its node's copies and
    is killed, and a bit of the first rank's own copy of step 5 flips. The tasks' supervisors
    start both ranks again in the same job: step 5 is passed over (rank 0's copy fails its checksum, and the
    copy its partner kept went with the second node), and the job resumes from step 4 in memory, not the
    shared step 3: rank 1's small parts from the copy its partner node kept, its tensors from its dp twin's
    own copy there (at ZeRO-0 the partner is sent the small parts alone); it completes and ends on the
    uninterrupted run's losses. The node is blamed, and a resubmission excludes it."""
    from hpc_train.observe.goodput import account

    # sbatch passes the environment to the job: rank 1 wipes its node's local directory, then dies
    monkeypatch.setenv("HPC_TRAIN_FAULT", "local_saved@5@1@wipe,local_saved@5@0@corrupt")
    corpus = make_cfg().data.train_path
    steps = ["train.steps=8", "train.micro_batch_size=4"]
    run_dir = tmp_path / "restarted"
    job = [*TINY_MODEL, f"data.train_path={corpus}", *steps, "checkpoint.interval=3", "checkpoint.memory_interval=1",
           "slurm.nodes=2", "slurm.tasks_per_node=1", "parallel.max_restarts=1", f"run_dir={run_dir}"]  # fmt: skip
    out = run_cli("submit", *job, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = out.stdout.split("submitted job ")[1].split(":")[0]
    assert sacct_state(job_id) == "COMPLETED"
    log = (run_dir / "slurm" / f"{job_id}_0_log.err").read_text()
    assert "restarting every rank from the newest checkpoint (in-job restart 1 of parallel.max_restarts=1)" in log
    (resumed,) = [r["resumed_from"] for r in read_metrics(run_dir) if "resumed_from" in r]
    assert (resumed["step"], resumed["source"], resumed["from_partner"]) == (4, "local", [1]), resumed
    (passed_over,) = resumed["passed_over"]
    assert passed_over.startswith("rank 0: ") and "step_0000005/rank00000.pt fails its xxh3_128 checksum" in passed_over
    printed = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"node-local checkpoints: passed over {passed_over}" in printed
    assert "resumed from the node-local checkpoints of step 4, newer than the shared one (ranks [1] from" in printed
    cfg = load_config(None, job)
    for node in ("n1", "n2"):  # n2's made again by the restore; every copy deleted at the run's end
        assert not local_run_root(f"{MEMORY_DIR}/{node}", cfg.name, cfg.checkpoint.dir).exists()
    assert [r["restart"]["attempt"] for r in read_metrics(run_dir) if "restart" in r] == [1]
    lost = account(run_dir)["lost_s"]  # the kill's: step 5 trained again, and the restart itself
    assert lost["redone"] > 0 and lost["restart"] > 0, lost
    # the two steps kept in memory, the newer one the copy; the partner keeps rank 0's small parts alone (its
    # twin on n2 holds its tensors): what the planner counts
    planned = stage_estimates(cfg, ParallelDims(dp=2))[0]
    saved = [r["local_checkpoint"].get("saved", r["local_checkpoint"]) for r in read_metrics(run_dir)]
    saved = [s for s in saved if "local_bytes" in s]
    assert len(saved) >= 6 and all(0 < s["sent_bytes"] < 2**16 < s["local_bytes"] for s in saved), saved
    assert all(abs(2 * s["local_bytes"] - planned.host_copy) < 2**18 for s in saved), (saved, planned.host_copy)
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 9))
    monkeypatch.delenv("HPC_TRAIN_FAULT")
    uninterrupted = make_cfg(*steps, "parallel.nproc=2", run="straight")
    launch_local(run_training, 2, uninterrupted)
    assert [m["loss"] for m in read_metrics(run_dir)] == [m["loss"] for m in read_metrics(uninterrupted.run_dir)]
    # the killed rank's node is blamed, and the run's next job leaves it out (the cluster has n1, n2, n3)
    (reason,) = json.loads((run_dir / "bad_nodes.json").read_text())["n2"]
    assert reason["reason"] == "rank 1 on n2 was killed by SIGKILL" and reason["job"] == job_id
    blamed = f"blamed in {run_dir}/bad_nodes.json: n2 (rank 1 on n2 was killed by SIGKILL, job {job_id})"
    resubmit = [*TINY_MODEL, f"data.train_path={corpus}", "train.steps=10", "train.micro_batch_size=4",
                "checkpoint.interval=2", "slurm.tasks_per_node=1", f"run_dir={run_dir}"]  # fmt: skip
    three = run_cli("submit", *resubmit, "slurm.nodes=3", "--dry-run")  # it would leave too few nodes
    assert f"# not excluding the node(s) {blamed}; the job needs 3 node(s) and only 2 would remain" in three.stdout
    again = run_cli("submit", *resubmit, "slurm.nodes=2", "--wait")
    assert again.returncode == 0 and f"excluding node(s) {blamed}" in again.stdout, again.stdout + again.stderr
    second = again.stdout.split("submitted job ")[1].split(":")[0]
    assert "#SBATCH --exclude=n2\n" in (run_dir / "slurm" / f"{second}_submission.sh").read_text()
    assert sorted(r["node"] for r in json.loads((run_dir / "rank_layout.json").read_text())) == ["n1", "n3"]
    for _ in range(20):  # accounting records the allocation a moment after the job (once: "n1" alone)
        placed = subprocess.run(["sacct", "-j", second, "-X", "-n", "-o", "NodeList%40"], capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
        if placed == "n[1,3]":
            break
        time.sleep(0.5)
    assert placed == "n[1,3]"
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 11))


@pytest.mark.usefixtures("cluster")
def test_a_sweep_is_one_job_array_and_resubmitting_it_resumes_only_the_unfinished(make_cfg, tmp_path):
    """`hpc-train sweep` over optim.lr x train.seed: 4 members, one job array, at most 2 running at once. The
    member run by task 2 is killed in step 4 (its checkpoint of step 2 committed): its task fails, the others
    complete, and while the array runs, submitting the sweep again is refused naming each member's task.
    Submitted again, the sweep runs the killed member alone, from its checkpoint; every member ends on the
    losses of the same run trained on its own (`sweep --local`: each member alone, one after another here),
    and `runs` shows them with their goodput, the killed member's loss named: steps trained again."""
    from hpc_train.observe.goodput import account

    corpus = make_cfg().data.train_path
    common = [*TINY_MODEL, f"data.train_path={corpus}", "train.steps=6", "train.micro_batch_size=2",
              "checkpoint.interval=2", "checkpoint.async_save=false", "parallel.nproc=1", "slurm.tasks_per_node=1",
              "optim.lr=1e-3,3e-3", "train.seed=1,2"]  # fmt: skip
    array = [*common, "name=lr", f"run_dir={tmp_path / 'lr'}", "slurm.array_parallelism=2"]
    killed = {"HPC_TRAIN_FAULT": "compute@4@0", "HPC_TRAIN_FAULT_TASK": "2"}  # sbatch passes the environment
    first = run_cli("sweep", *array, env=killed)
    assert first.returncode == 0 and "4 member(s), 4 to run" in first.stdout, first.stdout + first.stderr
    array_id = first.stdout.split("submitted job array ")[1].split(" ")[0]
    labels = ["lr1e-3-seed1", "lr1e-3-seed2", "lr3e-3-seed1", "lr3e-3-seed2"]
    refused = run_cli("sweep", *array, "--dry-run")
    assert refused.returncode == 2 and f"member {labels[0]}: job {array_id}_0 (" in refused.stderr, refused.stderr
    script = (tmp_path / "lr" / "slurm" / f"{array_id}_submission.sh").read_text()
    assert "#SBATCH --array=0-3%2\n" in script and f"hpc_train-array:0,1,2,3:{tmp_path / 'lr'}" in script
    deadline = time.monotonic() + 240
    while any(sacct_state(f"{array_id}_{task}") not in ("COMPLETED", "FAILED") for task in range(4)):
        assert time.monotonic() < deadline, [sacct_state(f"{array_id}_{task}") for task in range(4)]
        time.sleep(0.5)
    table = run_cli("runs", str(tmp_path / "lr")).stdout
    for task, label in enumerate(labels):
        state, step = ("FAILED", "3/6") if task == 2 else ("COMPLETED", "6/6")
        assert re.search(rf"^lr-{label} +{state} \(job {array_id}_{task}\) +{step} ", table, re.MULTILINE), table
    second = run_cli("sweep", *array, "--wait")
    assert second.returncode == 0 and "4 member(s), 1 to run" in second.stdout, second.stdout + second.stderr
    assert second.stdout.count("finished: skipped") == 3 and f"member {labels[2]} (job " in second.stdout
    reference = run_cli("sweep", *common, "name=ref", f"run_dir={tmp_path / 'ref'}", "--local")
    assert reference.returncode == 0, reference.stderr
    for label in labels:
        resumed = [r["resumed_from"]["step"] for r in read_metrics(tmp_path / "lr" / label) if "resumed_from" in r]
        assert resumed == ([2] if label == labels[2] else [])
        losses = [r["loss"] for r in read_metrics(tmp_path / "lr" / label)]
        assert len(losses) == 6 and losses == [r["loss"] for r in read_metrics(tmp_path / "ref" / label)]
        lost = account(tmp_path / "lr" / label)["lost_s"]
        assert ("redone" in lost) == (label == labels[2]), (label, lost)
    table = run_cli("runs", str(tmp_path / "lr")).stdout
    row = rf"^lr-{labels[2]} +COMPLETED \(job \d+\) +6/6 .* \d+\.\d% \(.*redone [0-9.e-]+s"
    assert re.search(row, table, re.MULTILINE), table
    assert table.splitlines()[1].endswith("optim.lr=0.001 train.seed=1"), table


@pytest.mark.usefixtures("cluster")
def test_doctor_job_tests_the_allocation(tmp_path):
    out = run_cli("doctor", "configs/tiny.yaml", "slurm.nodes=2", "slurm.tasks_per_node=1", f"run_dir={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "doctor: 2 ranks (pp 1, dp 2, cp 1, tp 1) joined through n1:" in out.stdout
    assert "    0  n1 " in out.stdout and "    1  n2 " in out.stdout
    assert "  world  (2 ranks per group): " in out.stdout and "finished: COMPLETED" in out.stdout


@pytest.mark.usefixtures("cluster")
def test_docs_slurm_blocks_run_on_the_local_cluster(tmp_path):
    """README's Slurm quick start (a `<!-- run-slurm -->` block, tests/test_docs.py), submitted for real, here
    with the other Slurm jobs: a job followed by its printed lines, a dry run, a two-node job and a second
    job resuming it."""
    from tests.test_docs import run_blocks

    output = run_blocks("run-slurm", tmp_path)
    assert "follow: tail -f" in output and "squeue -j" in output
    assert output.count("finished: COMPLETED") == 2
    assert "resumed from runs/tiny/checkpoints/step_0000040" in output
