"""`prepare-data --slurm nodes=N`: a job array tokenizes contiguous groups of the inputs, a merge after it writes
the dataset one process writes, byte for byte. The plan, the refusals and the parts' own semantics (a part
without text, a failed merge, parts reused) run here without Slurm; the whole pipeline runs on the real local
cluster (slurm/local-cluster.sh; `make cluster`), no mocks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.config import ConfigError
from hpc_train.data.prepare import expand_inputs, prepare_data, stdlib_sources
from hpc_train.launch import prepare_array
from hpc_train.launch.prepare_array import ArrayOptions, MergeTask, PartTask, make_plan, parts_to_run, split_groups
from tests.conftest import ROOT, run_cli
from tests.test_slurm import job_count


def write_corpus(root: Path) -> str:
    """Three JSONL files of {text} lines, one of {prompt, response} examples (the dataset gets a loss mask) and
    two text files, a few kB in all; returns their glob."""
    root.mkdir(parents=True)
    sources = stdlib_sources()[:5]
    for n, source in enumerate(sources[:3]):
        lines = [line for line in source.read_text().splitlines() if line.strip()][:40]
        (root / f"a{n}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    examples = [{"prompt": f"Q{i}: what follows {i}? ", "response": f"{i + 1}"} for i in range(25)]
    (root / "b_sft.jsonl").write_text("".join(json.dumps(example) + "\n" for example in examples))
    for n, source in enumerate(sources[3:]):
        (root / f"c{n}.txt").write_text(source.read_text()[:2500])
    return str(root / "*")


def dataset_files(directory: Path) -> dict[str, bytes]:
    """Every file of the datasets in `directory` (the jobs' log folder left out), by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_groups_are_contiguous_balanced_and_never_empty():
    assert split_groups([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert split_groups([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert split_groups([1, 1, 1, 100], 3) == [(0, 2), (2, 3), (3, 4)]  # the cuts move back: no group is empty
    assert split_groups([0, 0, 0], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_groups([5], 1) == [(0, 1)]


def test_refusals_name_the_fix(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f in files:
        f.write_text("text")
    with pytest.raises(ConfigError) as refused:
        prepare_array.parse_slurm(["nodes=0", "gpus=2", "time=soon", "partition=a b"])
    assert str(refused.value).splitlines() == [
        "--slurm gpus=2: unknown key 'gpus'; the keys are nodes, partition, account, time (e.g. --slurm nodes=4 "
        "partition=cpu account=lab time=120)",
        "--slurm partition='a b' must be one word (letters, digits, _.,:+@-) for its #SBATCH line",
        "--slurm nodes=0: give the array's tasks, a whole number of at least 1 (nodes=4)",
        "--slurm time=soon is not a Slurm time limit; use minutes (time=120), HH:MM:SS or D-HH:MM:SS",
    ]
    with pytest.raises(ConfigError, match=r"^--slurm nodes=3 but the inputs are 2 file\(s\): .* use nodes=2 or fewer$"):
        make_plan(files, str(tmp_path / "out"), "byte", 0, None, 1, "text", ArrayOptions(3))
    with pytest.raises(ConfigError, match=r"^--workers 0 must be at least 1$"):  # prepare_data's own, before any job
        make_plan(files, str(tmp_path / "out"), "byte", 0, None, 0, "text", ArrayOptions(2))


def test_parts_merge_as_one_process_writes_and_a_failed_merge_keeps_them(tmp_path):
    """Tasks and merge run here, as their jobs run them: a part without any text is no error of its own (the
    corpus has text); a merge that fails (--valid-every holding out none, one process's own error) leaves no
    file of the dataset and every part, and a plan submitted again reuses them; a corpus without text is
    refused by the merge with one process's message."""
    big, empty = tmp_path / "in" / "a.txt", tmp_path / "in" / "b.jsonl"
    big.parent.mkdir()
    big.write_text("x" * 500)
    empty.write_text(json.dumps({"text": ""}) + "\n")
    files = expand_inputs([str(tmp_path / "in" / "*")])
    with pytest.raises(ConfigError) as one_process:
        prepare_data(files, str(tmp_path / "one" / "data"), valid_every=5, progress=False)
    reference = prepare_data(files, str(tmp_path / "one" / "data"), valid_every=2, progress=False)
    plan = make_plan(files, str(tmp_path / "many" / "data"), "byte", 5, None, 1, "text", ArrayOptions(2))
    assert plan.groups == ((0, 1), (1, 2)) and parts_to_run(plan) == [0, 1]
    assert [PartTask(plan, part)().text for part in (0, 1)] == [True, False]
    with pytest.raises(ConfigError) as merged:
        MergeTask(plan)()
    assert str(merged.value) == str(one_process.value)
    assert [p.name for p in (tmp_path / "many").iterdir()] == ["data.parts"] and parts_to_run(plan) == []
    plan = make_plan(files, str(tmp_path / "many" / "data"), "byte", 2, None, 1, "text", ArrayOptions(2))
    assert parts_to_run(plan) == []  # --valid-every is the merge's: the parts are the same
    assert MergeTask(plan)()[0] == {split: str(tmp_path / "many" / Path(p).name) for split, p in reference.items()}
    assert dataset_files(tmp_path / "many") == dataset_files(tmp_path / "one")  # and the parts are gone
    empty_only = make_plan([empty], str(tmp_path / "none" / "data"), "byte", 0, None, 1, "text", ArrayOptions(1))
    PartTask(empty_only, 0)()
    with pytest.raises(ConfigError, match=r"^the 1 input file\(s\) hold no text: nothing to tokenize$"):
        MergeTask(empty_only)()


def test_three_nodes_write_the_dataset_one_process_writes(cluster, tmp_path):
    """The dry run lists the groups and submits nothing; a bad --slurm key is refused; then the real array of 3
    tasks and its merge, followed by `--wait`: every file of PREFIX and PREFIX_valid (.bin, .idx, .mask,
    .tokenizer.json) is byte-identical to one process's, and the parts are gone. While the jobs are queued, a
    second preparation of the same prefix is refused."""
    pattern = write_corpus(tmp_path / "in")
    prepare_data(expand_inputs([pattern]), str(tmp_path / "one" / "data"), valid_every=3, progress=False)
    out = tmp_path / "nodes" / "data"
    command = ["prepare-data", pattern, "--output", str(out), "--valid-every", "3", "--slurm", "nodes=3"]
    before = job_count()
    dry = run_cli(*command, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    size = sum(p.stat().st_size for p in (tmp_path / "in").iterdir())
    assert lines[0].startswith(f"# hpc_train dry run: nothing submitted. 6 input file(s), {size:,} bytes, in 3 "
                               f"part(s) under {out}.parts")  # fmt: skip
    groups = [re.match(r"  part (\d): (\d) file\(s\), ([\d,]+) bytes \(.*\): to tokenize$", x) for x in lines[1:4]]
    assert [int(g[1]) for g in groups] == [0, 1, 2] and sum(int(g[2]) for g in groups) == 6, lines
    assert sum(int(g[3].replace(",", "")) for g in groups) == size
    assert "#SBATCH --array=0-2%3" in dry.stdout and "#SBATCH --dependency=afterok:ARRAY_JOB_ID" in dry.stdout
    refused = run_cli(*command, "gpus=1")
    assert refused.returncode == 2 and refused.stderr.startswith("hpc-train: error: --slurm gpus=1: unknown key 'gpus'")
    assert job_count() == before and not out.parent.exists()
    waiting = subprocess.Popen([sys.executable, "-m", "hpc_train.cli", *command, "--wait"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        submitted = waiting.stdout.readline()
        again = run_cli(*command, "--dry-run")
        rest, err = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
    assert submitted.startswith("submitted job array ") and waiting.returncode == 0, submitted + rest + err
    assert again.returncode == 2 and f"already prepare(s) {out} (parts in {out}.parts)" in again.stderr, again.stderr
    assert [line.split(" (job")[0] for line in rest.splitlines() if "(job" in line] == sorted(
        ["part 0", "part 1", "part 2"], key=lambda name: rest.index(name + " (job")) + ["merge"]  # fmt: skip
    assert rest.splitlines()[-2].startswith(f"train: {out}.bin / {out}.idx: ")
    ours, theirs = dataset_files(out.parent), dataset_files(tmp_path / "one")
    assert set(theirs) == {f"data{s}{e}" for s in ("", "_valid") for e in (".bin", ".idx", ".mask", ".tokenizer.json")}
    assert ours == theirs and not Path(f"{out}.parts").exists() and Path(f"{out}.slurm").is_dir()
