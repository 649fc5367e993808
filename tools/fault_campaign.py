"""A fault campaign: many small real runs, each with a layout and one to three faults drawn at random, each
checked for what the resilience features promise: nothing lost, nothing mixed, nothing left over.

    python tools/fault_campaign.py --runs 100 --seed 1 [--out DIR]
    python tools/fault_campaign.py --short                 # CI's (tests/test_fault_campaign.py), < 60 s
    python tools/fault_campaign.py --seed 1 --runs 100 --only 17 --out again   # one run of it, met again
    options: --kinds / --without 'kind' or 'kind/phase' (as the table names them), --max-world 1|2|4

Why a campaign: each resilience feature (in-job restarts, node-local checkpoints, the spike guard, NVMe
offload, async saves, preemption) has tests of its own, but their failures hide in the combinations: a local
copy of another run read after a restart, files a killed job leaves behind, a save that dies between its
files and its commit under ZeRO-3 with async writes. A run here draws its layout (1, 2 or 4 ranks; dp, tp
and pp; a ZeRO stage; offload none, cpu or nvme; node-local checkpoints; the spike guard; async saves; a
blend of two datasets), the config checks refusing what the project does not support (drawn again before
any rank starts), then its faults from the catalogue (`KINDS`), least used so far first, so that a short
campaign covers many kinds and a long one covers them evenly. Everything is drawn up front from the seed.

Each fault is met in a job of its own (`HPC_TRAIN_FAULT` hits the first start of a job only): the job before
the next fault is preempted (SIGTERM to the launcher) once it recovered, and after the last fault the run
is relaunched until it completes. Every job is a real multi-process `hpc-train train` of the local launcher,
run by the CLI's own `main` in this process (its ranks are forks of one fork server, so a job costs a
fraction of a second, not an interpreter's imports), with HPC_TRAIN_TESTING=1; the campaign acts on a job
from its log (SIGTERM, or the whole job killed: ranks and launcher) and between jobs (a flipped byte, the
newer checkpoints deleted, the checkpoint directory on a small tmpfs).

Checked after every job, and at the run's end:
- lost: a loss of `metrics.jsonl` off the curve of the same layout run without faults (bit for bit; one
  reference per layout, and per data skipped by a spike rollback, shared by every run that draws it), a
  committed checkpoint that fails verification (sizes and checksums), or a run that does not complete;
- mixed: a resume of state this run cannot have written (a step beyond the furthest its jobs trained since
  it last started from a checkpoint, or since its user went back to one; a checkpoint outside its directory),
  or `metrics.jsonl` records that are not those of steps 1..n;
- left over: files in the run's `checkpoint.local_dir` or `optim.offload_dir` after it ended (or in
  `offload_dir` after a job was killed: on a cluster the next job is another job, which never sees them).
A fault counts once, in the worst of these (mixed, lost, left over), else as survived; one that did not fire
(no room left in its run, a point not reached, its layout failing without faults) as missed. The exit
status is 1 where any fault, or any run without faults, was not survived.

Limits: every job runs on this machine, one node: no partner copies of node-local checkpoints (a wiped node
falls back to the shared checkpoint), and a relaunch is a job of the same fork server (NVMe files are keyed
by it: what a killed job left is counted at once). A finding names the fault whose job first showed it.

Each job logs to `<out>/run<i>/job<k>.log`; `<out>/summary.json` holds every run's layout, faults, actions
and findings, `<out>/table.txt` the table; a failure is printed with its jobs' command and fault specs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch

from hpc_train.checkpoint.store import LATEST, CheckpointStore, step_dir_name
from hpc_train.cli import check_job
from hpc_train.cli import main as hpc_train
from hpc_train.config import ConfigError
from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.job import load_config
from hpc_train.resilience.restart import rank_processes

STEPS = 12  # per run: room for three faults, each in a job of its own
INTERVAL = 2  # shared checkpoints every INTERVAL steps
SPIKE_WINDOW = 3  # the spike guard's medians: it watches from step SPIKE_WINDOW + 1 on
HANG_TIMEOUT_S = 3  # parallel.hang_timeout_s of a run with a hang (x4 on a process's first step)
MAX_RESTARTS = 2  # in-job restarts of every job
JOB_TIMEOUT_S = 180  # a job still running then is killed and its run counted lost
NAME = "campaign"  # every run's name: runs of one name share node-local directories unless told apart
# CI's campaign (tests/test_fault_campaign.py): up to 2 ranks, without the frozen rank (its hang report waits
# 10 s for a stack the stopped process cannot write, then the launcher 5 s more)
SHORT = {"runs": 6, "seed": 70, "max_world": 2, "without": "hang/frozen (SIGSTOP)"}
# what CI's campaign draws before any other fault (where a layout can meet it): what its test requires
SHORT_FIRST = (("same name", "other run"), ("kill -9 rank", "local_saved"))
TINY = ["model.n_layers=2", "model.n_heads=4", "model.d_model=64", "model.seq_len=32", "train.eval_interval=0",
        "optim.warmup_steps=2", "logging.progress=lines", "train.micro_batch_size=2"]  # fmt: skip
STEP_LINE = re.compile(r"^step (\d+) \| loss", re.M)
LOCAL_RESUME = re.compile(r"resumed from the node-local checkpoints of step (\d+)")
SHARED_RESUME = re.compile(r"resumed from (\S+) \(step (\d+)")
RESTART = "restarting every rank from the newest checkpoint"
CLASSES = ("survived", "lost", "mixed", "left over", "missed")


# ---- layouts ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """What a run varies. The reference of a run is the same layout without faults."""

    world: int
    tp: int
    pp: int
    grad_accum: int
    zero: int
    offload: str
    local: bool
    spike_guard: bool
    async_save: bool
    blend: bool

    def features(self) -> set[str]:
        """The layout's features a fault kind may need."""
        flags = {
            "local": self.local,
            "spike": self.spike_guard,
            "async": self.async_save,
            "nvme": self.offload == "nvme",
        }
        return {name for name, on in flags.items() if on}

    def overrides(self, data: dict[str, str]) -> list[str]:
        """The layout as `hpc-train train` overrides (no directories: `Dirs.overrides`)."""
        items = [f"parallel.nproc={self.world}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                 f"train.grad_accum={self.grad_accum}", f"optim.zero_stage={self.zero}",
                 f"optim.offload={self.offload}", f"checkpoint.async_save={str(self.async_save).lower()}"]  # fmt: skip
        if self.local:
            items.append("checkpoint.local_interval=1")
        if self.spike_guard:
            items += ["train.spike_guard.enabled=true", f"train.spike_guard.window={SPIKE_WINDOW}"]
        if self.blend:
            items.append(f"data.sources=[{{name: a, path: {data['a']}, weight: 1}}, "
                         f"{{name: b, path: {data['b']}, weight: 2}}]")  # fmt: skip
        else:
            items.append(f"data.train_path={data['all']}")
        return items

    def describe(self) -> str:
        parts = [f"world {self.world} (tp {self.tp}, pp {self.pp})", f"zero {self.zero}", f"offload {self.offload}"]
        parts += [name for name, on in (("local", self.local), ("spike guard", self.spike_guard),
                                         ("async", self.async_save), ("blend", self.blend)) if on]  # fmt: skip
        return ", ".join(parts)


