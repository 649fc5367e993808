"""Save and resume during training. The checkpointer owns the save policy (every `checkpoint.interval`
steps, at the end, on a stop signal) and the registered parts it saves (checkpoint/state.py): sharded
parts through DCP, every rank writing its own shards, and small per-rank parts in each rank's own file.
Each rank writes `checkpoint.io_threads` files in parallel, checksummed as they are written
(checkpoint/dcp_io.py); the store commits them (manifest, atomic rename, `latest`). On start the newest
checkpoint that verifies is loaded, in parallel, in whatever layout this run uses, its checksums checked
as its files are read (where an older one remains to fall back on; the oldest is checksummed first).

Saves go to the background where each of a node's ranks has a core free for that work, or a GPU computes
(`checkpoint.async_save=auto`, `choose_async`): the state is copied into host buffers that are allocated
once and reused (DCP's DefaultStager; pinned memory on a GPU) while the next step's forward and backward
run; training waits for the copy, if at all, only before its optimizer update (`staged`), whatever the
ZeRO stage. (ZeRO-1/2's state, sent for the save to the dp rank that writes each parameter's, about a
rank's own share, and vocabulary rows, gathered whole, are new tensors that stay alive until the copy is
done.) A background thread then writes the copy and commits it as soon as every rank's files are durable,
over a gloo group of its own; a crash before that leaves only a `.tmp` directory.

Before the first save or load the run claims the directory (checkpoint/ownership.py): a lock no second
live run can take, and a check that the checkpoints there are this run's. Nothing is unpickled from
the files (checkpoint/safe_load.py).

With `memory_copy` (train.spike_guard's), each save also copies this rank's state into host memory
(checkpoint/memory_copy.py), and `roll_back` restores the newest checkpoint from there instead of disk;
node-local checkpoints are written from the same copy, so with them it is always kept, and a rollback
goes back to the newest save, local or shared.
With `checkpoint.local_dir`, every `local_interval` steps each rank's state also goes to node-local disk and
its partner node (checkpoint/local.py), which an in-job restart reads when newer than the shared checkpoint;
with `checkpoint.memory_interval`, to host memory and its partner's, in the background where saves go there,
its update waiting (`staged`) until every rank's copies are kept.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import hpc_train
from hpc_train.bootstrap import node_cores, node_name
from hpc_train.checkpoint.dcp_io import ChecksummedWriter, ParallelReader, RegionSavePlanner, agree_on_checks
from hpc_train.checkpoint.integrity import file_record, first_mismatch, new_digest
from hpc_train.checkpoint.local import LocalCheckpoints, restarted
from hpc_train.checkpoint.memory_copy import MemoryCopy
from hpc_train.checkpoint.ownership import DirectoryLock, RunIdentity, batch_change
from hpc_train.checkpoint.safe_load import load_rank_file, read_dcp_metadata
from hpc_train.checkpoint.slices import FlatSlice, SliceLoadPlanner
from hpc_train.checkpoint.state import ShardedPart, Stateful
from hpc_train.checkpoint.store import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    ChecksumMismatch,
    empty_trash,
    in_background,
)
from hpc_train.config import MEMORY_DIR, CheckpointConfig
from hpc_train.distributed.agree import raise_together
from hpc_train.distributed.hooks import StepHooks
from hpc_train.optim.nvme import FileRegion, snapshot
from hpc_train.resilience.failures import daly_interval
from hpc_train.resilience.faults import fault_point

# of the per-rank files; format 1 (hpc_train 08c1275) kept the sampler's count at top level, formats 1 and
# 2 the numpy RNG key as a numpy array (3: a tensor, so the files load with weights_only=True alone)
FORMAT = 3
AUTO_FIRST = 10  # checkpoint.interval=auto: a process's first save, these steps in, measures what a save costs


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def upgrade_rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """A per-rank file of any format, as format 2: {"step", then one state_dict per part}."""
    if state.get("format", 1) > 1:
        return state
    step = state["step"]
    return {"step": step, "sampler": {"consumed_samples": state["consumed_samples"]},
            "loss_scaler": state["loss_scaler"], "rng": state["rng"], "metrics": {"step": step}}  # fmt: skip


@dataclass
class Resumed:
    step: int
    layout: dict[str, Any]  # the layout it was saved with
    committed_at: float  # when it was committed (its manifest's time), to tell what a restart redoes
    source: str = "disk"  # or "memory" (`Checkpointer.roll_back`'s in-memory copy), or "local" (node-local disk)
    from_partner: list[int] | None = None  # "local": the ranks that read their partner node's copy
    passed_over: list[str] | None = None  # "local": the node-local copies that failed their checks, and why


class Checkpointer:
    """`sharded` parts go through DCP; `shared` parts (the same on every rank) are restored from rank 0's
    file; `per_rank` parts (RNG streams) from each rank's own file, and only when the layout is the same."""

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        steps: int,
        identity: RunIdentity,
        layout: dict[str, Any],
        sharded: dict[str, ShardedPart],
        shared: dict[str, Stateful],
        per_rank: dict[str, Stateful],
        report: Callable[[str], None],
        memory_copy: bool = False,
        run_name: str = "run",
        ranks_per_node: int = 1,
        hooks: Sequence[StepHooks] = (),
        replicas: list[int] | None = None,
    ):
        """`checkpoint`: the section; `steps`: the run's last step (always saved); `identity`: what makes the
        checkpoints this run's (recorded in each manifest, checked before resuming or writing beside one);
        `memory_copy`: also keep each save's state in host memory, for `roll_back`; `run_name`: where local
        checkpoints go; `ranks_per_node`: the ranks that share a node's cores (whether saves go to the
        background); `hooks`: the model's step hooks, whose `after_restore` follows every restore; `replicas`:
        the ranks holding this rank's tensors (its dp group at ZeRO-0), whose local copies stand for each
        other's."""
        self.options, self.steps, self.identity = checkpoint, steps, identity
        self.layout, self.report = layout, report
        self.sharded, self.shared, self.per_rank = sharded, shared, per_rank
        self.hooks = hooks  # the features' parts in every step: told when a restore replaced the weights
        self.store = CheckpointStore(checkpoint.dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nodes = max(1, self.world // ranks_per_node)
        self.next_save: int | None = None  # checkpoint.interval=auto: the step of the next save
        # async saves: host buffers reused across saves, and a group of their own for the background
        # writes and commits, created collectively up front
        self.stager, self.async_group = None, None
        compute = 1 if torch.cuda.is_available() else torch.get_num_threads()  # a GPU rank's host thread
        self.background, note = choose_async(checkpoint.asynchronous, ranks_per_node, compute, node_cores(),
                                             torch.cuda.is_available())  # fmt: skip
        if note and (checkpoint.interval or checkpoint.memory_interval):
            report(note)
        if self.background:
            self.stager = host_stager()
            self.async_group = dist.new_group(backend="gloo")
        self.staging: Future | None = None  # an async save's copy to host memory, until it is done
        self.staging_wait_s = 0.0  # how long the training waited for it
        self.last_staging_wait_s = 0.0
        self.pending: tuple[int, Future] | None = None  # an async save in flight: its step, its end
        self.pruning: Future | None = None  # rank 0: older checkpoints being deleted after a commit
        self.finished: dict[str, Any] | None = None  # the figures of the last async save, until polled
        self.lock = DirectoryLock(self.store.root)
        self.abandoned = threading.Event()
        self.own_step: int | None = None  # the newest checkpoint this process saved or resumed: a rollback's
        # one host copy of the state: the spike guard's and the local checkpoints' (written from it), which
        # holds the newest step saved either way, so a rollback to a local step needs no disk
        self.memory_copy = None
        if memory_copy or checkpoint.saves_locally:
            self.memory_copy = MemoryCopy(sharded["model"], sharded["optim"], {**shared, **per_rank})
        self.local = None
        if checkpoint.saves_locally:  # in memory: each node's own directory (emulated nodes share a machine's)
            root = f"{MEMORY_DIR}/{node_name()}" if checkpoint.memory_interval else checkpoint.local_dir
            self.local = LocalCheckpoints(root, run_name, checkpoint.dir, identity.digest(), self.memory_copy,
                                          layout, report, replicas, bool(checkpoint.memory_interval))  # fmt: skip

    # ---- ownership --------------------------------------------------------------------------------
    def claim(self) -> None:
        """Lock the directory and, for a run that will not resume (`resume` checks what it loads), check
        that its checkpoints are this run's, before anything is written; every rank raises the same
        CheckpointError when either fails."""
        problem: list[str | None] = [None]
        if self.rank == 0:
            try:
                if note := self.lock.acquire():
                    self.report(note)
                empty_trash(self.store.root)  # what a kill inside the last run's last prune left
                fresh = not self.options.resume
                newest = self.store.newest_valid(full=False, report=lambda message: None) if fresh else None
                if newest is not None:
                    self.identity.refuse_foreign(newest.path, newest.manifest)
            except (CheckpointError, OSError) as err:
                problem = [str(err)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            self.release()
            raise CheckpointError(problem[0])
        if self.local is not None:  # held now: what an earlier job of the run left on the nodes goes
            self.local.start()

    def finish(self) -> None:
        """Collectively, where the run ended well (finished, or stopped after its save): its node-local copies
        deleted, which only an in-job restart would have read."""
        if self.local is not None:
            self.local.finish()

    def release(self) -> None:
        """The end of the claim: an async save still in flight (the run failed) commits nothing after it;
        a deletion of older checkpoints is finished first (it holds the directory too)."""
        self.abandoned.set()
        try:
            self.pruned()
        finally:
            self.lock.release()

    # ---- save -------------------------------------------------------------------------------------
    def should_save(self, step: int, stop_requested: bool) -> bool:
        """A save at `step`: on a stop, every checkpoint.interval steps and at the end; with interval=auto, at
        the step `plan_next_save` set (the first AUTO_FIRST steps into this process's training, `begin`, to
        measure what a save costs) and at every multiple of keep_every (the checkpoints kept for good)."""
        interval, every = self.options.interval, self.options.keep_every
        if interval == "auto":
            due = self.next_save is not None and step >= self.next_save or bool(every and step % every == 0)
            return stop_requested or due or step == self.steps
        return stop_requested or bool(interval and (step % interval == 0 or step == self.steps))

    def begin(self, start_step: int) -> None:
        """Training starts (or resumes) after `start_step`: interval=auto's first save is AUTO_FIRST steps on."""
        self.next_save = start_step + AUTO_FIRST if self.options.interval == "auto" else None

    def plan_next_save(self, step: int, blocked_s: float, step_s: float, device: torch.device) -> dict | None:
        """checkpoint.interval=auto, after the save of `step`: the next one Daly's interval later, for the
        slowest rank's time blocked by a save (this one's, and the previous one's wait for its staging: an
        asynchronous save's copy to host memory that the next update waited for), its step time and the job's
        MTBF (a node's over the job's nodes): one MAX all-reduce on `device`, so every rank agrees. Returns
        the figures it used (None: not auto)."""
        if self.options.interval != "auto":
            return None
        measured = torch.tensor([blocked_s + self.last_staging_wait_s, step_s, self.nodes], dtype=torch.float64,
                                device=device)  # fmt: skip
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        save_s, step_s, nodes = measured.tolist()
        mtbf_s = self.options.mtbf_hours * 3600 / nodes
        steps = max(1, round(daly_interval(save_s, mtbf_s) / step_s))
        self.next_save = step + steps
        return {"save_s": save_s, "step_s": step_s, "mtbf_s": mtbf_s, "steps": steps}

    def should_save_local(self, step: int, saving: bool = False) -> bool:
        """A node-local save at `step`: on disk where no shared save is `saving` (that one is newer), in
        memory at every interval's step (a shared save may not be committed when a rank dies)."""
        due = self.local is not None and step % self.options.local_every == 0
        return due and (not saving or bool(self.options.memory_interval))

    def save_local(self, step: int) -> dict[str, Any]:
        """This rank's state of `step` on node-local disk or in memory, and its partner's: what it cost
        (`local_s`; LocalCheckpoints.save's figures). Memory checkpoints save in the background where saves
        do (checkpoint.async_save)."""
        start = time.perf_counter()
        saved = self.local.save(step, background=self.background and bool(self.options.memory_interval))
        self.own_step = step  # the newest checkpoint, in the memory copy: a rollback's
        return {**saved, "local_s": time.perf_counter() - start}

    def save(self, step: int) -> dict[str, Any]:
        """Save this step; returns what it cost this rank: `blocked_s` (the time training waited), `state_s`
        (of that, gathering what to save, after waiting for a previous async save) and, once committed (a
        synchronous save), the write's breakdown (`plan_s`, DCP's planning and metadata; `data_s`, its data
        write; the writer threads' `io_s`, `hash_s` and `fsync_s`) and the commit's figures (see `_commit`)."""
        start = time.perf_counter()
        fault_point("save", step, self.rank)
        self.finished = self.wait() or self.finished
        self.own_step = step  # a failed save raises, here or at the next `wait`
        gathering = time.perf_counter()
        tmp = self.store.tmp_dir(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale partial save of this step
            tmp.mkdir(parents=True)
        dist.barrier()
        parts = {name: part.state_dict() for name, part in {**self.shared, **self.per_rank}.items()}
        rank_state = io.BytesIO()
        torch.save({"format": FORMAT, "step": step, **parts}, rank_state)
        state = self.sharded_tensors()
        state_s = time.perf_counter() - gathering  # the barrier, the per-rank file, the tensors (ZeRO: sent to writers)
        copied = self._copy_to_memory(step)
        if self.stager is None:
            return {**self._write_and_commit(step, state, rank_state.getbuffer(), None), **copied,
                    "state_s": state_s, "blocked_s": time.perf_counter() - start}  # fmt: skip
        if torch.cuda.is_available():  # the stager's stream does not wait for this one: gathers, clones
            torch.cuda.current_stream().synchronize()
        self.stager = open_stager(self.stager)
        # state in files (optim.offload=nvme): copied on the disk now, not staged in memory
        on_disk = snapshot({k: v for k, v in state.items() if isinstance(v, FileRegion)}, self.async_group)
        in_memory, layouts = unplaced({k: v for k, v in state.items() if k not in on_disk})
        staging = self.staging = self.stager.stage(in_memory)
        self.last_staging_wait_s = self.staging_wait_s  # the previous save's wait, for interval=auto
        self.staging_wait_s = 0.0  # the next update's wait (this one's is in blocked_s)

        def write(staging: Future) -> dict[str, Any]:
            staged = placed(staging.result(), layouts)
            fault_point("staged", step, self.rank)
            return self._write_and_commit(step, {**staged, **on_disk}, rank_state.getbuffer(), self.async_group)

        self.pending = (step, in_background(write, staging))
        return {**copied, "state_s": state_s, "blocked_s": time.perf_counter() - start}

    def _copy_to_memory(self, step: int) -> dict[str, Any]:
        """With a memory copy: the state as saved, copied into host memory; its figures (`memory_copy_s`,
        `memory_copy_bytes`, this rank's)."""
        if self.memory_copy is None or self.memory_copy.step == step:  # a memory checkpoint's, of this step
            return {}
        start = time.perf_counter()
        self.memory_copy.take(step)
        return {"memory_copy_s": time.perf_counter() - start, "memory_copy_bytes": self.memory_copy.nbytes()}

    def roll_back(self) -> Resumed | None:
        """The newest checkpoint this process saved or resumed from, back into this run (train.spike_guard):
        from the in-memory copy, which every save takes (an async save in flight is committed first: a
        failed one raises), else read from disk as a resume reads it (that step only, not a newer one an
        earlier run left in the directory); None when there is none yet."""
        self.finished = self.wait() or self.finished
        if self.local is not None:
            self.local.settle()  # a local save in the background: its copy whole
        copy = self.memory_copy
        if self.own_step is None:
            return None
        if copy is None or copy.step != self.own_step:
            return self.resume(self.own_step)
        copy.restore()
        return self._restored(Resumed(copy.step, self.layout, time.time(), source="memory"))

    def staged(self) -> None:
        """Wait until an async save's copy is in host memory: before the weights or the optimizer state
        change (the optimizer update). The time waited is in the save's figures (`staging_wait_s`)."""
        if self.local is not None:
            self.local.stored()
        if self.staging is None:
            return
        start = time.perf_counter()
        staging, self.staging = self.staging, None
        with io_errors_named("copying the checkpoint to host memory", self.store.root):
            staging.result()
        self.staging_wait_s += time.perf_counter() - start

    def sharded_tensors(self) -> dict[str, torch.Tensor]:
        """What DCP saves: every sharded part's tensors, under `<part>.<key>`."""
        return {f"{name}.{key}": t for name, part in self.sharded.items() for key, t in part.tensors().items()}

    def _write_and_commit(self, step: int, state: dict, rank_state: memoryview, group: Any) -> dict[str, Any]:
        """Every rank writes its files into the step's `.tmp` directory, checksummed as written; then commit.
        Runs on the training thread, or for an async save on a background thread over its own group."""
        start, tmp = time.perf_counter(), self.store.tmp_dir(step)
        doing = f"saving checkpoint of step {step} into {tmp}"
        problem = None
        try:  # serialized first, so a full disk is the OSError of a plain write
            with open(tmp / rank_file(self.rank), "wb") as f:
                f.write(rank_state)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            problem = f"{doing} failed on rank {self.rank}: {err}"
        raise_together(problem, group, CheckpointError)  # every rank stops together, none waits in DCP
        digest = new_digest()
        digest.update(rank_state)
        writer = ChecksummedWriter(tmp, self.options.io_threads, step, self.rank)
        dcp_start = time.perf_counter()
        with io_errors_named(doing, tmp):
            dcp.save(state, storage_writer=writer, planner=RegionSavePlanner(), process_group=group)
        records = {**writer.records, rank_file(self.rank): file_record(len(rank_state), digest)}
        # DCP's planning (collectives) and its metadata file are its save less its data write
        breakdown = {"plan_s": time.perf_counter() - dcp_start - writer.data_s, **writer.figures}
        return {**self._commit(step, records, group, time.perf_counter() - start), **breakdown}

    def wait(self) -> dict[str, Any] | None:
        """Finish an async save in flight (normally committed already): its figures (see `_commit`), `step`
        and `staging_wait_s`; raises its error."""
        if self.pending is None:
            return None
        step, future = self.pending
        self.pending = self.staging = None
        with io_errors_named(f"writing checkpoint of step {step} in the background", self.store.tmp_dir(step)):
            return {"step": step, **future.result(), "staging_wait_s": self.staging_wait_s}

    def poll(self) -> dict[str, Any] | None:
        """The figures of an async save committed since the last poll (without waiting for one in flight; a
        failed one is raised by `wait`, at the next save or the end, a step every rank shares)."""
        done = self.pending is not None and self.pending[1].done() and self.pending[1].exception() is None
        if done and self.finished is None:  # else at the next poll: one save's figures per step
            self.finished = self.wait()
        finished, self.finished = self.finished, None
        return finished

    def _commit(self, step: int, records: dict[str, dict], group: Any, write_s: float) -> dict[str, Any]:
        """Rank 0 gathers every rank's file records and commits (checkpoint/store.py). Figures: `bytes` this
        rank wrote, `write_s` (its files written, checksummed and fsynced) and, on rank 0, `commit_s`,
        `total_bytes` and the bandwidth of the whole save."""
        start = time.perf_counter()
        described = [None] * self.world if self.rank == 0 else None
        dist.gather_object(records, described, dst=0, group=group)
        figures = {"bytes": sum(r["size"] for r in records.values()), "write_s": write_s}
        if self.rank == 0:
            files = {name: record for part in described for name, record in part.items()}
            manifest = {"layout": self.layout, "code_version": hpc_train.__version__,
                        **self.identity.manifest_fields()}  # fmt: skip
            if self.abandoned.is_set():
                raise CheckpointError(f"checkpoint of step {step} abandoned: the run ended before its commit")
            self.pruned()  # the previous save's pruning, done before another commit
            final = self.store.commit(step, files, manifest)
            total, commit_s = sum(r["size"] for r in files.values()), time.perf_counter() - start
            gb_per_s = total / (write_s + commit_s) / 1e9
            figures.update(total_bytes=total, commit_s=commit_s, gb_per_s=gb_per_s)
            self.report(f"checkpoint {final} committed: {total / 1e9:.2f} GB, {len(files)} files in "
                        f"{write_s + commit_s:.2f}s ({gb_per_s:.2f} GB/s; commit {commit_s:.2f}s)")  # fmt: skip
            fault_point("committed", step, 0)
            # older checkpoints are deleted in the background: a deletion is no part of this one's safety
            self.pruning = in_background(self._prune, final)
        dist.barrier(group=group)
        return figures

    def _prune(self, protect: Path) -> dict[str, Any]:
        """Delete what retention no longer keeps; a failure is reported, never raised (no save depends on it)."""
        start = time.perf_counter()
        try:
            removed = self.store.prune(self.options.keep_last, self.options.keep_every, protect)
        except OSError as err:
            self.report(f"could not remove older checkpoints in {self.store.root}: {err}")
            removed = []
        if removed:
            self.report(f"removed {', '.join(p.name for p in removed)}")
        return {"prune_s": time.perf_counter() - start, "removed": [p.name for p in removed]}

    def pruned(self) -> dict[str, Any] | None:
        """Wait for the deletion of older checkpoints started by the last commit (rank 0); its figures."""
        pruning, self.pruning = self.pruning, None
        return None if pruning is None else pruning.result()

    # ---- resume -----------------------------------------------------------------------------------
    def _choose(self, step: int | None = None) -> Iterator[tuple[str, dict, str | None, bool]]:
        """The checkpoints to load, newest first (of `step`, if given), agreed by every rank: each one's path,
        manifest, the note of a change of update rule it allows (`RunIdentity.rule_change`) and whether its
        checksums are checked as it is read for the load (`read_parts`). Rank 0 checks manifests, file lists
        and sizes. With `checkpoint.verify=full` a checkpoint is checked as it is read while an older one
        remains to fall back on: the model loads in place, so a load that fails leaves part of it there for
        the next checkpoint's load to overwrite. The oldest is checksummed first instead (every rank its share
        of the files, `io_threads` at a time), and skipped if that fails anywhere."""
        candidates = self.store.candidates(self.report) if self.rank == 0 else iter(())
        if step is not None:
            candidates = (info for info in candidates if info.step == step)
        full, threads = self.options.verify == "full", self.options.io_threads
        upcoming = next(candidates, None)
        while True:
            choice: list[Any] = [None, None, None, None, False]
            if self.rank == 0 and (info := upcoming) is not None:
                upcoming = next(candidates, None)
                choice = [str(info.path), info.manifest, None, None, upcoming is not None]
                try:
                    self.identity.refuse_foreign(info.path, info.manifest)
                    choice[3] = self.identity.rule_change(info.path, info.manifest)
                except CheckpointError as err:
                    choice[2] = str(err)
            dist.broadcast_object_list(choice, src=0)
            path, manifest, refused, reset, older = choice
            if refused:
                raise CheckpointError(refused)
            if path is None:
                return
            if not full or older:
                yield path, manifest, reset, full
                continue
            files = manifest["files"]
            mine = sorted(files, key=lambda name: (-files[name]["size"], name))[self.rank :: self.world]
            problems = [None] * self.world
            dist.all_gather_object(problems, first_mismatch(Path(path), files, mine, threads))
            if not any(problems):
                yield path, manifest, reset, False
            elif self.rank == 0:
                self.report(f"checkpoint {path} skipped: {next(p for p in problems if p)}")

    def resume(self, step: int | None = None) -> Resumed | None:
        """Load the newest checkpoint that verifies (of `step`, if given) into every registered part; None when
        there is none. Under a change of update rule (optim.reset_state=true) the rule's saved state is not
        loaded; a change of the global batch is reported (`batch_change`). A checkpoint whose checksums fail
        as it is read is skipped for the next; where none loads after it, part of it is in the model already,
        so that is raised rather than training from there."""
        if step is None and (resumed := self._resume_locally()):
            return self._restored(resumed)
        failed = None  # a checkpoint that failed its checksums after part of it was read into the model
        for path, manifest, reset, verify in self._choose(step):
            fault_point("resume", 0, self.rank)
            if reset:
                self.report(reset)
            read: dict[str, int] = {}
            try:
                templates = read_parts(path, manifest, self.sharded, self.options.io_threads, rule_state=not reset,
                                       verify=verify, figures=read)  # fmt: skip
            except ChecksumMismatch as err:
                if self.rank == 0:
                    self.report(f"checkpoint {path} skipped: {err}")
                failed = f"{path} ({err})"
                continue
            with load_errors_named(path):
                shared = upgrade_rank_state(load_rank_file(Path(path) / rank_file(0)))
            step = shared["step"]
            for name, part in self.sharded.items():  # in registration order: the model before the optimizer
                part.load(templates[name], step)
            for name, part in self.shared.items():
                if shared.get(name) is not None:
                    part.load_state_dict(shared[name])
            same_layout = {"cp": 1, "ep": 1, **manifest["layout"]} == self.layout  # older checkpoints: no cp, ep
            if same_layout:
                own = upgrade_rank_state(load_rank_file(Path(path) / rank_file(self.rank)))
                for name, part in self.per_rank.items():
                    part.load_state_dict(own[name])
            self.own_step = step
            change = "" if same_layout else f", resharded from {manifest['layout']} to {self.layout}"
            how = (f"; its files' {read['total_bytes']} bytes read in one pass, checksums checked as read: "
                   f"{read['loaded_bytes'] + read['checked_bytes']} bytes over the ranks, "
                   f"{read['checked_bytes']} of them for checksums alone") if read else ""  # fmt: skip
            self.report(f"resumed from {path} (step {step}{change}){how}")
            if self.rank == 0 and (note := batch_change(Path(path), manifest, self.identity.cfg, self.layout["dp"])):
                self.report(note)
            return self._restored(Resumed(step, manifest["layout"], (Path(path) / MANIFEST).stat().st_mtime))
        if failed:
            raise CheckpointError(f"no checkpoint in {self.store.root} loads: {failed} was read into the model "
                                  f"before its checksums failed, and none older verifies; move the damaged "
                                  f"checkpoints out of {self.store.root} to train from scratch")  # fmt: skip
        return None

    def _restored(self, resumed: Resumed) -> Resumed:
        """Every part is back in place (from disk, node-local copies or the host copy): the step hooks' state
        derived from the weights they replaced is made again (`StepHooks.after_restore`)."""
        for hook in self.hooks:
            hook.after_restore()
        return resumed

    def _resume_locally(self) -> Resumed | None:
        """After an in-job restart, the node-local checkpoints when every rank has one newer than the newest
        shared checkpoint (by its manifest: the files of one that is older are not read, nor checksummed)."""
        if self.local is None or not restarted():
            return None
        newest: list[Any] = [0]
        if self.rank == 0 and (info := next(self.store.candidates(lambda message: None), None)) is not None:
            newest = [info.step]
        dist.broadcast_object_list(newest, src=0)
        restored = self.local.restore(newest[0])
        if restored is None:
            return None
        self.own_step, partners, passed_over = restored["step"], restored["from_partner"], restored["passed_over"]
        self.report(f"resumed from the node-local checkpoints of step {restored['step']}, newer than the shared one"
                    f"{f' (ranks {partners} from their partner node copy)' if partners else ''}")  # fmt: skip
        return Resumed(restored["step"], self.layout, restored["committed_at"], "local", partners, passed_over)


def read_parts(
    path: str,
    manifest: dict,
    parts: dict[str, ShardedPart],
    io_threads: int,
    rule_state: bool = True,
    verify: bool = False,
    figures: dict[str, int] | None = None,
) -> dict[str, dict]:
    """DCP-load every part's tensors that the checkpoint at `path` holds into its templates (a `strict` part's
    must all be there, in their shapes), collectively; returns the templates, by part. Without `rule_state`,
    a part that holds an update rule's state (`without_rule_state`) loads everything else. With `verify`, every
    file's checksum is checked in the same pass, each file once over the ranks (dcp_io.ParallelReader), and
    agreed by every rank before anything is returned: ChecksumMismatch on every rank where a file fails, also
    where the read itself failed on a damaged file (the templates loaded in place then hold part of it); the
    bytes read go into `figures` (dcp_io.agree_on_checks)."""
    reader = ParallelReader(path, io_threads, manifest["files"] if verify else None)
    failure = None
    try:
        with load_errors_named(path):
            metadata = read_dcp_metadata(Path(path), set(manifest["files"])).state_dict_metadata
            check_shapes(path, parts, {key: tuple(md.size) for key, md in metadata.items()})
            templates = {}
            for name, part in parts.items():
                stored = {k.removeprefix(f"{name}.") for k in metadata if k.startswith(f"{name}.")}
                if not rule_state and hasattr(part, "without_rule_state"):
                    stored = part.without_rule_state(stored)
                templates[name] = part.template(stored)
            state = {f"{name}.{k}": t for name, ts in templates.items() for k, t in ts.items()}
            slices = {key: t for key, t in state.items() if isinstance(t, FlatSlice)}  # a range of the stored tensor
            tensors = {key: t for key, t in state.items() if key not in slices}
            dcp.load(tensors, storage_reader=reader, planner=SliceLoadPlanner(slices))
    except CheckpointError as err:
        if not verify:
            raise
        failure = err  # a damaged file's, or the checkpoint's own: the checksums tell
    if verify:
        problem, read = agree_on_checks(Path(path), reader.checks, io_threads)
        if figures is not None:
            figures.update(read)
        if problem:
            raise ChecksumMismatch(problem)
    if failure is not None:
        raise failure
    return templates


def check_shapes(path: str, parts: dict[str, ShardedPart], stored: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of a `strict` part (the model) must be in the checkpoint with its shape."""
    problems = []
    for name, part in parts.items():
        if not getattr(part, "strict", False):
            continue
        for key, t in part.tensors().items():
            saved = stored.get(f"{name}.{key}")
            if saved != tuple(t.shape):
                problems.append(f"{key}: {'absent' if saved is None else saved} there, {tuple(t.shape)} here")
    if problems:
        listed = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise CheckpointError(f"checkpoint {path} holds a different model ({listed})")


@contextmanager
def load_errors_named(path: str) -> Iterator[None]:
    """Anything but a CheckpointError while loading `path` as one naming the checkpoint and the cause."""
    try:
        yield
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as err:  # DCP's exception derives from BaseException
        raise CheckpointError(f"loading checkpoint {path} failed: {root_cause(err)}") from None


def host_stager() -> Any:
    """DCP's stager: copies into host buffers it allocates on the first save and reuses (pinned on a GPU),
    on a thread (and a CUDA stream) of its own, so the copy overlaps the next forward and backward."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as err:  # torch < 2.9
        raise CheckpointError(f"checkpoint.async_save needs torch >= 2.9 (DCP's DefaultStager): {err}") from None
    gpu = torch.cuda.is_available()
    options = StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=gpu)  # fmt: skip
    return DefaultStager(options)


def open_stager(stager: Any) -> Any:
    """`stager`, or a new one where torch closed it after its last copy: torch 2.11's DefaultStager does so
    after every copy (pytorch/pytorch#183413), and the next copy then fails with `KeyError: <class 'type'>`."""
    inner = getattr(stager, "_state_dict_stager", None)
    return host_stager() if inner is not None and not getattr(inner, "_deepcopy_dispatch", True) else stager


def unplaced(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, DTensorSpec]]:
    """`state` for DCP's stager, each DTensor as its local tensor, and those DTensors' layouts (`placed` lays the
    copies out again). The stager copies a tensor subclass's storage when its data pointer is not null, taking
    it for one that owns its data; torch gives a DTensor the storage offset of its local tensor
    (pytorch/pytorch#167597), so one whose local tensor is a view at an offset (ZeRO-1/2's masters at dp 1,
    views of one flat buffer) has a non-null pointer into an empty storage, and the copy fails ("copy_() on
    an invalid python storage"). Local tensors it copies right, a storage they share once."""
    layouts = {k: v._spec for k, v in state.items() if isinstance(v, DTensor)}
    return {k: unwrapped(v._local_tensor if k in layouts else v) for k, v in state.items()}, layouts


def unwrapped(t: Any) -> Any:
    """A tensor subclass that wraps one tensor (torchao's float8 training weights, under train.fp8_all_gather)
    as that tensor: the stager's copy of the wrapper itself was zeros."""
    while isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        if len(names) != 1:
            break
        t = getattr(t, names[0])
    return t


def placed(staged: dict[str, Any], layouts: dict[str, DTensorSpec]) -> dict[str, Any]:
    """The stager's host copies of `unplaced`'s local tensors as DTensors again, for DCP's save plan; built on
    the copies as they are (`DTensor.from_local` would move them to the mesh's device)."""
    return {k: DTensor(v, layouts[k], requires_grad=False) if k in layouts else v for k, v in staged.items()}


def choose_async(
    asked: bool | None, ranks: int, compute_threads: int, cores: int, gpu: bool
) -> tuple[bool, str | None]:
    """Whether saves go to the background (checkpoint.async_save: `asked`, None for auto), and the start-up
    line that says why. Background work pays where it finds an idle core: each of a node's `ranks` needs
    one beside its `compute_threads` (1 on a GPU, torch's intra-op threads on a CPU); otherwise the copy,
    hashing and writes take cores from training, and a save costs more than a synchronous one."""
    need = ranks * (compute_threads + 1)
    free = gpu or need <= cores
    why = (f"{ranks} ranks x ({compute_threads} compute + 1 for the save) = {need} threads on {cores} cores here"
           + (" (a GPU computes)" if gpu else ""))  # fmt: skip
    if asked is None:
        how = "in the background" if free else "synchronously (checkpoint.async_save=true to force)"
        return free, f"checkpoint.async_save=auto: saving {how}: {why}"
    if asked and not free:
        return True, (f"checkpoint.async_save: {why}: the background copy and writes take cores from training, "
                      f"so an async save may gain little over a sync one or cost more (tools/bench_checkpoint.py "
                      f"times both); checkpoint.async_save=auto saves synchronously here")  # fmt: skip
    return asked, None


@contextmanager
def io_errors_named(doing: str, path: Path) -> Iterator[None]:
    """An OSError while writing (a full disk, a permission) as a CheckpointError naming what was being
    written and the system's reason, also when DCP wrapped it in its own exception (its tensor writer
    reports a full disk as a short write, so the free space is looked at too)."""
    try:
        yield
    except OSError as err:
        raise CheckpointError(f"{doing} failed: {err}") from None
    except CheckpointException as err:
        reason = root_cause(err)
        free = shutil.disk_usage(path).free if path.exists() else None
        if free is not None and free < 2**24 and "No space left" not in reason:
            reason = f"No space left on device ({free} bytes free there): {reason}"
        raise CheckpointError(f"{doing} failed: {reason}") from None


def root_cause(err: BaseException) -> str:
    """One line: DCP's exception carries each failed rank's exception (an OSError, if any, says most)."""
    if not isinstance(err, CheckpointException):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    causes = [pair[0] for pair in err.failures.values()]
    return root_cause(next((e for e in causes if isinstance(e, OSError)), causes[0])) if causes else "unknown"
