"""lm-eval's tasks on hpc_train's own model, offline: `hpc-train eval` on a checkpoint and `eval.tasks` inside
the training loop. Local tasks (lm-eval YAML over local JSON-lines files) of the three request kinds, scored
through our `LM` and through lm-eval's own `HFLM` on the Hugging Face export of the same checkpoint: the
same numbers, request by request; the loop's figures are the command's."""

import json

import pytest

from tests.conftest import LOCAL_TASKS, TINY_MODEL, run_cli

lm_eval = pytest.importorskip("lm_eval")  # the `.[eval]` extra; make setup installs it with `.[dev]`
from hpc_train.train.lm_eval_model import accuracies  # noqa: E402 (it imports lm_eval)


def test_eval_gives_lm_evals_numbers_equal_to_hflm_on_the_export_and_the_loop_gives_the_same(tmp_path, local_tasks):
    """A tiny model trained under tp=2 x dp=2 with ZeRO-3 (a checkpoint of another layout, resharded to one
    process), scoring three tasks inside the loop every 7 steps and at the last, each rank of dp its share (at
    step 7 lm-eval fails on rank 0: the record says so, and training goes on): `hpc-train eval` prints lm-eval's
    table and writes the results beside the checkpoint; the multiple-choice accuracy, the greedy
    continuations' accuracy, the rolling likelihood's bits per byte and perplexity and the generations' exact
    match equal lm-eval's HFLM on the exported folder, and so does every request's score; the loop's step-20
    figures in metrics.jsonl are the command's. A task that generates text, or one lm-eval
    does not know, is refused before any rank starts."""
    from lm_eval.models.huggingface import HFLM

    from hpc_train.train.lm_eval_model import task_manager

    tasks_dir = local_tasks
    run = tmp_path / "run"
    layout = [*TINY_MODEL[:3], "model.seq_len=64", "train.steps=20", "parallel.nproc=4", "parallel.tp=2",
              "optim.zero_stage=3", "checkpoint.interval=20", f"eval.include_path={tasks_dir}"]  # fmt: skip
    for tasks, refusal in (("[local_mc,local_gen]", "eval.tasks: local_gen generates text, which the training loop "
                            "does not run; score it on a checkpoint: hpc-train eval RUN_DIR --tasks local_gen\n"),
                           ("[local_mc,hellaswag_nope]", "eval.tasks: hellaswag_nope is no lm-eval task or under "
                            f"eval.include_path={tasks_dir}")):  # fmt: skip
        refused = run_cli("train", "configs/tiny.yaml", *layout, f"eval.tasks={tasks}", f"run_dir={run}")
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr
    fault = {"HPC_TRAIN_TESTING": "1", "HPC_TRAIN_FAULT": "downstream@7@0@oom"}  # lm-eval fails at step 7
    trained = run_cli("train", "configs/tiny.yaml", *layout, "eval.tasks=[local_mc,local_next,local_text]",
                      "eval.task_interval=7", f"run_dir={run}", env=fault)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert "step 7: downstream evaluation failed on rank 0 (OutOfMemoryError: injected" in trained.stdout
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    looped = {step: {k[len("downstream/") :]: v for k, v in r.items() if k.startswith("downstream/")}
              for step, r in records.items()}  # fmt: skip
    assert records[7]["downstream_error"].startswith("OutOfMemoryError: injected") and not looped[7]
    assert [step for step, figures in looped.items() if figures] == [14, 20] and looped[14] != looped[20]
    out = run_cli("eval", str(run), "--tasks", ",".join(LOCAL_TASKS), "--include-path", str(tasks_dir),
                  "--batch-size", "4", "--log-samples")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "|local_mc  |" in out.stdout and "|acc_norm" in out.stdout and "|bits_per_byte" in out.stdout
    written = json.loads((run / "checkpoints" / "eval" / "step_0000020.json").read_text())
    ours = accuracies(written)
    assert 0 < ours["local_mc/acc"] < 1, ours  # a task that tells models apart
    assert 0 < ours["local_next/acc"] < 1, ours  # the greedy continuation: some are, some not
    assert set(looped[20]) == {k for k in ours if not k.startswith("local_gen/")}
    for key, value in looped[20].items():
        assert value == pytest.approx(ours[key], rel=1e-6), key
    assert run_cli("export-hf", str(run), str(tmp_path / "hf")).returncode == 0
    manager = task_manager(list(LOCAL_TASKS), str(tasks_dir))  # these tasks alone: no built-in ones indexed
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=4,
                                                dtype="float32"), tasks=list(LOCAL_TASKS), task_manager=manager,
                                     bootstrap_iters=0)  # fmt: skip
    for key, value in accuracies(theirs).items():
        assert ours[key] == pytest.approx(value, rel=1e-5), key
    for task in LOCAL_TASKS:  # request by request: the same scores and the same generations
        for a, b in zip(written["samples"][task], theirs["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"]
            for x, y in zip(a["scores"], b["filtered_resps"], strict=True):
                if isinstance(x, str):  # a generation
                    assert x == y, task
                elif isinstance(x, float):  # a rolling log-likelihood
                    assert x == pytest.approx(y, rel=1e-5), (task, x, y)
                else:  # a continuation's log-likelihood, and whether it is the greedy one
                    assert x[0] == pytest.approx(y[0], rel=1e-4, abs=1e-4) and x[1] == y[1], (task, x, y)
