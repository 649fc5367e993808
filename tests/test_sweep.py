"""Sweeps, the model ladder and goodput, without Slurm (the job array itself: tests/test_slurm.py): how swept
values become members, what is refused before anything runs, a 3-size ladder trained here and fitted, and
the goodput ledger's accounting of restarts, requeues, rollbacks and new launches."""

import json
import re

import pytest

from hpc_train.commands.status import array_task
from hpc_train.config import ConfigError
from hpc_train.launch.queue import array_comment, array_task_job
from hpc_train.launch.sweep import combinations, member_label, split_values, sweep_axes
from hpc_train.observe.goodput import LEDGER, Account, Ledger, read_ledger
from hpc_train.observe.metrics import read_jsonl
from tests.conftest import TINY_MODEL, read_metrics, run_cli


def test_swept_values_become_members():
    assert split_values("1e-3,3e-3") == ["1e-3", "3e-3"]
    assert split_values("[1,2],[3]") == ["[1,2]", "[3]"]  # a list is one value
    assert split_values("'0.3 a,b 0.7 c','1 d'") == ["'0.3 a,b 0.7 c'", "'1 d'"]  # so is a quoted blend string
    shared, axes = sweep_axes(["train.steps=4", "optim.lr=1e-3,3e-3", "train.seed=1,2,3"])
    assert shared == ["train.steps=4"] and axes == {"optim.lr": ["1e-3", "3e-3"], "train.seed": ["1", "2", "3"]}
    product = combinations(axes, zipped=False)
    assert len(product) == 6 and product[1] == {"optim.lr": "1e-3", "train.seed": "2"}
    assert combinations({"a.x": ["1", "2"], "b.y": ["3", "4"]}, zipped=True) == [{"a.x": "1", "b.y": "3"},
                                                                              {"a.x": "2", "b.y": "4"}]  # fmt: skip
    assert member_label({"optim.lr": "1e-3", "train.seed": "2"}) == "lr1e-3-seed2"
    assert member_label({"optim.lr": "1", "optim.muon.lr": "2"}) == "optim_lr1-optim_muon_lr2"  # alike: whole keys
    assert member_label({"data.train_path": "/d/a b"}) == "train_path_d_a_b"


@pytest.mark.parametrize(
    ("items", "zipped", "expected"),
    [
        (["slurm.nodes=1,2"], False, "slurm.nodes may not be swept: "),
        (["run_dir=a,b"], False, "run_dir may not be swept: "),
        (["optim.lr=1e-3,1e-3"], False, "a swept value is empty or repeated"),
        (["optim.lr=1,2", "optim.lr=3,4"], False, "optim.lr is swept twice"),
        (["optim.lr=1,2", "train.seed=1,2,3"], True, "different counts (optim.lr: 2, train.seed: 3)"),
    ],
)
def test_bad_sweeps_are_refused(items, zipped, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        combinations(sweep_axes(items)[1], zipped)


def test_every_members_problem_is_named_before_anything_runs(tmp_path):
    """A value that breaks some members: every problem, each naming its member, and nothing submitted."""
    out = run_cli("sweep", "configs/tiny.yaml", f"run_dir={tmp_path / 's'}", "model.n_heads=4,3,5", "--dry-run")
    assert out.returncode == 2 and "#SBATCH" not in out.stdout
    assert re.search(r"member n_heads3: .*n_heads", out.stderr) and re.search(r"member n_heads5: ", out.stderr)
    assert "member n_heads4" not in out.stderr and not (tmp_path / "s").exists()
    shared = run_cli("sweep", "configs/tiny.yaml", "optim.lr=1,2", "checkpoint.dir=/tmp/one", "--dry-run")
    assert shared.returncode == 2 and "every member would write checkpoint.dir=/tmp/one" in shared.stderr
    alike = run_cli("sweep", "configs/tiny.yaml", "data.train_path=/d/a_b,/d/a/b", "--dry-run")
    assert alike.returncode == 2 and "get one label, train_path_d_a_b (data.train_path=/d/a_b; data" in alike.stderr


def test_a_ladder_trains_here_and_fits_a_power_law(tmp_path):
    """`ladder --local`: three sizes of the tiny family with their token budgets, trained one after another
    here; `ladder fit` then fits loss against compute, prints the fit and its residuals, predicts a larger
    model and draws the plot; `runs` shows the three side by side. Run again, it skips the finished."""
    ladder = ["ladder", "configs/tiny.yaml", *TINY_MODEL[3:], "parallel.nproc=1", f"run_dir={tmp_path / 'lad'}",
              "--sizes", "0.2M,0.4M,0.8M", "--tokens-per-param", "0.01"]  # fmt: skip
    out = run_cli(*ladder, "--local")
    assert out.returncode == 0 and "3 member(s), 3 to run" in out.stdout, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "lad" / "sweep.json").read_text())
    labels = [m["label"] for m in manifest["members"]]
    assert labels == ["156K", "406K", "951K"], labels
    steps = [read_metrics(tmp_path / "lad" / label)[-1]["step"] for label in labels]
    assert steps == [int(m["values"]["train.steps"]) for m in manifest["members"]] and steps[0] < steps[1] < steps[2]
    fit = run_cli("ladder", "fit", str(tmp_path / "lad"), "--target", "2M", "--tokens-per-param", "0.01")
    assert fit.returncode == 0, fit.stderr
    assert re.search(r"^L\(C\) = [0-9.]+ \+ [0-9.e+]+ \* C\^-[0-9.]+ ", fit.stdout, re.MULTILINE), fit.stdout
    assert all(re.search(rf"^{label} +[0-9.e]+ +[0-9.]+ +[0-9.]+ +[-+][0-9.]+$", fit.stdout, re.MULTILINE)
               for label in labels), fit.stdout  # fmt: skip
    assert "predicted at 2M parameters" in fit.stdout and (tmp_path / "lad" / "ladder_fit.png").stat().st_size > 0
    table = run_cli("runs", str(tmp_path / "lad"), "--plot", str(tmp_path / "curves.png")).stdout
    assert [line.split()[:3] for line in table.splitlines()[1:-1]] == [
        [f"tiny-{label}", "finished", f"{step}/{step}"] for label, step in zip(labels, steps, strict=True)
    ]
    assert "model.d_model=64 model.n_heads=2" in table and (tmp_path / "curves.png").stat().st_size > 0
    again = run_cli(*ladder, "--local")
    assert "3 member(s), 0 to run" in again.stdout and again.stdout.count("finished: skipped") == 3


