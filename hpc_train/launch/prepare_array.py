"""`hpc-train prepare-data INPUTS --output PREFIX --slurm nodes=N`: one-process preparation (data/prepare.py)
spread over a Slurm job array, with a merge after it, writing the dataset one process would have written.

The input files, in `expand_inputs` order, are cut into N contiguous groups of about equal bytes. Task i of
the array tokenizes group i into PREFIX.parts/part_<i> (every document: no held-out split), recording what it
saw in part_<i>.json. A merge job, which Slurm starts once every task has completed (afterok, and cancels
when one fails), reads the parts in order into PREFIX, and PREFIX_valid with --valid-every (every N-th
document by its index in the whole corpus), through the same writer, refusals and split rule as one
process: the files are byte-identical to one process's. The merge commits through the writer's renames and
only then removes the parts: a failed merge leaves no final file and every part; submitting the same command
again tokenizes only the parts that are missing or whose files have changed since. The jobs' logs stay in
PREFIX.slurm; their comment names the parts directory, so a second preparation of one prefix is refused
while the first is queued."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import submitit
from submitit.core.utils import FailedJobError

from hpc_train.config import ConfigError
from hpc_train.config.checks import time_limit_minutes, time_limit_seconds
from hpc_train.data.indexed import read_index, replace_file, tokenizer_digest
from hpc_train.data.prepare import (
    Tokenized,
    check_options,
    check_prepared,
    committed,
    note_cut,
    open_writers,
    output_prefix,
    split_of,
    tokenize_into,
)
from hpc_train.data.tokenizer import tokenizer_json
from hpc_train.errors import UserError
from hpc_train.launch.partition import partition_problems
from hpc_train.launch.queue import slurm_output
from hpc_train.launch.slurm import ScriptOnlyExecutor, task_logs, wait_for_jobs

SLURM_KEYS = ("nodes", "partition", "account", "time")
DEFAULT_TIME = "60"  # minutes each job may run without time=: sbatch's own default is the partition's limit
COMMENT_PREFIX = "hpc_train-prepare:"  # then the parts directory: a queued preparation of the same prefix
ERROR_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b")  # a traceback's exception line
WORD = re.compile(r"[A-Za-z0-9_.,:+@-]+")  # a partition or account: one word of its #SBATCH line


@dataclass(frozen=True)
class ArrayOptions:
    """--slurm's values: the array's tasks (one node each), and where and how long its jobs run."""

    nodes: int
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # None: DEFAULT_TIME

    @property
    def minutes(self) -> int:
        return time_limit_minutes(self.time or DEFAULT_TIME)


def parse_slurm(items: list[str]) -> ArrayOptions:
    """--slurm KEY=VALUE ... as options; every problem at once, each with its fix."""
    values: dict[str, str] = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SLURM_KEYS:
            problems.append(f"--slurm {item}: unknown key {key!r}; the keys are {', '.join(SLURM_KEYS)} (e.g. "
                            "--slurm nodes=4 partition=cpu account=lab time=120)")  # fmt: skip
        elif key in values:
            problems.append(f"--slurm {key} is given twice ({values[key]}, {value}); give it once")
        elif not WORD.fullmatch(value):
            problems.append(f"--slurm {key}={value!r} must be one word (letters, digits, _.,:+@-) for its #SBATCH line")
        else:
            values[key] = value
    nodes = values.get("nodes", "")
    if not nodes.isdigit() or int(nodes) < 1:
        problems.append(f"--slurm nodes={nodes}: give the array's tasks, a whole number of at least 1 (nodes=4)"
                        if nodes else "--slurm needs nodes=N: the array's tasks, one node each")  # fmt: skip
    if "time" in values and time_limit_seconds(values["time"]) is None:
        problems.append(f"--slurm time={values['time']} is not a Slurm time limit; use minutes (time=120), HH:MM:SS "
                        "or D-HH:MM:SS")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))
    return ArrayOptions(int(nodes), values.get("partition"), values.get("account"), values.get("time"))


def check_cluster(options: ArrayOptions) -> None:
    """The partition exists, the time fits its limit and the account is the user's (a job past a partition's
    limit would wait forever); nothing is checked where Slurm does not answer (a dry run on a laptop)."""

    def over_time(name: str, fields: dict[str, str]) -> list[str]:
        limit = fields.get("MaxTime", "UNLIMITED")
        if (allowed := time_limit_seconds(limit)) is None or options.minutes * 60 <= allowed:
            return []
        given = f"time={options.time}" if options.time else f"time={DEFAULT_TIME} (the default)"
        return [f"--slurm {given} exceeds partition {name}'s limit of {limit}; give time={allowed // 60} or less"]

    if problems := partition_problems(options.partition, options.account, "--slurm partition", "--slurm account",
                                      over_time):  # fmt: skip
        raise ConfigError("\n".join(problems))


@dataclass(frozen=True)
class PrepPlan:
    """What the array and the merge do: the files (absolute, in order) and their sizes, each task's group of
    them (start, end), the dataset's prefix (absolute) and prepare-data's options, and the directory the jobs
    run in (a relative --tokenizer is read from there)."""

    files: tuple[str, ...]
    sizes: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]
    output: str
    tokenizer: str
    valid_every: int
    max_tokens: int | None
    workers: int
    text_key: str
    slurm: ArrayOptions
    cwd: str

    @property
    def parts_dir(self) -> Path:
        return Path(self.output + ".parts")

    @property
    def log_dir(self) -> Path:
        return Path(self.output + ".slurm")

    def part_prefix(self, part: int) -> str:
        return str(self.parts_dir / f"part_{part:05d}")

    def group(self, part: int) -> list[Path]:
        start, end = self.groups[part]
        return [Path(f) for f in self.files[start:end]]


def split_groups(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """`n` contiguous runs (start, end) of the files, none empty, the k-th ending at the file boundary nearest to
    k/n of the bytes: tasks of about equal work, and the corpus's order kept for the merge."""
    ends = np.cumsum(sizes)  # ends[j]: the bytes of files 0..j
    bounds = [0]
    for k in range(1, n):
        target = ends[-1] * k / n
        first = int(np.searchsorted(ends, target))  # cut before or after this file
        lo, hi = bounds[-1] + 1, len(sizes) - (n - k)  # a file for this group, and for each one after it
        bounds.append(min((min(max(cut, lo), hi) for cut in (first, first + 1)),
                          key=lambda cut: abs(ends[cut - 1] - target)))  # fmt: skip
    return list(itertools.pairwise([*bounds, len(sizes)]))


