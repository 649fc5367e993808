"""Naming the rank that stopped. Every rank records where it is (step, and phase within the step) in the
job's rendezvous store. When a collective times out (a peer hung or died), the error lists the ranks that
are behind and the rank writes its stacks; when a step, a checkpoint save or resume, or the final
consolidation does not finish within `parallel.hang_timeout_s` (far sooner than a collective times out;
a process's first step and a resume get START_ALLOWANCE times that: communicators, compilation),
every rank writes its Python stacks to `run_dir/hang/` and one of them prints a summary: which rank is in
which step and operation, which ranks never arrived. A rank whose whole process is frozen cannot fire: its
peers' watchdogs find it, and where no rank is left alive to (one rank alone, or every one frozen), its
supervisor, which outlives it, does (`Heartbeats`)."""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hpc_train.bootstrap import node_name
from hpc_train.errors import HANG_EXIT
from hpc_train.resilience.bad_nodes import blame

KEY = "hpc_train/progress/{}"
WHO = "hpc_train/who/{}"  # "<host> <pid> <Slurm node>" of each rank, for the hang summary
PHASES = ("started", "finished the backward pass of", "finished", "saving the checkpoint of",
          "consolidating the final weights after", "rolling back the loss spike of")  # fmt: skip
SAVING, CONSOLIDATING, ROLLING_BACK = 3, 4, 5
STACK = "rank{:05d}.txt"
START_ALLOWANCE = 4  # a process's first step and a resume: communicator setup, compilation, a checkpoint read
SUPERVISOR_STOPPED_S = 5.0  # a supervisor that looked at its ranks' beats this long ago was stopped itself
HEARTBEATS = "HPC_TRAIN_HEARTBEATS"  # the folder, of the rank's supervisor, where its watchdog shows it is alive
FROZEN = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O, a driver)"}


def _store():
    return distributed_c10d._get_default_store()


def record(step: int, phase: int, rollbacks: int = 0) -> None:
    """phase: an index into PHASES; rollbacks: train.spike_guard's so far (after one, steps count again from
    an earlier one: a rank is further along when it has rolled back more)."""
    _store().set(KEY.format(dist.get_rank()), f"{step} {phase} {rollbacks}")