def test_array_tasks_are_found_as_their_members(tmp_path):
    """squeue -r's line of a task (or of a one-member sweep's plain job) names the member it runs, through the
    array's comment and sweep.json, also for an array of some members only (a sweep submitted again); after
    the queue, status and runs take the last task that ran each member. A sweep that cannot be read is not
    ours: skipped, not an error."""
    sweep = tmp_path / "s"
    sweep.mkdir()
    members = [{"path": str(sweep / name)} for name in "abcd"]
    arrays = [{"job_id": "10", "members": [0, 1, 2, 3]}, {"job_id": "12", "members": [2]},
              {"job_id": "13", "members": [1, 3]}]  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps({"members": members, "arrays": arrays}))
    assert array_task_job("13_1", "PENDING", "1", array_comment(str(sweep), [1, 3])).run_dir == members[3]["path"]
    assert array_task_job("12", "RUNNING", "N/A", array_comment(str(sweep), [2])).run_dir == members[2]["path"]
    assert array_task_job("9_0", "RUNNING", "0", f"hpc_train-array:0:{tmp_path / 'gone'}") is None
    assert array_task_job("9_0", "RUNNING", "0", "hpc_train-array:x:/") is None
    assert [array_task(sweep / name) for name in "abcd"] == ["10_0", "13_0", "12", "13_1"]
    assert array_task(tmp_path / "plain") is None


def test_the_ledger_survives_a_cut_line_and_a_fresh_start(tmp_path):
    """A kill mid-line leaves a partial last line: the next start drops it and appends on a line of its own
    (else every later event would be unreadable). A run started afresh over committed checkpoints keeps the
    earlier ledger beside, and its own begins empty."""
    (tmp_path / LEDGER).write_text('{"event": "start", "t": 0, "ready": 1, "step": 0}\n{"event": "st')
    ledger = Ledger(tmp_path)
    ledger.add("steps", steps=[[1, 0.5]])
    ledger.close()
    assert [e["event"] for e in read_ledger(tmp_path)] == ["start", "steps"]
    ledger = Ledger(tmp_path)
    ledger.set_aside(tmp_path / "goodput.kept.jsonl")
    assert ledger.started(0)["productive_s"] == 0 and len(read_ledger(tmp_path)) == 1
    assert [e["event"] for e in read_jsonl(tmp_path / "goodput.kept.jsonl")] == ["start", "steps"]


def _ledger(*events):
    account = Account()
    for event in events:
        account.add(event)
    return account.summary()


def test_goodput_names_each_loss_by_its_cause():
    """A ledger as rank 0 writes it, by hand: a job's first start (2 s of start-up), three steps of 1 s with a
    0.5 s save at step 2; a crash after step 3 at t=20 and an in-job restart training again at t=22, from step 2
    (step 3 trained again); a spike at step 4 rolled back to step 3; a requeue 10 s later; then a new submission a day
    later, whose wait is nobody's loss."""
    start = {"event": "start", "job": "7", "attempt": 0, "requeue": 0}
    summary = _ledger(
        {**start, "t": 0, "ready": 2, "step": 0},
        {"event": "steps", "t": 3, "steps": [[1, 1.0]]},
        {"event": "steps", "t": 4.5, "steps": [[2, 1.0]], "checkpoint_s": 0.5},
        {"event": "steps", "t": 5.5, "steps": [[3, 1.0]]},
        {**start, "t": 21, "ready": 22, "step": 2, "attempt": 1, "failed_at": 20},  # in-job restart
        {"event": "steps", "t": 23, "steps": [[3, 1.0]]},
        {"event": "rollback", "t": 25, "step": 3},  # step 4 trained, spiked, rolled back
        {"event": "steps", "t": 26, "steps": [[4, 1.0]], "eval_s": 0.25},
        {"event": "end", "t": 26.5},
        {**start, "t": 36.5, "ready": 37.5, "step": 4, "requeue": 1},  # the requeued job
        {"event": "steps", "t": 38.5, "steps": [[5, 1.0]]},
        {"event": "end", "t": 38.5},
        {**start, "job": "8", "t": 90000, "ready": 90001, "step": 5},  # a later submission: its wait not counted
        {"event": "steps", "t": 90002, "steps": [[6, 1.0]]},
    )
    lost = summary["lost_s"]
    assert summary["productive_s"] == 6.0 and summary["wall_s"] == pytest.approx(38.5 + 2)
    assert lost == {"startup": 4.0, "checkpoint": 0.5, "eval": 0.25, "restart": 2.0, "redone": 15.5,
                    "rollback": 2.0, "queue": 10.0, "other": pytest.approx(0.25)}  # fmt: skip
    assert summary["goodput"] == pytest.approx(6.0 / 40.5, abs=1e-4)