def make_plan(
    files: list[Path],
    output: str,
    tokenizer: str,
    valid_every: int,
    max_tokens: int | None,
    workers: int,
    text_key: str,
    options: ArrayOptions,
) -> PrepPlan:
    """The plan of `files` (`expand_inputs`'s) over `options.nodes` tasks, after prepare_data's own refusals of
    the options: nothing is submitted that one process would refuse before reading a file."""
    check_options(tokenizer, valid_every, max_tokens, workers)
    if not files:
        check_prepared(Tokenized(), 0, valid_every, 0)  # one process's refusal: no text at all
    if options.nodes > len(files):
        raise ConfigError(f"--slurm nodes={options.nodes} but the inputs are {len(files)} file(s): a task tokenizes "
                          f"whole files, so each needs one; use nodes={len(files)} or fewer")  # fmt: skip
    sizes = [f.stat().st_size for f in files]
    return PrepPlan(tuple(str(f.absolute()) for f in files), tuple(sizes), tuple(split_groups(sizes, options.nodes)),
                    str(Path(output_prefix(output)).absolute()), tokenizer, valid_every, max_tokens, workers, text_key,
                    options, os.getcwd())  # fmt: skip


def part_key(plan: PrepPlan, part: int) -> dict[str, Any]:
    """What a part was tokenized from, as its part_<i>.json records it: its files (path, size, mtime), the
    tokenizer (its digest) and the options that change tokens. A part whose key differs is stale."""
    files = [[str(f), (s := f.stat()).st_size, s.st_mtime_ns] for f in plan.group(part)]
    digest = tokenizer_digest(tokenizer_json(plan.tokenizer).encode())
    return {"files": files, "tokenizer": plan.tokenizer, "tokenizer_digest": digest, "max_tokens": plan.max_tokens,
            "text_key": plan.text_key}  # fmt: skip


