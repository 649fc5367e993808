"""Shared fixtures: a small tokenized corpus and tiny-model configs."""

from __future__ import annotations

import collections
import gc
import importlib
import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hpc_train.bootstrap import STOP_SIGNALS
from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.job import JobConfig, load_config
from hpc_train.resilience.restart import RANK_IMPORTS

ROOT = Path(__file__).resolve().parents[1]

TINY_MODEL = [
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_model=64",
    "model.seq_len=32",
    "train.eval_interval=0",
    "logging.progress=none",
    "optim.warmup_steps=2",
]


def pytest_configure(config) -> None:
    """One intra-op thread in every process of the suite (this one, the ranks it launches, its Slurm jobs,
    which inherit the environment): two workers on 2 cores each run several ranks at once, and a rank taking
    both cores makes the others wait on spinning threads (tiny steps ran 4x slower so). How a real run sizes
    its threads (bootstrap.cpu_threads) is test_bootstrap's."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["HPC_TRAIN_TESTING"] = "1"  # HPC_TRAIN_FAULT is honoured (resilience/faults.py)


# The test files by their time on one worker of `make test` (2 cores), longest first: xdist hands files out in
# this order (--no-loadscope-reorder: its default orders files by test count, so a slow file of few tests,
# such as test_gpu_check's 50 s in 2 tests, went out last), so the two workers end together. Files not named
# follow, in name order; a file much slower than this says belongs higher.
SLOWEST_FIRST = (
    "test_planner",
    "test_parallel",
    "test_slurm",
    "test_resilience",
    "test_checkpoint",
    "test_zero",
    "test_moe",
    "test_gpu_check",
    "test_train",
    "test_fp8",
    "test_finetune",
    "test_expert_parallel",
    "test_docs",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's own order is kept


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, the code under test) and what a rank imports (RANK_IMPORTS: torch
    imports torch._dynamo lazily, at a run's first model build) is never garbage: frozen, the collection
    each in-process run makes at its end (bootstrap.distributed) skips it, as in the launcher's rank
    processes (without torch._dynamo's ~45k objects it took ~50 ms a run)."""
    for module in RANK_IMPORTS:
        importlib.import_module(module)
    gc.freeze()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """About 40 standard-library files, byte-level: enough samples for every test, built in well under 1 s."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "small")
    prepare_data(stdlib_sources()[:40], prefix, "byte", valid_every=10, progress=False)
    return prefix


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory) -> str:
    """Lines of standard-library files as JSON-lines documents (about 30 bytes each): most samples of a tiny
    model hold several documents (data.reset_position_ids / data.document_mask)."""
    base = tmp_path_factory.mktemp("short_documents")
    lines = [line for path in stdlib_sources()[:4] for line in path.read_text().splitlines() if line.strip()]
    (base / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:3000]))
    return prepare_data([base / "lines.jsonl"], str(base / "lines"), "byte", progress=False)["train"]


LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
{body}
"""
# local lm-eval tasks of each request kind (offline): name -> (output type, the YAML's task-specific part)
LOCAL_TASKS = {
    "local_mc": ("multiple_choice", 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
             'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm'),
    "local_next": ("loglikelihood", 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
               'target_delimiter: ""\nmetric_list:\n  - metric: acc'),
    "local_text": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
               "  - metric: word_perplexity\n  - metric: bits_per_byte"),
    "local_gen": ("generate_until", 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\ngeneration_kwargs:\n'
              '  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match'),
}  # fmt: skip


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory) -> Path:
    """A folder of `LOCAL_TASKS` (lm-eval's include_path) over lines of the standard library's sources: which of
    four endings follows a line's start, whether the space after a line's first word and a line's last character
    are the greedy ones, a few sources' rolling likelihood, and greedy completions of a line."""
    import random

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    lines = [line.strip() for line in Path(os.__file__).read_text().splitlines() if 24 <= len(line.strip()) <= 70]
    rng = random.Random(0)
    picked = rng.sample(lines, 40)
    rows = {"local_mc": [], "local_text": [], "local_gen": []}
    for i, line in enumerate(picked[:24]):
        cut = len(line) // 2
        endings = [line[cut:], *(other[len(other) // 2 :] for other in picked[24 + i % 12 : 27 + i % 12])]
        rows["local_mc"].append({"question": line[:cut], "choices": endings, "answer": 0})
    spaced, ended = rng.sample([line for line in lines if " " in line], 8), rng.sample(lines, 8)
    rows["local_next"] = [*({"question": line[: line.index(" ")], "answer": " "} for line in spaced),
                          *({"question": line[:-1], "answer": line[-1]} for line in ended)]  # fmt: skip
    rows["local_text"] = [{"text": "\n".join(picked[i : i + 6])} for i in (0, 6, 12)]
    rows["local_gen"] = [{"question": line[:-4], "answer": line[-4:]} for line in picked[30:36]]
    for name, (kind, body) in LOCAL_TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(LM_EVAL_TASK.format(name=name, data=data, kind=kind, body=body))
    return folder


def cluster_nodes_idle() -> bool:
    """The local Slurm cluster (slurm/local-cluster.sh) is up: its nodes answer sinfo, none down."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    states = out.stdout.split()
    return out.returncode == 0 and len(states) >= 2 and all(s.startswith(("idle", "mix", "alloc")) for s in states)


@pytest.fixture(scope="module")
def cluster():
    """The tests that submit real jobs: skipped without the cluster, failed in CI (which starts it)."""
    if not cluster_nodes_idle():
        message = "the local Slurm cluster is not running: `make test` starts it (slurm/local-cluster.sh start)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def make_cfg(tmp_path, small_corpus):
    def make(*overrides: str, run: str = "run") -> JobConfig:
        base = [*TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={tmp_path / run}"]
        return load_config(None, base + list(overrides))

    return make


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def wandb_offline_runs(run_dir: str | Path) -> dict[str, list[tuple[str, list[int]]]]:
    """What W&B wrote offline under run_dir/wandb, read from its files (the records of each offline-run-*/
    run-<id>.wandb, a LevelDB-style log of protobuf Records): each run id, with each of its offline
    directories and the steps (our `step`) logged there, in order."""
    import struct

    from wandb.proto import wandb_internal_pb2

    runs: dict[str, list[tuple[str, list[int]]]] = {}
    for path in sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, block, pending, steps, ids = path.read_bytes(), 7, 32768, b"", [], set()
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's trailer
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # full, first; middle and last append
            if kind not in (1, 4):
                continue
            record = wandb_internal_pb2.Record.FromString(pending)
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                steps += [int(json.loads(items["step"]))] if "step" in items else []  # W&B's own: _runtime
        (run_id,) = ids
        runs.setdefault(run_id, []).append((path.parent.name, steps))
    return runs


def read_final_model(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model_final.pt", weights_only=True)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_moe_run_matches(run_dir: str | Path, reference: list[dict], final: dict[str, torch.Tensor], label: str):
    """An MoE run against its reference's records and final weights: each step's loss (within 1e-5), gradient
    norm (relative 1e-5) and every layer's figures (loads, aux loss, drops: the same routing), and the final
    weights, routing biases included (within 1e-5)."""
    for ours, theirs in zip(read_metrics(run_dir), reference, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5), label
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), label
        for layer, figures in theirs["moe"].items():
            assert ours["moe"][layer] == pytest.approx(figures, abs=1e-5), (label, layer)
    assert max_param_diff(read_final_model(run_dir), final) < 1e-5, label


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host (on a GPU, each waits for the device), by
    `step` (the training loop's tests set it as each step starts)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.step, self.by_step = 0, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.by_step[self.step] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class CliResult:
    """What `run_cli` gives back, as subprocess.run(capture_output=True, text=True) would."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(
    *args: str, env: dict[str, str | None] | None = None, timeout_s: float = 300, cwd: Path = ROOT
) -> CliResult:
    """`hpc-train ARGS` run by the CLI's own `main` in this process, from `cwd` (the repository root), with `env`'s
    variables set (None: unset) for the call: its ranks are forks of this session's fork server, as they
    would be of the command's own, so only a new interpreter's imports are left out (about 8 s of CPU a
    command: the command's, then its fork server's). Its stdout and stderr, the ranks' included, are
    captured at the file descriptors; the environment, the working directory and the stop signals'
    handlers are as they were afterwards. Past `timeout_s` (what subprocess.run's timeout was) it raises
    TimeoutError, its ranks killed. Not for a command a test signals or kills (its launcher would be this
    process), nor a run of one rank with a fault to meet (that rank is this process too)."""
    from hpc_train.cli import main

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with ExitStack() as stack:
            saved_env, saved_handlers = dict(os.environ), {s: signal.getsignal(s) for s in STOP_SIGNALS}
            stack.callback(_restore, saved_env, saved_handlers)
            for key, value in (env or {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            stack.callback(os.chdir, os.getcwd())
            os.chdir(cwd)
            stack.enter_context(streams_to(out.fileno(), err.fileno()))
            stack.enter_context(_deadline(timeout_s, f"hpc-train {' '.join(args[:1])}"))
            try:
                main(list(args))
                code = 0
            except SystemExit as stop:  # argparse's and main's exits, as the interpreter ends on them
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
            except TimeoutError:
                raise
            except Exception:  # uncaught: its traceback, and the interpreter's status 1
                traceback.print_exc()
                code = 1
        return CliResult(code, _read(out), _read(err))


def _restore(environ: dict[str, str], handlers: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for number, handler in handlers.items():
        signal.signal(number, handler)


@contextmanager
def _deadline(seconds: float, what: str) -> Iterator[None]:
    """TimeoutError in this (the main) thread after `seconds`, the rank processes this process started
    killed: a hang the command should have detected ends the test, not the session."""

    def expire(*_) -> None:
        for process in multiprocessing.active_children():
            process.kill()
        raise TimeoutError(f"{what} still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


@contextmanager
def streams_to(out: int, err: int | None = None) -> Iterator[None]:
    """fd 1 (and fd 2, given `err`), which the launcher's rank processes inherit, and sys.stdout (sys.stderr)
    over them, onto `out` (`err`) for the block."""
    targets = {1: out} if err is None else {1: out, 2: err}
    streams = {1: "stdout", 2: "stderr"}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: (os.dup(fd), getattr(sys, streams[fd])) for fd in targets}
    for fd, target in targets.items():
        os.dup2(target, fd)
        setattr(sys, streams[fd], io.TextIOWrapper(open(os.dup(fd), "wb", 0), write_through=True))
    try:
        yield
    finally:
        for fd, (saved_fd, stream) in saved.items():
            getattr(sys, streams[fd]).close()
            setattr(sys, streams[fd], stream)
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