@dataclass(frozen=True)
class Dirs:
    """A run's directories (a decoy's and a reference's too)."""

    run: Path
    local: Path
    offload: Path

    def overrides(self, layout: Layout) -> list[str]:
        items = [f"run_dir={self.run}"]
        if layout.local:
            items.append(f"checkpoint.local_dir={self.local}")
        if layout.offload == "nvme":
            items.append(f"optim.offload_dir={self.offload}")
        return items


def base_overrides() -> list[str]:
    return [*TINY, f"name={NAME}", f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}",
            f"parallel.max_restarts={MAX_RESTARTS}"]  # fmt: skip


def draw_layout(rng: random.Random, data: dict[str, str], scratch: Path, max_world: int) -> Layout:
    """A layout the config checks accept (drawn again until one is), checked as `train` here would."""
    for _ in range(200):
        world = rng.choice([w for w in (1, 2, 2, 4) if w <= max_world])
        tp = rng.choice([d for d in (1, 2, 4) if world % d == 0])
        pp = rng.choice([d for d in (1, 2) if (world // tp) % d == 0])
        layout = Layout(world, tp, pp, rng.choice([1, 2]), rng.randrange(4), rng.choice(["none", "cpu", "nvme"]),
                        rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.4)  # fmt: skip
        if accepted(layout, data, scratch):
            return layout
    raise RuntimeError("no layout the config checks accept in 200 draws")


def accepted(layout: Layout, data: dict[str, str], scratch: Path) -> bool:
    """Whether `hpc-train train` would start this layout here (its config and layout checks, no data read)."""
    dirs = Dirs(scratch / "run", scratch / "local", scratch / "nvme")
    try:
        cfg = load_config(None, [*base_overrides(), *layout.overrides(data), *dirs.overrides(layout)])
        check_job(cfg, layout.world, starts_here=True, check_paths=False)
    except ConfigError:
        return False
    return True


# ---- fault kinds ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """A row of the table. `needs`: the layout features it needs ('local', 'nvme', 'async', 'spike');
    `place`: 'first' or 'last' in its run, else anywhere; `rank0`: only rank 0 meets it."""

    kind: str
    phase: str
    needs: frozenset[str] = frozenset()
    place: str = ""
    rank0: bool = False

    @property
    def label(self) -> tuple[str, str]:
        return self.kind, self.phase


def _kill(phase: str, needs: tuple[str, ...] = (), place: str = "", rank0: bool = False) -> Kind:
    return Kind("kill -9 rank", phase, frozenset(needs), place, rank0)


# phases of a kill: fault points of the code (grep fault_point): batch = forward (before it), compute = after
# backward, mid_step = before the gradient reduction and update, save .. committed = a checkpoint's save and
# commit (committed: just before the older ones are pruned), pruned = inside the prune of older shared
# checkpoints (renamed, not yet deleted), local_saved = after a node-local save and its prune began,
# nvme_written = inside the update, after the NVMe files were written
KINDS = (
    _kill("batch"), _kill("compute"), _kill("mid_step"), _kill("save"), _kill("staged", ("async",)),
    _kill("mid_write"), _kill("before_manifest", rank0=True), _kill("before_latest", rank0=True),
    _kill("committed", rank0=True), _kill("pruned", rank0=True), _kill("local_saved", ("local",)),
    _kill("nvme_written", ("nvme",)), _kill("resume"), _kill("finished", place="last"),
    _kill("consolidate", place="last"),
    Kind("out of memory", "compute"),
    Kind("hang", "mid_step"), Kind("hang", "frozen (SIGSTOP)"),
    Kind("SIGTERM preemption", "training"),
    Kind("job killed (node crash)", "training"), Kind("job killed (node crash)", "nvme update", frozenset({"nvme"})),
    Kind("corrupt file", "shared checkpoint"), Kind("corrupt file", "local copy", frozenset({"local"})),
    Kind("local dir wiped", "local_saved", frozenset({"local"})),
    Kind("ENOSPC", "checkpoint save"),  # missed where this process may not mount a tmpfs
    Kind("loss spike", "batch", frozenset({"spike"})),
    Kind("same name", "went back", place="first"), Kind("same name", "other run", frozenset({"local"}), "first"),
)  # fmt: skip
ONCE = {"loss spike", "same name", "ENOSPC"}  # kinds met at most once in a run


@dataclass
class Fault:
    """A drawn fault and what became of it."""

    entry: Kind
    rank: int
    offset: int  # steps after the job's resume point
    status: str = ""
    findings: list[str] = field(default_factory=list)  # "<class>: text"
    fired: bool = False
    specs: list[str] = field(default_factory=list)

    def note(self, kind: str, text: str) -> None:
        self.findings.append(f"{kind}: {text}")

    def classify(self) -> str:
        found = {line.split(":", 1)[0] for line in self.findings}
        worst = next((kind for kind in ("mixed", "lost", "left over") if kind in found), None)
        return worst or ("survived" if self.fired else "missed")


@dataclass
class Plan:
    index: int
    layout: Layout
    faults: list[Fault]


def draw_faults(rng: random.Random, layout: Layout, used: Counter, kinds: list[Kind]) -> list[Fault]:
    """One to three faults of `kinds` the layout can meet, the least used so far first (ties at random), in
    run order."""
    have, chosen = layout.features(), []
    for _ in range(rng.randint(1, 3)):
        taken = {k.kind for k in chosen if k.kind in ONCE} | {k.place for k in chosen if k.place}
        eligible = [k for k in kinds if k.needs <= have and k not in chosen and not {k.kind, k.place} & taken]
        if not eligible:
            break
        fewest = min(used[k.label] for k in eligible)
        pick = rng.choice([k for k in eligible if used[k.label] == fewest])
        used[pick.label] += 1
        chosen.append(pick)
    chosen.sort(key=lambda k: {"first": 0, "": 1, "last": 2}[k.place])
    return [Fault(k, 0 if k.rank0 else rng.randrange(layout.world), rng.choice([1, 2])) for k in chosen]


def draw_plans(
    seed: int,
    runs: int,
    data: dict[str, str],
    scratch: Path,
    kinds: list[Kind],
    max_world: int,
    first: tuple[tuple[str, str], ...] = (),
) -> list[Plan]:
    """Every run's layout and faults, drawn up front from `seed` alone (a run can be met again alone: --only);
    a layout that can meet none of `kinds` (say `--kinds wipe` without local checkpoints) is drawn again.
    The faults labelled `first` count as used less than any other: drawn as soon as a layout can meet them."""
    rng, used = random.Random(seed), Counter(dict.fromkeys(first, -1))
    plans = []
    for index in range(runs):
        faults: list[Fault] = []
        while not faults:
            layout = draw_layout(rng, data, scratch, max_world)
            faults = draw_faults(rng, layout, used, kinds)
        plans.append(Plan(index, layout, faults))
    return plans


def select_kinds(names: str | None, without: str | None) -> list[Kind]:
    """The catalogue, or the kinds `names` names ('kind' or 'kind/phase', comma separated), less those
    `without` names."""

    def named(kind: Kind, listed: str) -> bool:
        wanted = {name.strip() for name in listed.split(",")}
        return kind.kind in wanted or f"{kind.kind}/{kind.phase}" in wanted

    kinds = [k for k in KINDS if not (without and named(k, without))]
    kinds = [k for k in kinds if named(k, names)] if names else kinds
    if not kinds:
        raise SystemExit(f"--kinds {names}: none of {sorted({f'{k.kind}/{k.phase}' for k in KINDS})}")
    return kinds


# ---- one job ------------------------------------------------------------------------------------------------
class JobKilled(BaseException):
    """The campaign killed the whole job, launcher and ranks (a node crash, `scancel --signal=KILL`)."""


class JobTimeout(BaseException):
    """A job ran past JOB_TIMEOUT_S: its ranks are killed."""


@dataclass
class Watch:
    """What the campaign does to a running job, from the job's own log (the records rank 0 prints): once a
    line matching `after` was printed (e.g. the launcher's restart: the job recovered) and a step of at least
    `step` was recorded after it, send the launcher SIGTERM (`term`, again every second until the job ends: one
    sent while no rank runs reaches none) or kill the whole job (`kill`)."""

    action: str
    step: int
    after: str | None = None


class Watcher:
    def __init__(self, watch: Watch | None, log: Path):
        self.watch, self.log = watch, log
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="campaign-watch", daemon=True)

    def __enter__(self) -> Watcher:
        if self.watch is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()

    def due(self) -> bool:
        text = self.log.read_text(errors="replace")
        if self.watch.after is not None:
            found = re.search(self.watch.after, text)
            if found is None:
                return False
            text = text[found.end() :]
        return any(int(m.group(1)) >= self.watch.step for m in STEP_LINE.finditer(text))

    def _run(self) -> None:
        while not self.done.wait(0.02):
            if not self.due():
                continue
            if self.watch.action == "kill":
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            while not self.done.is_set():
                os.kill(os.getpid(), signal.SIGTERM)
                self.done.wait(1.0)


def read_records(metrics: Path) -> list[dict]:
    """The whole records of a `metrics.jsonl` (being written: a partial last line is left out)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


@dataclass
class Job:
    code: int | str  # the CLI's exit status, or 'killed' / 'timeout'
    log: str


@contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    saved = dict(os.environ)
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def output_to(path: Path) -> Iterator[None]:
    """fds 1 and 2, which the ranks inherit from the launcher, into `path` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _kill_ranks() -> None:
    for process in multiprocessing.active_children():
        with suppress(OSError):
            process.kill()


@contextmanager
def job_signals(timeout_s: float) -> Iterator[None]:
    """Within the block SIGUSR1 (the watcher's) kills the whole job: its ranks, then the launcher (this
    process's `main`, by JobKilled); past `timeout_s` likewise, by JobTimeout."""

    def kill_job(*_: Any) -> None:
        _kill_ranks()
        raise JobKilled

    def expire(*_: Any) -> None:
        _kill_ranks()
        raise JobTimeout

    previous = {
        signal.SIGUSR1: signal.signal(signal.SIGUSR1, kill_job),
        signal.SIGALRM: signal.signal(signal.SIGALRM, expire),
    }
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in previous.items():
            signal.signal(number, handler)
        for process in multiprocessing.active_children():  # a killed job's ranks, reaped
            process.kill()
            process.join()


def run_job(args: list[str], log: Path, spec: str = "", watch: Watch | None = None) -> Job:
    """`hpc-train train ARGS` with HPC_TRAIN_FAULT=`spec`, its output appended to `log`, `watch` acting on it."""
    env = {"HPC_TRAIN_TESTING": "1", "HPC_TRAIN_FAULT": spec or None, "OMP_NUM_THREADS": "1"}
    code: int | str = 0
    log.write_text("")
    with environment(env), output_to(log), Watcher(watch, log):
        print(f"$ HPC_TRAIN_TESTING=1 HPC_TRAIN_FAULT={spec} hpc-train train {' '.join(args)}", flush=True)
        try:
            with job_signals(JOB_TIMEOUT_S):
                hpc_train(["train", *args])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except JobKilled:
            code = "killed"
        except JobTimeout:
            code = "timeout"
        except Exception:  # the launcher's own error (a rank's failure past max_restarts): the job failed
            traceback.print_exc()
            code = 1
        print(f"# job ended: {code}", flush=True)
    return Job(code, log.read_text(errors="replace"))


# ---- references ------------------------------------------------------------------------------------------
@dataclass
class Reference:
    losses: list[float] | None  # None: the layout failed without faults
    checkpoint_bytes: int  # one checkpoint, in tmpfs pages
    left_over: list[str]
    log: Path


# ---- a run --------------------------------------------------------------------------------------------------
class Run:
    """One run of the campaign: its jobs, the campaign's actions between them, and what was found."""

    def __init__(self, campaign: Campaign, plan: Plan):
        self.campaign, self.plan, self.layout = campaign, plan, plan.layout
        self.home = campaign.out / f"run{plan.index:03d}"
        self.dirs = Dirs(self.home / "run", self.home / "local", self.home / "nvme")
        self.ckpt = self.dirs.run / "checkpoints"
        self.metrics = self.dirs.run / "metrics.jsonl"
        self.jobs = 0
        self.reach = 0  # the furthest step this run's current line of jobs trained (a resume may not pass it)
        self.actions: list[str] = []
        self.corrupted: dict[str, float] = {}  # checkpoints this campaign damaged: path -> manifest time
        self.foreign: set[tuple[str, int, int]] = set()  # a decoy's files: (path, size, mtime)
        self.hang = any(f.entry.kind == "hang" for f in plan.faults)
        self.noted: set[tuple[str, str]] = set()
        self.current = plan.faults[0]  # the fault being met: a finding of a later relaunch is its

    def args(self, dirs: Dirs | None = None, extra: tuple[str, ...] = ()) -> list[str]:
        hang = [f"parallel.hang_timeout_s={HANG_TIMEOUT_S}"] if self.hang else []
        data = self.campaign.data
        return [*base_overrides(), *self.layout.overrides(data), *(dirs or self.dirs).overrides(self.layout), *hang,
                *extra]  # fmt: skip

    # ---- jobs
    def job(self, fault: Fault, spec: str = "", watch: Watch | None = None, fault_step: int = 0) -> Job:
        """A job of this run, its resumes checked against how far the run's line of jobs reached."""
        self.jobs += 1
        log = self.home / f"job{self.jobs}.log"
        began = time.monotonic()
        done = run_job(self.args(), log, spec, watch)
        what = f"HPC_TRAIN_FAULT={spec}" if spec else "no fault"
        if watch:
            what += f"; {'SIGTERM' if watch.action == 'term' else 'kill -9 of the job'} at step >= {watch.step}"
            what += f" after a '{watch.after}' record" if watch.after else ""
        self.actions.append(f"job {self.jobs} ({log.name}): {what} -> {done.code} in {time.monotonic() - began:.1f} s")
        if spec:
            fault.specs.append(spec)
        if done.code == "timeout":
            self.note(fault, "lost", f"job {self.jobs} still ran after {JOB_TIMEOUT_S} s (a hang nothing stopped)")
        self.check_resumes(fault, done.log, fault_step)
        self.check_state(fault)
        return done

    def check_resumes(self, fault: Fault, log: str, fault_step: int) -> None:
        """Mixed: a resume of a step this run's line of jobs never reached (the first start of a job: the reach
        so far; an in-job restart: also the failed start's fault step and the step after its last record), or of
        a checkpoint outside the run's directory."""
        printed, restarted = 0, False
        for line in log.splitlines():
            if match := STEP_LINE.match(line):
                printed = max(printed, int(match.group(1)))
            elif RESTART in line:
                restarted = True
            elif resumed := resume_in(line):
                step, where = resumed
                # a rollback's resume comes after steps of the job, a restart's after its failed start's
                bound = max(self.reach, printed + 1 if printed else 0, fault_step if restarted else 0)
                if step > bound:
                    beyond = f"beyond step {bound}, the furthest this run's jobs trained since it last started"
                    self.note(fault, "mixed", f"resumed step {step} from {where}, {beyond}")
                if where != "node-local copies" and not where.startswith(str(self.ckpt)):
                    self.note(fault, "mixed", f"resumed from {where}, not a checkpoint of this run")
        self.reach = max(self.reach, printed + 1)

    def note(self, fault: Fault, kind: str, text: str) -> None:
        """A finding, on the fault whose job first showed it (a later job of the run sees it again)."""
        if (kind, text) not in self.noted:
            self.noted.add((kind, text))
            fault.note(kind, text)

    def check_state(self, fault: Fault) -> None:
        """Mixed: records that are not those of steps 1..n, once each (another start's left among them). Lost:
        a loss off the reference's curve at its step; a committed checkpoint that fails verification (those
        the campaign damaged excepted, until a save replaces them)."""
        records = read_records(self.metrics)
        steps = [r["step"] for r in records]
        if (wrong := next((i for i, step in enumerate(steps) if step != i + 1), None)) is not None:
            self.note(fault, "mixed", f"metrics.jsonl's record {wrong + 1} is of step {steps[wrong]} (steps "
                                      f"{steps[: wrong + 2]}...): records of another start left in it")  # fmt: skip
        reference = self.campaign.reference(self.layout, skipped(records))
        for record in records if reference.losses is not None else []:
            loss = reference.losses[record["step"] - 1] if 1 <= record["step"] <= STEPS else None
            if record["loss"] != loss:
                self.note(fault, "lost", f"step {record['step']}: loss {record['loss']!r}, uninterrupted {loss!r}")
                break
        store = CheckpointStore(self.ckpt)
        for info in store.scan():
            if info.problem is not None:  # a .tmp save, never committed
                continue
            checked = store.verify(info, full=True)
            damaged = self.corrupted.get(str(info.path)) == manifest_time(info.path)
            if checked.problem and not damaged:
                self.note(fault, "lost", f"committed checkpoint {info.path.name} fails verification: {checked.problem}")

    def newest_committed(self) -> int:
        store = CheckpointStore(self.ckpt)
        return next((info.step for info in store.candidates(lambda _: None)), 0)

    def complete(self) -> bool:
        """Trained to its last step (whether its records are right is `check_state`'s)."""
        records = read_records(self.metrics)
        return bool(records) and records[-1]["step"] == STEPS

    # ---- the run
    def execute(self) -> None:
        """Each fault in its turn, then relaunches until the run completes; nothing where the layout fails
        without faults (the no-fault row of the table counts that)."""
        if self.campaign.reference(self.layout, ()).losses is None:
            for fault in self.plan.faults:
                fault.note("missed", "not met: the layout fails without faults (the reference run)")
                fault.status = fault.classify()
            return
        broken = None
        for i, fault in enumerate(self.plan.faults):
            if broken is not None:  # the run's state is not what the next fault should meet
                fault.note("missed", f"not met: the fault before it was {broken}")
                continue
            self.current = fault
            try:
                INJECT[fault.entry.kind](self, fault, i == len(self.plan.faults) - 1)
            except NoRoom as why:
                fault.note("missed", str(why))
            broken = next((k for k in ("mixed", "lost") if any(f.startswith(k) for f in fault.findings)), None)
        self.finish(self.current)

    def finish(self, fault: Fault) -> None:
        """Relaunch until the run completes (three tries); then the final checks."""
        for _ in range(3):
            if self.complete():
                break
            self.job(fault)
        if not self.complete():
            self.note(
                fault, "lost", f"the run did not complete: steps {[r['step'] for r in read_records(self.metrics)]}"
            )
        left = leftovers([self.dirs.local, self.dirs.offload], self.foreign)
        for f in self.plan.faults:
            if left:
                f.note("left over", f"after the run: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}")
            f.status = f.classify()


def resume_in(line: str) -> tuple[int, str] | None:
    """(step, where from) of a resume's log line."""
    if local := LOCAL_RESUME.search(line):
        return int(local.group(1)), "node-local copies"
    if shared := SHARED_RESUME.search(line):
        return int(shared.group(2)), shared.group(1)
    return None


class NoRoom(Exception):
    """The fault's step would lie past the run's end (or a kind's precondition is not met): it is missed."""


def skipped(records: list[dict]) -> tuple[tuple[int, int], ...]:
    """The sample ranges a spike rollback skipped, from the records that name one."""
    return tuple(tuple(r["skipped_samples"]) for record in records for r in record.get("rollback", []))


def manifest_time(path: Path) -> float:
    try:
        return json.loads((path / "manifest.json").read_text())["created"]
    except (OSError, ValueError, KeyError):
        return -1.0


def leftovers(roots: list[Path], foreign: set[tuple[str, int, int]] = frozenset()) -> list[str]:
    """Every file under `roots` (directories alone are not counted), those of `foreign` unchanged excepted."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")) if root.exists() else []:
            if path.is_dir() and not path.is_symlink():
                continue
            stat = path.lstat()
            if (str(path), stat.st_size, stat.st_mtime_ns) not in foreign:
                found.append(str(path))
    return found


def snapshot(root: Path) -> set[tuple[str, int, int]]:
    return {(str(p), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*") if not p.is_dir()}


# ---- injecting each kind ---------------------------------------------------------------------------------
def fired(fault: Fault, job: Job, pattern: str) -> None:
    if re.search(pattern, job.log):
        fault.fired = True
    else:
        fault.note("missed", f"no sign of it in the job's log (/{pattern}/)")


def step_for(run: Run, fault: Fault, last: bool, save: str = "", least: int = 1) -> int:
    """The fault's step: `offset` steps after the job's resume point (at least `least`), a step with a shared
    save (`save="shared"`) or with a node-local one (`"local"`: the steps between shared saves), leaving a
    step after it for the recovery to be seen unless the fault is the run's last."""
    start = run.newest_committed()
    step = max(start + fault.offset, least)
    if save == "shared":
        step = -(-step // INTERVAL) * INTERVAL
    if save == "local" and step % INTERVAL == 0:
        step += 1
    if step > (STEPS if last else STEPS - 2) or (save == "local" and step >= STEPS):
        raise NoRoom(f"step {step} is past the room left (resume point {start}, {STEPS} steps)")
    return step


ROLLED_BACK = "rolled back to the checkpoint"


def recovered(step: int, last: bool, after: str | None = RESTART) -> Watch | None:
    """The next job's start: preempt this one once it recovered (the log's `after`) and trained the fault's
    step again; none after the run's last fault."""
    return None if last else Watch("term", step, after)


def inject_kill(run: Run, fault: Fault, last: bool) -> None:
    point, rank = fault.entry.phase, fault.rank
    if point == "resume":
        ensure_resume_point(run, fault, last)
        start = run.newest_committed()
        job = run.job(fault, f"resume@0@{rank}", recovered(start + 1, last), start)
        return fired(fault, job, "was killed by SIGKILL")
    saving = point in ("save", "staged", "mid_write", "before_manifest", "before_latest", "committed", "pruned")
    save = "shared" if saving else "local" if point == "local_saved" else ""
    step = STEPS if fault.entry.place == "last" else step_for(run, fault, last, save)
    job = run.job(fault, f"{point}@{step}@{rank}", recovered(step, last), step)
    fired(fault, job, "was killed by SIGKILL")


def ensure_resume_point(run: Run, fault: Fault, last: bool) -> None:
    """A job that resumes needs a checkpoint: where there is none yet, a first job is preempted after one."""
    if run.newest_committed() == 0:
        run.job(fault, watch=Watch("term", INTERVAL + 1))
    if not 0 < run.newest_committed() < (STEPS if last else STEPS - 2):
        raise NoRoom("no checkpoint to resume from, or no room after it")


def inject_oom(run: Run, fault: Fault, last: bool) -> None:
    step = step_for(run, fault, last)
    job = run.job(fault, f"compute@{step}@{fault.rank}@oom", recovered(step, last), step)
    fired(fault, job, "out of memory")


def inject_hang(run: Run, fault: Fault, last: bool) -> None:
    """A rank hangs (or is frozen) in a step that is not its process's first (that one has 4x the time)."""
    how = "hang" if fault.entry.phase == "mid_step" else "stop"
    step = step_for(run, fault, last, least=run.newest_committed() + 2)
    job = run.job(fault, f"mid_step@{step}@{fault.rank}@{how}", recovered(step, last), step)
    fired(fault, job, "exited with status 3|stopped a hung run")


def inject_preemption(run: Run, fault: Fault, last: bool) -> None:
    step = step_for(run, fault, last)
    job = run.job(fault, watch=Watch("term", step))
    fired(fault, job, "stop signal received")


def inject_job_kill(run: Run, fault: Fault, last: bool) -> None:
    if fault.entry.phase == "nvme update":
        return kill_in_nvme_update(run, fault, last)
    step = step_for(run, fault, last)
    job = run.job(fault, watch=Watch("kill", step))
    fault.fired = job.code == "killed"
    check_dead_job_files(run, fault)


def check_dead_job_files(run: Run, fault: Fault) -> None:
    """A killed job's NVMe files: on a cluster the next job is another job and never sees them."""
    if left := leftovers([run.dirs.offload]):
        fault.note("left over", f"the killed job left {len(left)} files in optim.offload_dir: {left[0]}")


def inject_corrupt(run: Run, fault: Fault, last: bool) -> None:
    {"shared checkpoint": corrupt_shared, "local copy": corrupt_local}[fault.entry.phase](run, fault, last)


def corrupt_shared(run: Run, fault: Fault, last: bool) -> None:
    """A job preempted after two saves; a byte of the newest checkpoint's largest file flipped; the next job
    must pass over it (checksums) and resume from an older one, which it then saves again."""
    step = step_for(run, fault, last, "shared", least=run.newest_committed() + INTERVAL + fault.offset)
    run.job(fault, watch=Watch("term", step))
    newest = run.newest_committed()
    if newest == 0:
        raise NoRoom("no committed checkpoint to corrupt")
    path = run.ckpt / step_dir_name(newest)
    victim = max((p for p in path.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    flip_byte(victim)
    run.corrupted[str(path)] = manifest_time(path)
    run.actions.append(f"flipped a byte of {victim}")
    job = run.job(fault, watch=recovered(newest, last, after=None))
    fired(fault, job, rf"{step_dir_name(newest)} skipped: .*(checksum|corrupt)")
    if re.search(rf"resumed from \S*{step_dir_name(newest)} ", job.log):
        fault.note("lost", f"resumed from the damaged {path.name}")


def corrupt_local(run: Run, fault: Fault, last: bool) -> None:
    """A byte of a rank's own local copy flipped after its save, and a rank killed in the next step: the
    restart passes over that copy (to the partner's, or an older step)."""
    step = step_for(run, fault, last, "local")
    if step + 1 > (STEPS if last else STEPS - 2):
        raise NoRoom(f"no step after {step} to kill a rank in")
    victim = run.plan.index % run.layout.world  # any rank may be the one killed
    spec = f"local_saved@{step}@{fault.rank}@corrupt,mid_step@{step + 1}@{victim}"
    job = run.job(fault, spec, recovered(step + 1, last), step + 1)
    fired(fault, job, "passed over")


def kill_in_nvme_update(run: Run, fault: Fault, last: bool) -> None:
    """The whole job killed inside an update, after it wrote the NVMe files: nothing may be left in
    optim.offload_dir (on a cluster the next job is another job, which would never delete them)."""
    step = step_for(run, fault, last, least=2)  # killed while a rank waits after its write of `step`
    job = run.job(fault, f"nvme_written@{step}@{fault.rank}@late", Watch("kill", step - 1))
    fault.fired = job.code == "killed"
    check_dead_job_files(run, fault)


def inject_wipe(run: Run, fault: Fault, last: bool) -> None:
    step = step_for(run, fault, last, "local")
    job = run.job(fault, f"local_saved@{step}@{fault.rank}@wipe", recovered(step, last), step)
    fired(fault, job, "was killed by SIGKILL")


def inject_spike(run: Run, fault: Fault, last: bool) -> None:
    """A poisoned batch once the guard watches: rolled back in the job, no restart (the batch's number is
    the step's while nothing was skipped before)."""
    step = step_for(run, fault, last, least=max(SPIKE_WINDOW + 2, run.newest_committed() + 1))
    job = run.job(fault, f"batch@{step}@0@spike", recovered(step, last, after=ROLLED_BACK), step)
    fired(fault, job, "loss spike at step")


def inject_enospc(run: Run, fault: Fault, last: bool) -> None:
    """The checkpoint directory on a tmpfs with room for what it holds and half a checkpoint: the next save
    fails; the operator then moves it back to a large disk and the run is relaunched."""
    if not run.campaign.can_mount:
        raise NoRoom("this process may not mount a tmpfs (root may)")
    per_checkpoint = run.campaign.reference(run.layout, ()).checkpoint_bytes
    run.ckpt.mkdir(parents=True, exist_ok=True)
    size = disk_usage(run.ckpt) + per_checkpoint // 2 + 64 * 1024
    with small_filesystem(run.ckpt, size):
        run.actions.append(f"checkpoint.dir on a tmpfs of {size} bytes")
        job = run.job(fault)
    run.actions.append("checkpoint.dir moved back to the disk")
    fired(fault, job, "No space left")


def inject_same_name(run: Run, fault: Fault, last: bool) -> None:
    (went_back if fault.entry.phase == "went back" else other_run)(run, fault, last)


def went_back(run: Run, fault: Fault, last: bool) -> None:
    """A job killed whole (its node-local copies stay), the user deletes the checkpoints after an earlier one
    and reruns: a rank killed right after must restart from that one, not from a newer node-local copy."""
    start = run.newest_committed()
    if start + 6 > STEPS:
        raise NoRoom("no room for a job, a step back and a kill")
    run.job(fault, watch=Watch("kill", start + 4 + fault.offset // 2))
    store = CheckpointStore(run.ckpt)
    steps = sorted(info.step for info in store.candidates(lambda _: None))
    earlier = [s for s in steps if s <= run.reach - 3] or steps[:1]
    if not earlier:
        raise NoRoom("no checkpoint to go back to")
    back = earlier[-1]
    for info in store.scan():
        if info.step > back:
            shutil.rmtree(info.path)
    (run.ckpt / LATEST).write_text(step_dir_name(back) + "\n")
    run.actions.append(f"went back: deleted the checkpoints after step {back}, latest -> {step_dir_name(back)}")
    run.reach = back
    job = run.job(fault, f"mid_step@{back + 1}@{fault.rank}", recovered(back + 1, last), back + 1)
    fired(fault, job, "was killed by SIGKILL")


def other_run(run: Run, fault: Fault, last: bool) -> None:
    """Another run of the same name on the node (its own run_dir, another learning rate) was killed whole
    after 6 steps; then this run's rank is killed at step 3: its restart must not take the other's copies."""
    decoy = Dirs(run.home / "decoy", run.dirs.local, run.home / "decoy_nvme")
    log = run.home / "decoy.log"
    args = run.args(decoy, ("optim.lr=1e-3",))
    done = run_job(args, log, watch=Watch("kill", 6))
    run.actions.append(f"another run of the same name ({log.name}): killed whole at step >= 6 -> {done.code}")
    run.foreign = snapshot(run.dirs.local)
    job = run.job(fault, f"mid_step@3@{fault.rank}", recovered(3, last), 3)
    fired(fault, job, "was killed by SIGKILL")


INJECT: dict[str, Callable[[Run, Fault, bool], None]] = {
    "kill -9 rank": inject_kill, "out of memory": inject_oom, "hang": inject_hang,
    "SIGTERM preemption": inject_preemption, "job killed (node crash)": inject_job_kill, "corrupt file": inject_corrupt,
    "local dir wiped": inject_wipe, "loss spike": inject_spike, "ENOSPC": inject_enospc, "same name": inject_same_name,
}  # fmt: skip


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]) if byte else b"\0")


# ---- a small filesystem -----------------------------------------------------------------------------------
def disk_usage(root: Path) -> int:
    """Bytes `root`'s files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in root.rglob("*") if p.is_file())


def can_mount(scratch: Path) -> bool:
    """Whether this process may mount a tmpfs (root, outside a container that forbids it)."""
    probe = scratch / "mount_probe"
    probe.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True)
    except OSError:  # no mount command
        return False
    if mounted.returncode == 0:
        subprocess.run(["umount", str(probe)], check=True)
    probe.rmdir()
    return mounted.returncode == 0


@contextmanager
def small_filesystem(directory: Path, size: int) -> Iterator[None]:
    """`directory`, its contents kept, on a tmpfs of `size` bytes for the block, then back on its disk."""
    aside = directory.with_name(directory.name + ".aside")
    directory.rename(aside)
    directory.mkdir()
    mounted = False
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
        mounted = True
        shutil.copytree(aside, directory, dirs_exist_ok=True)
        shutil.rmtree(aside)  # from here the tmpfs holds the only copy
        yield
    finally:
        if mounted and not aside.exists():
            shutil.copytree(directory, aside)
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)
        shutil.copytree(aside, directory, dirs_exist_ok=True)
        shutil.rmtree(aside)


# ---- the campaign -----------------------------------------------------------------------------------------
class Campaign:
    def __init__(self, out: Path):
        self.out = out
        self.can_mount = can_mount(out)
        self.data = prepare_corpora(out / "data")
        self.references: dict[tuple, Reference] = {}

    def reference(self, layout: Layout, skip: tuple[tuple[int, int], ...]) -> Reference:
        """The run of `layout` without faults (skipping `skip`'s samples from the start), run once and shared."""
        key = (layout, skip)
        if key not in self.references:
            home = self.out / "references" / f"ref{len(self.references):03d}"
            dirs = Dirs(home / "run", home / "local", home / "nvme")
            extra = [f"data.skip_samples={[list(r) for r in skip]}"] if skip else []
            args = [*base_overrides(), *layout.overrides(self.data), *dirs.overrides(layout), *extra]
            home.mkdir(parents=True, exist_ok=True)
            job = run_job(args, home / "job.log")
            records = read_records(dirs.run / "metrics.jsonl")
            ok = job.code == 0 and [r["step"] for r in records] == list(range(1, STEPS + 1))
            newest = max((p for p in (dirs.run / "checkpoints").glob("step_*")), default=None)
            size = disk_usage(newest) if newest else 0
            left = leftovers([dirs.local, dirs.offload])
            self.references[key] = Reference([r["loss"] for r in records] if ok else None, size, left, home / "job.log")
        return self.references[key]


def prepare_corpora(base: Path) -> dict[str, str]:
    """Three small byte-level datasets of standard-library files: all 40 files, and two halves to blend."""
    files = stdlib_sources()[:40]
    prefixes = {"all": files, "a": files[:20], "b": files[20:]}
    out = {}
    for name, sources in prefixes.items():
        prefix = base / name
        if not Path(f"{prefix}.idx").exists():
            prepare_data(sources, str(prefix), "byte", progress=False)
        out[name] = str(prefix)
    return out


# ---- the report --------------------------------------------------------------------------------------------
def table(plans: list[Plan], references: list[Reference]) -> str:
    counts: dict[tuple[str, str], Counter] = {k.label: Counter() for k in KINDS}
    for plan in plans:
        for fault in plan.faults:
            counts[fault.entry.label][fault.status] += 1
    rows = [(kind, phase, c) for (kind, phase), c in counts.items() if sum(c.values())]
    total = sum((c for _, _, c in rows), Counter())
    fault_free = Counter("lost" if r.losses is None else "left over" if r.left_over else "survived" for r in references)
    head = f"{'kind':<24} {'phase':<18} {'faults':>6} " + " ".join(f"{c:>9}" for c in CLASSES)
    lines = [head, "-" * len(head)]
    for kind, phase, c in [*rows, ("total", "", total), ("no fault", "reference runs", fault_free)]:
        if kind == "total":
            lines.append("-" * len(head))
        injected = sum(c[k] for k in CLASSES if k != "missed")
        lines.append(f"{kind:<24} {phase:<18} {injected:>6} " + " ".join(f"{c[k]:>9}" for k in CLASSES))
    return "\n".join(lines)


def failures(runs: list[Run], campaign: Campaign, again: str) -> list[str]:
    """Each run with a fault not survived (nor missed): its findings, what the campaign did, the command of its
    jobs and how to meet it again (`again`: the campaign's options)."""
    lines = []
    for run in runs:
        bad = [f for f in run.plan.faults if f.status not in ("survived", "missed")]
        if not bad:
            continue
        lines.append(f"run {run.plan.index} ({run.layout.describe()}); again: {again} --only {run.plan.index}")
        shown: set[str] = set()
        for fault in bad:
            lines.append(f"  {fault.entry.kind} / {fault.entry.phase}: {fault.status}")
            new = [f for f in fault.findings if not f.startswith("missed") and f not in shown]
            lines += [f"    {finding}" for finding in new]
            shown.update(new)
        lines += [f"  {action}" for action in run.actions]
        lines.append(f"  each job: hpc-train train {' '.join(run.args())}")
    for reference in campaign.references.values():
        if reference.left_over or reference.losses is None:
            what = (
                f"left {len(reference.left_over)} files ({reference.left_over[0]})" if reference.left_over else "failed"
            )
            lines.append(f"a run without faults {what}: {reference.log}")
    return lines


def summary(runs: list[Run], args: argparse.Namespace, seconds: float, printed: str) -> dict:
    """What summary.json keeps: the options, the table, and each run's layout, command, actions and faults."""
    return {
        "seed": args.seed, "runs": len(runs), "seconds": round(seconds, 1), "table": printed.splitlines(),
        "run_list": [{"index": r.plan.index, "layout": r.layout.describe(), "args": r.args(), "actions": r.actions,
                      "faults": [{"kind": f.entry.kind, "phase": f.entry.phase, "rank": f.rank, "status": f.status,
                                  "specs": f.specs, "findings": f.findings} for f in r.plan.faults]} for r in runs],
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fault_campaign", help="its runs, logs and summary.json (emptied first)")
    parser.add_argument("--short", action="store_true", help=f"CI's campaign: {SHORT}, whatever --runs and --seed")
    parser.add_argument("--only", help="run these indices of the drawn campaign alone, e.g. 3,7")
    parser.add_argument("--kinds", help="draw only these faults: 'kind' or 'kind/phase', e.g. 'same name,hang'")
    parser.add_argument("--without", help="never draw these faults (as --kinds names them)")
    parser.add_argument("--max-world", type=int, default=4, choices=(1, 2, 4), help="the most ranks a run has")
    args = parser.parse_args(argv)
    if args.short:
        args.runs, args.seed, args.max_world, args.without = (
            SHORT[k] for k in ("runs", "seed", "max_world", "without")
        )
    return args


MARK = ".fault_campaign"  # in the directory of a campaign's results: another campaign may empty it


def fresh_directory(out: Path) -> Path:
    """`out`, emptied, where it is missing, empty or an earlier campaign's; never another directory's files."""
    out = out.resolve()
    if out.exists() and any(out.iterdir()) and not (out / MARK).exists():
        raise SystemExit(f"--out {out}: not empty, and not an earlier campaign's; give a new directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / MARK).touch()
    return out


def start_fork_server() -> None:
    """The ranks' fork server (restart.rank_processes), started before any output is redirected."""
    rank_processes()
    forkserver.ensure_running()


def campaign_main(argv: list[str] | None = None) -> int:
    """Draw every run, execute those asked for, report."""
    args = parse_args(argv)
    started = time.monotonic()
    out = fresh_directory(Path(args.out))
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    for number in (signal.SIGTERM, signal.SIGUSR1):  # the watcher's, sent as a job ended: nothing to act on
        signal.signal(number, lambda *_: None)
    start_fork_server()
    campaign = Campaign(out)
    kinds = select_kinds(args.kinds, args.without)
    plans = draw_plans(args.seed, args.runs, campaign.data, out / "scratch", kinds, args.max_world,
                       SHORT_FIRST if args.short else ())  # fmt: skip
    only = {int(i) for i in args.only.split(",")} if args.only else None
    runs = []
    for plan in plans:
        if only is not None and plan.index not in only:
            continue
        run = Run(campaign, plan)
        run.home.mkdir(parents=True)
        run.execute()
        runs.append(run)
        statuses = ", ".join(f"{f.entry.kind}/{f.entry.phase}: {f.status}" for f in plan.faults)
        print(f"run {plan.index} [{time.monotonic() - started:.0f}s] {plan.layout.describe()}: {statuses}", flush=True)
    return report(runs, campaign, args, time.monotonic() - started)


def report(runs: list[Run], campaign: Campaign, args: argparse.Namespace, seconds: float) -> int:
    """The table, the failures and how to meet them again, printed and kept in the out directory; the exit
    status (1: a fault, or a run without faults, was not survived)."""
    printed = table([run.plan for run in runs], list(campaign.references.values()))
    print(printed)
    (campaign.out / "table.txt").write_text(printed + "\n")
    if not campaign.can_mount:
        print("ENOSPC faults missed: this process may not mount a tmpfs (root may)")
    again = "python tools/fault_campaign.py " + ("--short" if args.short else f"--seed {args.seed} --runs {args.runs}")
    for flag, value in (("--kinds", args.kinds), ("--without", args.without), ("--max-world", args.max_world)):
        again += f" {flag} '{value}'" if value not in (None, 4) and not args.short else ""
    problems = failures(runs, campaign, again)
    print("\n".join(problems) if problems else "nothing lost, mixed or left over")
    faults = sum(len(run.plan.faults) for run in runs)
    print(f"{len(runs)} runs, {faults} faults in {seconds:.0f} s; details in {campaign.out}")
    (campaign.out / "summary.json").write_text(json.dumps(summary(runs, args, seconds, printed), indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(campaign_main())
