"""Node-local checkpoints replicated to a partner node: an in-job restart reads its state from node-local
disk (checkpoint.local_dir, checkpoint.local_interval) or host memory (checkpoint.memory_interval: a tmpfs,
MEMORY_DIR), not the shared filesystem.

Every interval each rank writes its own state as it holds it (checkpoint/memory_copy.py: its shards in
this layout, nothing resharded) to the run's own directory under `local_dir` (environment variables
expanded on each node, so `$SLURM_TMPDIR` or `/tmp/x/$SLURMD_NODENAME` name each node's own disk; one left
unset is refused), and sends the same bytes through a gloo group of its own to its partner, the rank at its
place on the next node (by node name, whatever the task distribution), which writes them beside its own:
two copies on two nodes. Where a rank's twin (a dp replica at ZeRO-0) is on another node, its own copy
holds this rank's tensors too, and the partner is sent the small parts alone. Each file is written under a
temporary name, checksummed (xxh3) and renamed, not fsynced (`write_verified` says why); its record (size,
checksum, step, layout, run, Slurm job) follows it the same way, so a file without a record is ignored.
The last two steps are kept: the older one is deleted on a thread before a new step is written. A save in
the background (memory checkpoints, where saves go to the background) copies the small parts at once and
the rest on a thread during the next step's forward and backward; its update waits until every rank's
copies are kept (`stored`).

Copies are this run's only: the run's directory is named by its name and its shared checkpoint
directory, which the directory lock gives to one live run at a time; a first start (not an in-job restart
nor a requeue of the job) deletes what an earlier job of the run left there, and a run that ends deletes
its copies; each record names the run (`RunIdentity.digest`: its config, data and checkpoint directory)
and a copy of another is never read.

After an in-job restart (HPC_TRAIN_RESTART > 0) or a requeue of the job, `restore` finds the newest step
newer than the shared checkpoint for which every rank's state exists in this layout, its own copy or its
partner's (a node whose disk was lost; with its twin's tensors), agreed over all ranks: the partner (and
the twin) send a rank its copy back, every rank verifies what it reads and restores it. A copy that fails
its checks counts as lost: its partner's is read instead, or, where that fails too, an older step (the
shared checkpoint where none is left). Newer steps are deleted: the steps trained again are saved again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.bootstrap import node_name
from hpc_train.checkpoint.integrity import WRITE_ALGORITHM, file_record, new_digest
from hpc_train.checkpoint.memory_copy import MemoryCopy, split_pieces
from hpc_train.checkpoint.store import (
    STEP_DIR,
    CheckpointError,
    empty_trash,
    in_background,
    step_dir_name,
    to_trash,
)
from hpc_train.config import ConfigError, expand_on_node
from hpc_train.distributed.agree import raise_together
from hpc_train.resilience.faults import fault_point

KEEP = 2  # local steps kept
SPARES = "spares"  # each rank's files of a pruned step, written over by the next (beside the steps)


def own_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def replica_name(rank: int) -> str:
    return f"replica_of_rank{rank:05d}.pt"


def write_verified(path: Path, pieces: list[memoryview], record: dict[str, Any], spare: Path | None = None) -> None:
    """`pieces`, one after another, to `path` under a temporary name, then `seal`ed. Not fsynced: a copy
    outlives its process's death in the page cache, a node's loss is what the partner's copy is for, and a
    file torn by a crash fails its checksum (`restore` passes it over); the flush to disk, which costs a local
    save more than half its time, is left to the kernel, and a file pruned before it is never written at all.
    A `spare` file (a pruned step's, `LocalCheckpoints._prune`) is written over in place: its pages are there
    already (on a tmpfs, half the time of a new file's)."""
    tmp = path.with_name(path.name + ".tmp")
    reused = spare is not None and moved(spare, tmp)
    with open(tmp, "r+b" if reused else "wb") as f:
        for piece in pieces:
            f.write(piece)
        f.truncate()
    seal(tmp, path, pieces, record)


def seal(tmp: Path, path: Path, content: list[memoryview], record: dict[str, Any]) -> None:
    """A file written at `tmp` (its `content`) renamed to `path`, then its record (size, checksum and
    `record`) to `path`.json the same way: a file is whole once its record exists."""
    digest = new_digest()
    for piece in content:
        digest.update(piece)
    os.replace(tmp, path)
    described = path.with_suffix(".json")
    staged = described.with_name(described.name + ".tmp")
    staged.write_text(json.dumps({**record, **file_record(sum(len(piece) for piece in content), digest)}))
    os.replace(staged, described)


def mapped(path: Path, nbytes: int, spare: Path | None = None) -> torch.Tensor:
    """A file of `nbytes` at `path` (`spare` renamed there where it is: its pages are there already), its
    pages mapped into memory as a uint8 tensor: what is copied into it is the file's content, with no write
    (on a tmpfs, a copy into pages already there takes a third of a write's time)."""
    reused = spare is not None and moved(spare, path)
    with open(path, "r+b" if reused else "w+b") as f:
        f.truncate(nbytes)
        populated = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # its pages mapped at once, not one by one
        return torch.frombuffer(mmap.mmap(f.fileno(), nbytes, flags=populated), dtype=torch.uint8)


def moved(path: Path, to: Path) -> bool:
    """`path` renamed to `to`; False where it is not there."""
    try:
        os.replace(path, to)
        return True
    except FileNotFoundError:
        return False


READ_CHUNK = 64 << 20  # bytes read, then hashed while still in cache


def read_verified(path: Path, allocate: Callable[[int], torch.Tensor]) -> memoryview:
    """The bytes of a file `write_verified` wrote, checked against its record, in a buffer `allocate` gives
    (writable: it may be sent; not zero-filled first)."""
    record = json.loads(path.with_suffix(".json").read_text())
    if path.stat().st_size != record["size"]:  # before allocating what a damaged record says
        raise CheckpointError(f"{path} is not {record['size']} bytes long, as its record says (corrupted)")
    data = memoryview(allocate(record["size"]).numpy()).cast("B")
    digest = new_digest()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(data) and (n := f.readinto(data[done : done + READ_CHUNK])):
            digest.update(data[done : done + n])
            done += n
        if done != len(data) or f.read(1):
            raise CheckpointError(f"{path} is not {record['size']} bytes long, as its record says (corrupted)")
    if digest.hexdigest() != record[WRITE_ALGORITHM]:
        raise CheckpointError(f"{path} fails its {WRITE_ALGORITHM} checksum (corrupted)")
    return data


def local_run_root(local_dir: str, run_name: str, checkpoint_dir: str) -> Path:
    """A run's directory under `local_dir` as this node expands it: its name and a digest of its shared
    checkpoint directory, which the directory lock gives to one live run at a time, so that runs of one name
    never share, prune or delete each other's copies, and the local steps never lie where the shared ones do
    (local_dir/<name> may be checkpoint.dir). A variable left unexpanded is a ConfigError."""
    digest = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]
    return Path(expand_on_node("checkpoint.local_dir", local_dir)) / f"{run_name}-{digest}"


def partner_ranks(nodes: list[str]) -> list[int]:
    """Each rank's partner (`nodes`: each rank's node name), which keeps a copy of its state: the rank at its
    place among its node's ranks on the next node (nodes in the order of their first rank), so the two copies
    lie on two nodes under any task distribution (block, cyclic, plane). Every rank is its own (no copy) on
    one node, or where the nodes hold different numbers of ranks."""
    order = list(dict.fromkeys(nodes))
    on = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    if len(order) == 1 or len({len(ranks) for ranks in on.values()}) > 1:
        return list(range(len(nodes)))
    return [on[order[(order.index(n) + 1) % len(order)]][on[n].index(r)] for r, n in enumerate(nodes)]


def twin_ranks(nodes: list[str], replicas: list[list[int]]) -> list[int | None]:
    """Each rank's twin (`replicas`: each rank's group of ranks holding the same tensors, its dp group at
    ZeRO-0): the first of them on another node, whose own copy holds this rank's tensors too, so that its
    partner need keep only the small parts (RNG, sampler); None where every one is on its node."""
    return [next((t for t in group if nodes[t] != nodes[r]), None) for r, group in enumerate(replicas)]


def restarted() -> bool:
    """An in-job restart of the ranks, or Slurm's requeue of the job (its own copies are read: the records
    name the job)."""
    return os.environ.get("HPC_TRAIN_RESTART", "0") != "0" or os.environ.get("SLURM_RESTART_COUNT", "0") != "0"


def local_steps(root: Path) -> dict[int, Path]:
    """The step directories under `root`, by step (named as the shared store names its steps)."""
    return {int(m.group(1)): p for p in root.glob("step_*") if (m := STEP_DIR.match(p.name)) and p.is_dir()}


def joined(head: memoryview, body: memoryview, allocate: Callable[[int], torch.Tensor]) -> memoryview:
    """A state copy's header and buffer, from two sources, in one buffer `allocate` gives."""
    data = memoryview(allocate(len(head) + len(body)).numpy()).cast("B")
    data[: len(head)], data[len(head) :] = head, body
    return data


def discard(paths: list[Path]) -> threading.Thread:
    """Delete `paths` on a thread, each out of every reader's sight at once (`to_trash`: several ranks of a
    node may discard one path, and the first rename wins)."""
    for path in paths:
        to_trash(path)

    def delete() -> None:
        for parent in {path.parent for path in paths}:
            empty_trash(parent)

    thread = threading.Thread(target=delete, name="local-checkpoint-delete", daemon=True)
    thread.start()
    return thread


class LocalCheckpoints:
    def __init__(self, local_dir: str, run_name: str, checkpoint_dir: str, run_id: str, copy: MemoryCopy,
                 layout: dict[str, Any], report: Any, replicas: list[int] | None = None,
                 in_memory: bool = False):  # fmt: skip
        """Collectively: `run_id` names the run in each record (a copy of another run is never read);
        `replicas`: the ranks whose tensors are this rank's (its dp group at ZeRO-0; None: its own only);
        `in_memory`: `local_dir` is a tmpfs (memory checkpoints), whose files' pages are the copies."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # bytes between host buffers, on CPU and GPU alike
        problem = None
        try:
            self.root = local_run_root(local_dir, run_name, checkpoint_dir)
        except ConfigError as err:
            problem = str(err)
        raise_together(problem, self.group, ConfigError)  # a node's own unset variable stops every rank
        self.copy, self.report, self.in_memory = copy, report, in_memory
        # what a copy must hold to be read: a requeued job (the same Slurm job) reads its own copies alone
        self.record = {"layout": layout, "run": run_id, "job": os.environ.get("SLURM_JOB_ID")}
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (node_name(), replicas or [self.rank]), group=self.group)
        nodes = [node for node, _ in every]
        self.partners = partner_ranks(nodes)
        self.twins = twin_ranks(nodes, [group for _, group in every])
        if len(set(nodes)) > 1 and self.partners[self.rank] == self.rank:
            report("node-local checkpoints: the nodes hold different numbers of ranks; no partner copies are kept")
        # this rank's partner keeps this rank's copy; this rank keeps its source's
        self.partner, self.source = self.partners[self.rank], self.partners.index(self.rank)
        self.pruning: threading.Thread | None = None  # older steps being deleted after a save
        self.in_flight: Future | None = None  # a save in the background (`save(background=True)`)
        self.wait_s = 0.0  # how long updates waited for it

    def start(self) -> None:
        """Collectively, once the run holds its checkpoint directory: on a first start (not an in-job restart
        nor a requeue of the job, which read them) delete what an earlier job of this run left on the node,
        which a resumed run could otherwise take for its own steps (the shared checkpoint it resumes may be
        older)."""
        problem = None
        if not restarted():
            try:
                discard([self.root]).join()
            except OSError as err:  # a node whose disk refuses: every rank stops, none waits on it
                problem = f"node-local checkpoints: cannot clear {self.root} on {node_name()}: {err}"
        raise_together(problem, self.group)  # and nothing is deleted once any rank saves

    def finish(self) -> None:
        """Collectively, at the run's end: its copies deleted on every node (the shared checkpoint holds its
        end; an in-job restart reads them only within the job)."""
        self.settle()
        if self.pruning is not None:
            self.pruning.join()
        dist.barrier(group=self.group)  # no rank still writing or reading a copy
        try:
            discard([self.root]).join()
        except OSError as err:  # the run itself ended well
            self.report(f"node-local checkpoints: could not delete {self.root} on {node_name()}: {err}")

    def save(self, step: int, background: bool = False) -> dict[str, Any]:
        """This rank's state of `step` here and on its partner: at once (the bytes written, `local_bytes`, and
        `sent_bytes` to `partner`), or with `background` its small parts now and the rest on a thread while
        the next step's forward and backward run, done before its update (`stored`): then the time it
        blocked (`blocked_s`) and what the previous save did (`saved`, as at once, with `wait_s`, what the
        update waited for it)."""
        start = time.perf_counter()
        previous = self.settle()
        self.copy.take_small(step)
        if not background:
            return self._store(step)
        self.in_flight = in_background(self._store, step)
        return {"blocked_s": time.perf_counter() - start, **({"saved": previous} if previous else {})}

    def stored(self) -> None:
        """Before the weights or the optimizer state change: a background save is done, its copy taken and
        kept here and at the partner. So a rank that dies once a step's update has begun leaves the step
        before it whole on every node; its error is raised at `settle`."""
        if self.in_flight is not None and not self.in_flight.done():
            start = time.perf_counter()
            wait([self.in_flight])
            self.wait_s += time.perf_counter() - start

    def settle(self) -> dict[str, Any] | None:
        """Wait for a background save in flight: its figures (and `wait_s`, what the update waited for it),
        or its error raised."""
        if self.in_flight is None:
            return None
        in_flight, self.in_flight = self.in_flight, None
        figures = {**in_flight.result(), "wait_s": self.wait_s}  # the update's wait alone, not this one's
        self.wait_s = 0.0
        return figures

    def _store(self, step: int) -> dict[str, Any]:
        """Copy the tensors of `step` (its small parts are copied), keep the copy here and at the partner,
        and keep this step and the one before: in memory, the copy and the partner's are made straight into
        the files' mapped pages; on disk, they are written from the copy."""
        start = time.perf_counter()
        self._prune(step)
        directory = self.root / step_dir_name(step)
        directory.mkdir(parents=True, exist_ok=True)
        record, spares = {"step": step, **self.record}, self.root / SPARES
        own, replica = directory / own_name(self.rank), directory / replica_name(self.source)
        if self.in_memory:
            pieces = self._copy_into(own.with_name(own.name + ".tmp"), spares / own_name(self.rank))
            copied = time.perf_counter()
            seal(own.with_name(own.name + ".tmp"), own, pieces, record)
        else:
            self.copy.take_tensors()
            copied = time.perf_counter()
            pieces = self.copy.pieces()  # views of the copy: written and sent as it lies in memory
            write_verified(own, pieces, record, spares / own_name(self.rank))
        replicated = self.partner != self.rank  # one node: nowhere else to keep it
        sent = [pieces[0], memoryview(b"")] if self.twins[self.rank] is not None else pieces  # a twin holds the rest
        if replicated:
            record = {**record, "header_only": self.twins[self.source] is not None}
            staged = replica.with_name(replica.name + ".tmp")
            into = (lambda source, n: mapped(staged, n, spares / replica_name(source))) if self.in_memory else None
            received = self._transfer({self.partner: sent}, [self.source], into)[self.source]
            if self.in_memory:
                seal(staged, replica, [received], record)
            else:
                write_verified(replica, [received], record, spares / replica_name(self.source))
        dist.barrier(group=self.group)  # every copy of this step written before the next save prunes the last
        fault = fault_point("local_saved", step, self.rank)
        if fault == "corrupt":  # a planted bit flip in this rank's own file: its restore must not trust it
            with open(directory / own_name(self.rank), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        if fault == "wipe":  # a planted loss of this node: the run's copies on its disk, then the rank
            shutil.rmtree(self.root, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"step": step, "local_bytes": sum(len(piece) for piece in pieces),
                "sent_bytes": sum(len(piece) for piece in sent) if replicated else 0,
                "partner": self.partner if replicated else None, "copy_s": copied - start,
                "store_s": time.perf_counter() - copied}  # fmt: skip

    def _copy_into(self, path: Path, spare: Path) -> list[memoryview]:
        """This rank's copy made in the pages of a file at `path` (`spare`'s where it is), mapped into memory:
        the header, then the tensors copied straight in; the pieces of the file (held by the copy, and so
        mapped, until its next take)."""
        whole: list[torch.Tensor] = []

        def place(nbytes: int, head: memoryview) -> torch.Tensor:
            whole.append(mapped(path, len(head) + nbytes, spare))
            whole[0][: len(head)].copy_(torch.frombuffer(head, dtype=torch.uint8))
            return whole[0][len(head) :]

        self.copy.take_tensors(place)
        head = len(whole[0]) - self.copy.nbytes()
        return [memoryview(whole[0][:head].numpy()), memoryview(whole[0][head:].numpy())]

    def _transfer(self, sends: dict[int, list[memoryview]], sources: list[int],
                  into: Callable[[int, int], torch.Tensor] | None = None) -> dict[int, memoryview]:  # fmt: skip
        """Send each of `sends` (a rank, the pieces of a copy: header, buffer; either may be empty) while
        receiving from each of `sources` into one buffer each (`into(source, bytes)`, else host memory), their
        sizes first."""
        sizes = {source: torch.zeros(2, dtype=torch.int64) for source in sources}
        lengths = {to: [torch.tensor([len(p) for p in pieces], dtype=torch.int64)] for to, pieces in sends.items()}
        self._send_receive(lengths, {source: [t] for source, t in sizes.items()})
        allocate = into or (lambda source, n: torch.empty(n, dtype=torch.uint8))
        buffers = {source: allocate(source, int(t.sum())) for source, t in sizes.items()}
        parts = {source: [b[: int(sizes[source][0])], b[int(sizes[source][0]) :]] for source, b in buffers.items()}
        self._send_receive({to: [torch.frombuffer(p, dtype=torch.uint8) for p in pieces if len(p)]
                            for to, pieces in sends.items()},
                           {source: [part for part in two if len(part)] for source, two in parts.items()})  # fmt: skip
        return {source: memoryview(b.numpy()) for source, b in buffers.items()}

    def _send_receive(self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, to, self.group) for to, ts in sends.items() for t in ts]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for source, ts in receives.items() for t in ts]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def _prune(self, step: int) -> None:
        """Before `step` is written, the steps older than the newest before it (the KEEP - 1 kept, complete on
        every rank since the last save's barrier) go, so that no more than KEEP steps are ever held: this
        rank's files of the one before it out of `restore`'s sight (its records first) and kept as spares
        that the new step's files are written over, the directory removed by the last of the node's ranks to
        leave it; anything older (a rank that did not take its files) deleted behind the training on a thread
        (freeing a GB takes ~1 s)."""
        if self.pruning is not None:
            self.pruning.join()
        older = [path for at, path in sorted(local_steps(self.root).items()) if at < step]
        if len(older) >= KEEP:
            spares, last = self.root / SPARES, older[-KEEP]
            spares.mkdir(exist_ok=True)
            for name in (own_name(self.rank), replica_name(self.source)):
                (last / name).with_suffix(".json").unlink(missing_ok=True)
                moved(last / name, spares / name)
            with contextlib.suppress(OSError):  # not empty: another rank of the node takes its files still
                last.rmdir()
        self.pruning = discard(older[:-KEEP])

    def _inventory(self) -> dict[str, Any]:
        """The steps of this run and layout whose own copy, and whose copy of `source` (by step: whether it
        holds the small parts only), have their record here."""
        found: dict[str, Any] = {"own": [], "replica": {}}
        for directory in local_steps(self.root).values():
            for kind, name in (("own", own_name(self.rank)), ("replica", replica_name(self.source))):
                try:
                    record = json.loads((directory / name).with_suffix(".json").read_text())
                except (OSError, ValueError):
                    continue
                if all(record.get(key) == value for key, value in self.record.items()):
                    if kind == "own":
                        found["own"].append(int(record["step"]))
                    else:
                        found["replica"][int(record["step"])] = bool(record.get("header_only"))
        return found

    def restore(self, newer_than: int) -> dict[str, Any] | None:
        """Collectively: restore the newest step after `newer_than` that every rank can have, from its own copy
        or its partner's (with its twin's tensors where the partner keeps the small parts only), passing over
        a copy that fails its checks (to the partner's, else to an older step); the steps newer than the one
        restored are deleted. What was restored (`step`, the ranks that read their partner's copy, the copies
        passed over), or None."""
        every = [None] * self.world
        dist.all_gather_object(every, self._inventory(), group=self.group)

        def have(r: int, s: int) -> bool:  # rank r's state of step s: its own copy, or its partner's (and twin's)
            replicas, twin = every[self.partners[r]]["replica"], self.twins[r]
            if s in every[r]["own"] or (s in replicas and not replicas[s]):
                return True
            return s in replicas and twin is not None and s in every[twin]["own"]

        steps = sorted({s for inv in every for s in [*inv["own"], *inv["replica"]] if s > newer_than}, reverse=True)
        passed_over: list[str] = []
        restored = None
        for step in (s for s in steps if all(have(r, s) for r in range(self.world))):
            if (restored := self._restore_step(step, every, passed_over)) is not None:
                break
        for problem in passed_over:
            self.report(f"node-local checkpoints: passed over {problem}")
        # what was passed over goes (the steps the run trains again are saved again, never a mix of the two)
        last = newer_than if restored is None else restored["step"]
        discard([path for at, path in local_steps(self.root).items() if at > last]).join()
        dist.barrier(group=self.group)  # and before any rank saves again
        return None if restored is None else {**restored, "passed_over": passed_over}

    def _restore_step(self, step: int, every: list[dict], passed_over: list[str]) -> dict[str, Any] | None:
        """Every rank reads its own copy of `step` (a rank whose copy is missing or fails its checks gets its
        partner's, with its twin's tensors where the partner keeps its small parts only), agreed over all
        ranks: what was restored, or None (nothing changed) where some rank's state is in no copy; what
        failed its checks joins `passed_over`."""
        directory = self.root / step_dir_name(step)
        own = self._read(directory / own_name(self.rank)) if step in every[self.rank]["own"] else None
        lost = self._agree(own, passed_over)
        # the partner of a rank whose own copy is unusable reads its replica (on one node there is none: the
        # rank is its own partner, and its state is missing)
        keeps_replica = self.source in lost and self.source != self.rank and step in every[self.rank]["replica"]
        replica = self._read(directory / replica_name(self.source)) if keeps_replica else None
        if self._agree(replica if self.source in lost else b"", passed_over):
            return None
        # a lost rank whose partner keeps its small parts only takes its tensors from its twin's own copy
        halves = {r for r in lost if every[self.partners[r]]["replica"][step]}
        if any(self.twins[r] in lost for r in halves):
            return None
        sends = {self.source: split_pieces(replica)} if self.source in lost else {}  # (header, buffer)
        for r in (r for r in halves if self.twins[r] == self.rank):  # the twin sends its buffer (the partner's
            sends[r] = [sends[r][0] if r in sends else memoryview(b""), split_pieces(own)[1]]  # header, if it is)
        takes_twins = self.rank in halves and self.twins[self.rank] != self.partner
        sources = [self.partner, *([self.twins[self.rank]] if takes_twins else [])] if self.rank in lost else []
        received = self._transfer(sends, sources)
        if self.rank in lost:  # verified by the partner's (and the twin's) reads; kept here again for a later restart
            own = received[self.partner]
            if takes_twins:
                own = joined(split_pieces(own)[0], received[self.twins[self.rank]], self.copy.host_buffer)
            try:  # where this node's disk fails, the restore goes on without the copy (the others wait)
                directory.mkdir(parents=True, exist_ok=True)
                write_verified(directory / own_name(self.rank), [own], {"step": step, **self.record})
            except OSError as err:
                self.report(f"node-local checkpoints: rank {self.rank} could not keep its restored copy: {err}")
        self.copy.load_bytes(own, reusable=self.rank not in lost)  # read into a buffer of the copy's kind
        self.copy.restore()
        record = (directory / own_name(self.rank)).with_suffix(".json")
        committed_at = record.stat().st_mtime if record.exists() else 0.0
        return {"step": step, "from_partner": lost, "committed_at": committed_at}

    def _read(self, path: Path) -> memoryview | str:
        """The verified bytes of a local file, or why it cannot be used."""
        try:
            return read_verified(path, self.copy.host_buffer)
        except Exception as err:  # any: a rank that raised here alone would leave the others in the agreement
            return f"rank {self.rank}: {err}"

    def _agree(self, held: memoryview | bytes | str | None, passed_over: list[str]) -> list[int]:
        """The ranks whose `held` is not usable (None: missing; a string: why it failed its checks), known to
        every rank; each failure joins `passed_over`."""
        problems: list[str | bool | None] = [None] * self.world
        dist.all_gather_object(problems, held if isinstance(held, str) else held is None, group=self.group)
        passed_over += [p for p in problems if isinstance(p, str)]
        return [r for r, p in enumerate(problems) if p]