def part_record(plan: PrepPlan, part: int) -> dict[str, Any] | None:
    """A finished part's part_<i>.json (its key and what it saw), or None where it is missing or stale."""
    path = Path(plan.part_prefix(part) + ".json")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fresh = record.get("key") == part_key(plan, part) and Path(plan.part_prefix(part) + ".idx").is_file()
    return record if fresh else None


def parts_to_run(plan: PrepPlan) -> list[int]:
    """The parts the array tokenizes: those an earlier submission did not finish (or whose files changed)."""
    return [part for part in range(len(plan.groups)) if part_record(plan, part) is None]


@dataclass(frozen=True)
class PartTask:
    """A task of the array (pickled by submitit): group `part`'s files into its part, then its record."""

    plan: PrepPlan
    part: int

    def __call__(self) -> Tokenized:
        plan, prefix = self.plan, self.plan.part_prefix(self.part)
        key = part_key(plan, self.part)  # before reading: a file changed meanwhile makes the part stale
        writers = open_writers(prefix, check_options(plan.tokenizer, 0, plan.max_tokens, plan.workers), plan.tokenizer,
                               0)  # fmt: skip
        with committed(writers):
            seen = tokenize_into(writers, plan.group(self.part), plan.tokenizer, 0, False, plan.max_tokens,
                                 plan.workers, plan.text_key)  # fmt: skip
        replace_file(prefix + ".json", json.dumps({"key": key, **asdict(seen)}).encode())
        print(f"part {self.part}: {len(plan.group(self.part))} file(s), {seen.documents:,} document(s) -> {prefix}")
        return seen


def part_documents(prefix: str, chunk: int = 1 << 20) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """A part's documents in order: token ids and loss mask (None in a part without one), read mapped."""
    header, offsets_at, _ = read_index(prefix)
    offsets = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=offsets_at)
    mapped = lambda path, dtype: np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    tokens = mapped(prefix + ".bin", np.dtype(header["dtype"]))
    mask = mapped(prefix + ".mask", np.uint8) if header.get("loss_mask") else None
    for first in range(0, header["num_docs"], chunk):
        for start, end in itertools.pairwise(offsets[first : first + chunk + 1].tolist()):
            yield tokens[start:end], None if mask is None else mask[start:end]


def merge_parts(plan: PrepPlan) -> tuple[dict[str, str], Tokenized]:
    """The parts, in order, into the dataset (every document to `split_of` its index in the corpus), with one
    process's refusals over the whole corpus; then the parts are removed. Returns the prefixes written and
    what the parts saw together."""
    records = [part_record(plan, part) for part in range(len(plan.groups))]
    if missing := [part for part, record in enumerate(records) if record is None]:
        raise ConfigError(f"part(s) {', '.join(map(str, missing))} in {plan.parts_dir} are missing, or their files "
                          "changed after they were tokenized: submit the same command again (it tokenizes those "
                          "parts alone, then merges)")  # fmt: skip
    seen = Tokenized(sum(r["documents"] for r in records), any(r["text"] for r in records),
                     sum(r["cut"] for r in records))  # fmt: skip
    writers = open_writers(plan.output, check_options(plan.tokenizer, plan.valid_every, plan.max_tokens, 1),
                           plan.tokenizer, plan.valid_every)  # fmt: skip
    with committed(writers):
        documents = itertools.chain.from_iterable(part_documents(plan.part_prefix(p)) for p in range(len(records)))
        for index, (ids, mask) in enumerate(documents):
            writers[split_of(index, plan.valid_every)].add_document(ids, mask)
        check_prepared(seen, len(plan.files), plan.valid_every, writers["valid"].num_docs if plan.valid_every else 0)
    shutil.rmtree(plan.parts_dir)
    return {split: writer.prefix for split, writer in writers.items()}, seen