def is_timeout(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def write_stacks(run_dir: str | Path, header: str) -> Path:
    """This rank's header and the stacks of all its threads in `run_dir/hang/rank<r>.txt`."""
    path = Path(run_dir) / "hang" / STACK.format(dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(header)
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    return path


def _read(keys: list[str]) -> list[str | None]:
    """The store's values (None where unset), or an OSError-like failure when the store is gone."""
    store = _store()
    store.set_timeout(timedelta(seconds=5))
    return [store.get(k).decode() if store.check([k]) else None for k in keys]


def _describe(step: int, phase: int) -> str:
    return f"{PHASES[phase]} step {step}" if step else "not started training"


def _progress(values: list[str | None]) -> tuple[dict[int, tuple[int, int]], tuple[int, int], list[int]]:
    """Each rank's (step, phase) from its record, the furthest one, and the ranks behind it (by rollbacks,
    then step, then phase)."""
    records = {r: tuple(map(int, v.split())) if v else (0, 0, 0) for r, v in enumerate(values)}  # step phase rollbacks
    order = {r: (rollbacks, step, phase) for r, (step, phase, rollbacks) in records.items()}
    front = max(order.values())
    return {r: o[1:] for r, o in order.items()}, front[1:], [r for r, o in order.items() if o < front]


def stragglers(world_size: int) -> str:
    """e.g. 'rank 1 started step 2 (the others finished backward of step 2)', or why it could not be read."""
    try:
        where, front, behind = _progress(_read([KEY.format(r) for r in range(world_size)]))
    except Exception as err:  # the store lives on rank 0's host: it may be gone too
        return f"could not read the other ranks' progress ({err})"
    if not behind:
        return f"every rank {_describe(*front)}"
    return ", ".join(f"rank {r} {_describe(*where[r])}" for r in behind) + f" (the others {_describe(*front)})"


class HangWatchdog:
    """A thread that fires when an armed step has not finished within `timeout_s`: this rank writes the
    stacks of all its threads to `run_dir/hang/rank<r>.txt` and waits `grace_s` for the others'; the
    lowest rank with a stack writes and prints `summary.txt`; every rank exits with HANG_EXIT, which ends
    the job (srun's --kill-on-bad-exit, the local launcher) instead of leaving it blocked until the
    collective timeout. A stack is taken by the rank itself (faulthandler), so a rank blocked in C code
    that holds the GIL, or a frozen process, has none: the summary names it by its place and state."""

    def __init__(self, timeout_s: int, run_dir: str | Path, world_size: int, grace_s: float = 10.0):
        self.timeout_s, self.grace_s, self.world = timeout_s, grace_s, world_size
        self.run_dir, self.dir = run_dir, Path(run_dir) / "hang"
        self.rank = dist.get_rank()
        self.deadline: float | None = None
        self.step, self.what, self.allowed_s = 0, "step", float(timeout_s)
        self.done = threading.Event()
        self.heartbeat: Path | None = None  # this rank's file in its supervisor's HEARTBEATS folder
        if not timeout_s:
            return
        if self.rank == 0 and self.dir.exists():  # an earlier hang's files, kept aside (no rank can fire yet)
            self.dir.rename(
                self.dir.with_name(time.strftime("hang-%Y%m%d-%H%M%S", time.localtime(self.dir.stat().st_mtime)))
            )
        _store().set(WHO.format(self.rank), f"{socket.gethostname()} {os.getpid()} {node_name()}")
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()
        if HEARTBEATS in os.environ:
            self.heartbeat = Path(os.environ[HEARTBEATS]) / f"rank{self.rank}"
            threading.Thread(target=self._beat, name="hang-heartbeat", daemon=True).start()

    def arm(self, step: int, what: str = "step", allowance: float = 1.0) -> None:
        """Time `what` (of `step`) from now: it must end within `allowance` times parallel.hang_timeout_s."""
        self.step, self.what, self.allowed_s = step, what, allowance * self.timeout_s
        self.deadline = time.monotonic() + self.allowed_s

    def disarm(self) -> None:
        self.deadline = None

    @contextmanager
    def timed(self, step: int, what: str, allowance: float = 1.0) -> Iterator[None]:
        """`what` is timed like a step (a save, a resume, the final consolidation: their collectives hang too)."""
        self.arm(step, what, allowance)
        try:
            yield
        finally:
            self.disarm()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not timed: work of unbounded length inside a step (evaluation, a profiler trace's export)."""
        deadline, self.deadline = self.deadline, None
        try:
            yield
        finally:
            if deadline is not None:
                self.arm(self.step, self.what, self.allowed_s / max(1, self.timeout_s))

    def close(self) -> None:
        """No longer timed, nor watched by the supervisor (whatever the process does until it exits): the
        beat's thread removes its file as it ends."""
        self.done.set()

    def _beat(self) -> None:
        """Show the supervisor this process still runs, armed or not, on a thread of its own (the watchdog's
        is busy while it fires): its file's time, set every tick (`Heartbeats` reads it), after its
        hang_timeout_s and pid. A process frozen, or blocked in C code that holds the GIL, stops beating."""
        with suppress(OSError):  # the supervisor removes the folder when the ranks are gone
            try:
                self.heartbeat.write_text(f"{self.timeout_s} {os.getpid()}")
                while not self.done.wait(min(1.0, self.timeout_s / 4)):
                    os.utime(self.heartbeat)
            finally:  # here, not in `close`: a close before the first write would leave a file that never beats
                self.heartbeat.unlink(missing_ok=True)

    def _watch(self) -> None:
        while not self.done.wait(min(1.0, self.timeout_s / 4)):
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                try:
                    self._fire()
                finally:  # whatever failed while reporting, the run must not stay hung
                    sys.stderr.flush()
                    os._exit(HANG_EXIT)

    def _fire(self) -> None:
        allowed = f"{self.allowed_s:g}s (parallel.hang_timeout_s={self.timeout_s}s"
        allowed += f" x {self.allowed_s / self.timeout_s:g})" if self.allowed_s != self.timeout_s else ")"
        write_stacks(self.run_dir, f"rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}): "
                                   f"{self._doing()} unfinished after {allowed}; main thread "
                                   f"0x{threading.main_thread().ident:016x}\n")  # fmt: skip
        summary = self.dir / "summary.txt"
        deadline = time.monotonic() + self.grace_s  # the others are blocked on this rank, or it on them
        while time.monotonic() < deadline and len(self._stacks()) < self.world and not summary.exists():
            time.sleep(0.2)
        if not summary.exists() and self.rank == min(self._stacks()):
            text = self._summary()
            tmp = self.dir / f"summary.{self.rank}.tmp"
            tmp.write_text(text)
            try:
                os.link(tmp, summary)  # exclusive: one rank's summary, printed once
                print(text, file=sys.stderr, flush=True)
            except FileExistsError:
                pass
            tmp.unlink()
        deadline = time.monotonic() + 2 * self.grace_s
        while time.monotonic() < deadline and not summary.exists():
            time.sleep(0.2)

    def _doing(self) -> str:
        if self.what == "step":
            return f"step {self.step}"
        return f"the {self.what}" + (f" of step {self.step}" if self.step else "")

    def _stacks(self) -> set[int]:
        return {int(p.stem[4:]) for p in self.dir.glob("rank*.txt")}

    def _summary(self) -> str:
        try:
            progress = _read([KEY.format(r) for r in range(self.world)])
            who = [v.split() if v else None for v in _read([WHO.format(r) for r in range(self.world)])]
        except Exception as err:  # the store lives on rank 0's host, which may be the one that is stuck
            progress, who = [None] * self.world, [None] * self.world
            unread = f" (progress unknown: {err})"
        else:
            unread = ""
        self._note_frozen(who)
        where, front, behind = _progress(progress)
        lines = [f"hang: {self._doing()} did not finish within {self.allowed_s:g}s "
                 f"(parallel.hang_timeout_s={self.timeout_s}s){unread}; stacks in {self.dir}"]  # fmt: skip
        if behind:
            lines.append(f"ranks that never arrived: {', '.join(map(str, behind))} (the others {_describe(*front)})")
        for node in sorted({who[r][2] for r in behind if who[r]}):
            blame(self.run_dir, node, f"a rank on it never arrived in step {front[0]} (hang)")
        for r in range(self.world):
            place = f" on {who[r][0]} (pid {who[r][1]})" if who[r] else ""
            lines.append(f"  rank {r}{place}: {_describe(*where[r])}; {self._operation(r, who[r])}")
        return "\n".join(lines) + "\n"

    def _note_frozen(self, who: list[list[str] | None]) -> None:
        """A rank without a stack whose process is on this host and stopped (SIGSTOP, a debugger) or in
        uninterruptible sleep cannot run code to write one: its file says so, with the kernel's view."""
        for r in set(range(self.world)) - self._stacks():
            if not who[r] or who[r][0] != socket.gethostname():
                continue
            pid = int(who[r][1])
            state = _state(pid)
            if state in FROZEN:
                (self.dir / STACK.format(r)).write_text(
                    f"rank {r} on {socket.gethostname()} (pid {pid}): no Python stack: the process is "
                    f"{FROZEN[state]} (state {state}) and cannot write one\n"
                )

    def _operation(self, rank: int, who: list[str] | None) -> str:
        """Where the rank's main thread is, from its stack: the innermost frame, and the innermost of ours."""
        path = self.dir / STACK.format(rank)
        if not path.exists():
            pid = who[1] if who else "?"
            return f"no stack (process {pid} is frozen or its node is gone)"
        text = path.read_text(errors="replace")
        main = re.search(r"main thread (0x[0-9a-f]+)", text)
        block = text.split(f"Thread {main.group(1)}")[-1] if main else text
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        if not frames:
            return text.split(": ", 1)[-1].strip()
        inner = frames[0]
        ours = next((f for f in frames if "hpc_train" in f[0]), None)
        described = f"in {inner[2]} ({_short(inner[0])}:{inner[1]})"
        if ours and ours != inner:
            described += f" called from {ours[2]} ({_short(ours[0])}:{ours[1]})"
        return described


class Heartbeats:
    """A supervisor's watch over its rank processes, which it outlives: a rank whose process is frozen (SIGSTOP,
    a debugger, blocked in C code holding the GIL) cannot fire its own watchdog, and with no live rank left to
    notice (one rank alone, or every one frozen) the run would wait for ever. Each rank's watchdog beats in a
    folder of the supervisor's (`HEARTBEATS` in the ranks' environment, a fresh one per start of the ranks);
    only when every rank that beats has gone silent for longer than its parallel.hang_timeout_s does the
    supervisor end them. While one still beats, the frozen rank is its watchdog's to locate (every stack, the
    summary); a supervisor that sees only its own rank (Slurm's, of a job of several) must not watch it."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hpc_train-heartbeats-"))
        # silence counts from here at the earliest, and from the supervisor's own return after it was stopped
        # too (a job suspended and resumed: its ranks wake with it, their next beat up to a tick away)
        self.awake_since, self.last_look = time.time(), time.monotonic()

    def environ(self) -> dict[str, str]:
        """This process's environment and the folder: the rank processes'."""
        return {**os.environ, HEARTBEATS: str(self.dir)}

    def frozen(self) -> dict[int, str] | None:
        """When every rank that beats is silent beyond its hang_timeout_s: what each one is, by rank
        ('froze: ...'); else None (also before any beats: a rank's watchdog starts after the build)."""
        now, silent = time.time(), {}
        if time.monotonic() - self.last_look > SUPERVISOR_STOPPED_S:
            self.awake_since = now
        self.last_look = time.monotonic()
        for path in self.dir.glob("rank*"):
            with suppress(OSError, ValueError):  # a rank just closing its watchdog, or just writing its file
                timeout_s, pid = map(int, path.read_text().split())
                quiet_s = now - max(path.stat().st_mtime, self.awake_since)
                if quiet_s <= timeout_s:
                    return None
                state = _state(pid)
                silent[int(path.name[4:])] = (
                    f"froze (pid {pid}, {FROZEN.get(state, 'state ' + (state or 'gone'))}): no sign of life for "
                    f"{quiet_s:.0f}s (parallel.hang_timeout_s={timeout_s}s), and no rank alive to locate it"
                )
        return silent or None

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _short(path: str) -> str:
    """A frame's file from its package down (torch/..., hpc_train/...)."""
    parts = Path(path).parts
    for anchor in ("hpc_train", "torch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
    return Path(path).name


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, D, T, ...); '' when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    match = re.search(r"^State:\s+(\S)", status, flags=re.MULTILINE)
    return match.group(1) if match else ""
