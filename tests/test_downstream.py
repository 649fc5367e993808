"""`hpc-train eval`: lm-eval's tasks on hpc_train's own model, offline. Local tasks (lm-eval YAML over local
JSON-lines files) of the three request kinds, scored through our `LM` and through lm-eval's own `HFLM` on
the Hugging Face export of the same checkpoint: the same numbers, request by request."""

import json
import random
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL, run_cli

lm_eval = pytest.importorskip("lm_eval")  # the `.[eval]` extra; make setup installs it with `.[dev]`
from hpc_train.commands.downstream import accuracies  # noqa: E402 (it imports lm_eval)

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
{body}
"""
KINDS = {
    "local_mc": ("multiple_choice", 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
             'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm'),
    "local_text": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
               "  - metric: word_perplexity\n  - metric: bits_per_byte"),
    "local_gen": ("generate_until", 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\ngeneration_kwargs:\n'
              '  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match'),
}  # fmt: skip


def write_tasks(folder: Path) -> None:
    """Three local tasks from lines of the standard library's sources: which of four endings follows a line's
    start, a few sources' rolling likelihood, and greedy completions of a line."""
    import os

    lines = [line.strip() for line in Path(os.__file__).read_text().splitlines() if 24 <= len(line.strip()) <= 70]
    rng = random.Random(0)
    picked = rng.sample(lines, 40)
    rows = {"local_mc": [], "local_text": [], "local_gen": []}
    for i, line in enumerate(picked[:24]):
        cut = len(line) // 2
        endings = [line[cut:], *(other[len(other) // 2 :] for other in picked[24 + i % 12 : 27 + i % 12])]
        rows["local_mc"].append({"question": line[:cut], "choices": endings, "answer": 0})
    rows["local_text"] = [{"text": "\n".join(picked[i : i + 6])} for i in (0, 6, 12)]
    rows["local_gen"] = [{"question": line[:-4], "answer": line[-4:]} for line in picked[30:36]]
    for name, (kind, body) in KINDS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data, kind=kind, body=body))


def test_eval_gives_lm_evals_numbers_equal_to_hflm_on_the_export(tmp_path):
    """A tiny model trained under tp=2 (a checkpoint of another layout, resharded to one process): `hpc-train
    eval` prints lm-eval's table and writes the results beside the checkpoint; the multiple-choice accuracy,
    the rolling likelihood's bits per byte and perplexity and the generations' exact match equal lm-eval's
    HFLM on the exported folder, and so does every request's score."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_tasks(tasks_dir)
    run = tmp_path / "run"
    trained = run_cli("train", "configs/tiny.yaml", *TINY_MODEL[:3], "model.seq_len=64", "train.steps=20",
                      "parallel.nproc=2", "parallel.tp=2", "checkpoint.interval=20", f"run_dir={run}")  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    out = run_cli("eval", str(run), "--tasks", ",".join(KINDS), "--include-path", str(tasks_dir), "--batch-size", "4",
                  "--log-samples")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "|local_mc  |" in out.stdout and "|acc_norm" in out.stdout and "|bits_per_byte" in out.stdout
    written = json.loads((run / "checkpoints" / "eval" / "step_0000020.json").read_text())
    ours = accuracies(written)
    assert 0 < ours["local_mc/acc"] < 1, ours  # a task that tells models apart
    assert run_cli("export-hf", str(run), str(tmp_path / "hf")).returncode == 0
    manager = TaskManager(include_path=str(tasks_dir))
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=4,
                                                dtype="float32"), tasks=list(KINDS), task_manager=manager,
                                     bootstrap_iters=0)  # fmt: skip
    for key, value in accuracies(theirs).items():
        assert ours[key] == pytest.approx(value, rel=1e-5), key
    for task in KINDS:  # request by request: the same scores and the same generations
        for a, b in zip(written["samples"][task], theirs["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"]
            for x, y in zip(a["scores"], b["filtered_resps"], strict=True):
                if isinstance(x, str):  # a generation
                    assert x == y, task
                elif isinstance(x, float):  # a rolling log-likelihood
                    assert x == pytest.approx(y, rel=1e-5), (task, x, y)
                else:  # a continuation's log-likelihood, and whether it is the greedy one
                    assert x[0] == pytest.approx(y[0], rel=1e-4, abs=1e-4) and x[1] == y[1], (task, x, y)