@dataclass(frozen=True)
class MergeTask:
    """The merge job (pickled by submitit)."""

    plan: PrepPlan

    def __call__(self) -> tuple[dict[str, str], Tokenized]:
        written, seen = merge_parts(self.plan)
        print(f"merged {len(self.plan.groups)} part(s), {seen.documents:,} document(s): {' '.join(written.values())}")
        note_cut(seen, self.plan.max_tokens)
        return written, seen


def executor(
    plan: PrepPlan, cpus: int, executor_class: type[submitit.SlurmExecutor] = submitit.SlurmExecutor, **more: Any
) -> submitit.SlurmExecutor:
    """A job of one task on one node with `cpus` CPUs, run in the submission's directory, its logs in
    PREFIX.slurm, its comment naming the parts directory; `more`: submitit's parameters over these."""
    options, additional = plan.slurm, {"chdir": plan.cwd, **more.pop("additional_parameters", {})}
    executor = executor_class(folder=plan.log_dir)
    executor.update_parameters(
        job_name=f"prepare-{Path(plan.output).name}", nodes=1, ntasks_per_node=1, cpus_per_task=cpus,
        time=options.minutes, comment=COMMENT_PREFIX + str(plan.parts_dir), additional_parameters=additional,
        **({"partition": options.partition} if options.partition else {}),
        **({"account": options.account} if options.account else {}), **more,
    )  # fmt: skip
    return executor


def merge_parameters(array_id: str | None) -> dict[str, Any]:
    """The merge's: after every task of the array completed, and cancelled by Slurm when one fails (it would
    otherwise wait forever)."""
    if array_id is None:
        return {}
    return {"dependency": f"afterok:{array_id}", "additional_parameters": {"kill_on_invalid_dep": "yes"}}


def check_queue(plan: PrepPlan) -> None:
    """No queued job prepares this prefix already (its comment names the same parts directory): two would write
    the same parts."""
    comment = COMMENT_PREFIX + str(plan.parts_dir)
    rows = [line.split("|", 2) for line in (slurm_output(["squeue", "-h", "-o", "%i|%T|%k"]) or "").splitlines()]
    if jobs := [f"job {row[0]} ({row[1]})" for row in rows if len(row) == 3 and row[2] == comment]:
        raise ConfigError(f"{', '.join(jobs)} already prepare(s) {plan.output} (parts in {plan.parts_dir}): wait for "
                          "it to end or scancel it, or give another --output")  # fmt: skip


def format_groups(plan: PrepPlan, todo: list[int], jobs: dict[int, str] | None = None) -> str:
    """A line per part: its files and bytes, its first and last file, and what happens to it (its job)."""
    lines = []
    for part, (start, end) in enumerate(plan.groups):
        names = Path(plan.files[start]).name + (f" .. {Path(plan.files[end - 1]).name}" if end - start > 1 else "")
        what = "tokenized already: reused" if part not in todo else (f"job {jobs[part]}" if jobs else "to tokenize")
        lines.append(f"  part {part}: {end - start} file(s), {sum(plan.sizes[start:end]):,} bytes ({names}): {what}")
    return "\n".join(lines)


def dry_run(plan: PrepPlan, todo: list[int]) -> str:
    """The groups and both jobs' sbatch scripts, nothing submitted."""
    script = lambda ex, **extra: ex._make_submission_file_text(ex._submitit_command_str, uid="dry-run", **extra)
    array = executor(plan, plan.workers, ScriptOnlyExecutor)
    array.parameters.update({"map_count": len(todo)} if len(todo) > 1 else {})
    merge = executor(plan, 1, ScriptOnlyExecutor, **merge_parameters("ARRAY_JOB_ID" if todo else None))
    return (
        f"# hpc_train dry run: nothing submitted. {len(plan.files)} input file(s), {sum(plan.sizes):,} bytes, in "
        f"{len(plan.groups)} part(s) under {plan.parts_dir}; logs in {plan.log_dir}\n{format_groups(plan, todo)}\n"
        + (f"# ---- sbatch script of the array (its task i tokenizes the i-th part to tokenize) ----\n"
           f"{script(array)}\n" if todo else "")
        + f"# ---- sbatch script of the merge into {plan.output} ----\n{script(merge)}\n"
    )  # fmt: skip


def submit(plan: PrepPlan, todo: list[int]) -> tuple[list[submitit.Job], submitit.Job]:
    """The array over the parts to tokenize (none: the merge alone), then the merge after it; a merge that
    sbatch refuses cancels the array, which would tokenize for nothing. sbatch's refusal is the error."""
    array: list[submitit.Job] = []
    if todo:
        tasks = executor(plan, plan.workers)
        what = f"the array of {len(todo)} task(s) ({plan.workers} CPU(s) each: --workers)"
        with refused_by_sbatch(what), tasks.batch():
            array = [tasks.submit(PartTask(plan, part)) for part in todo]
    array_id = array[0].job_id.split("_")[0] if array else None
    try:
        with refused_by_sbatch("the merge"):
            merge = executor(plan, 1, **merge_parameters(array_id)).submit(MergeTask(plan))
    except BaseException:
        if array_id:
            subprocess.run(["scancel", array_id], capture_output=True)
        raise
    return array, merge


@contextmanager
def refused_by_sbatch(what: str) -> Iterator[None]:
    """sbatch's refusal (submitit's FailedJobError, its stderr) as the user's error, naming the job."""
    try:
        yield
    except FailedJobError as err:
        lines = [line.removeprefix("sbatch: error: ") for line in str(err).strip().splitlines()]
        raise UserError(f"sbatch refused {what}: {'; '.join(lines)}") from None


def submission_summary(plan: PrepPlan, todo: list[int], array: list[submitit.Job], merge: submitit.Job) -> str:
    ids = [*([array[0].job_id.split("_")[0]] if array else []), merge.job_id]
    jobs = dict(zip(todo, (job.job_id for job in array), strict=True))
    first = (f"submitted job array {ids[0]} ({len(array)} task(s)) and merge job {merge.job_id} (after it: afterok)"
             if array else f"submitted merge job {merge.job_id} (every part is tokenized already)")  # fmt: skip
    return (f"{first} into {plan.output}\n{format_groups(plan, todo, jobs)}\n  logs: {plan.log_dir}/ (<job>_0_log.out, "
            f"<job>_0_log.err)\n  follow: squeue -j {','.join(ids)}   |   sacct -j {','.join(ids)}")  # fmt: skip


def failure(what: str, job: submitit.Job, state: str, lines: int = 12) -> str:
    """A failed job's lines: what it was, its state, and its Python error from its stderr log (else the log's
    end, submitit's own lines left out)."""
    log = task_logs(job, 0)[1]
    text = log.read_text(errors="replace").splitlines() if log.is_file() else ["(no log: the job never started)"]
    text = [line for line in text if not line.startswith(("submitit ", "srun: ", "slurmstepd"))]
    raised = [i for i, line in enumerate(text) if ERROR_LINE.match(line)]  # a traceback's last line: the error
    tail = text[raised[-1] :][:lines] if raised else text[-lines:]
    return f"{what} (job {job.job_id}) ended {state}; its log {log}:\n" + "\n".join(f"  {line}" for line in tail)


def follow(plan: PrepPlan, todo: list[int], array: list[submitit.Job], merge: submitit.Job) -> str | None:
    """Wait for the array, then the merge; None when the dataset is written, else what failed and its log (a
    failed task's merge is cancelled, by Slurm or here)."""
    parts = {f"part {part}": job for part, job in zip(todo, array, strict=True)}
    failed = {name: state for name, state in wait_for_jobs(parts).items() if state != "COMPLETED"}
    if failed:
        subprocess.run(["scancel", merge.job_id], capture_output=True)
        return "\n".join(failure(name, parts[name], state) for name, state in failed.items()) + (
            f"\nthe parts that completed are kept in {plan.parts_dir}: submitting the same command again tokenizes "
            "the others alone")  # fmt: skip
    state = wait_for_jobs({"merge": merge})["merge"]
    if state != "COMPLETED":
        return failure("the merge", merge, state) + (f"\nno file of {plan.output} was written; the parts are kept in "
                                                     f"{plan.parts_dir}: submitting the same command again merges "
                                                     "them")  # fmt: skip
    return None
