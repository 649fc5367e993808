"""Node-local checkpoints replicated to a partner node (checkpoint.local_dir, checkpoint.local_interval): an
in-job restart reads its state from node-local disk, not the shared filesystem.

Every `local_interval` steps each rank writes its own state as it holds it (checkpoint/memory_copy.py: its
shards in this layout, nothing resharded) to the run's own directory under `local_dir` (environment
variables expanded on each node, so `$SLURM_TMPDIR` or `/tmp/x/$SLURMD_NODENAME` name each node's own disk;
one left unset is refused), and sends the same bytes through a gloo group of its own to its partner, the
rank at its place on the next node (by node name, whatever the task distribution), which writes them beside
its own: two copies on two nodes. Each file is written under a temporary name, checksummed (xxh3) and
renamed, not fsynced (`write_verified` says why); its record (size, checksum, step, layout, run) follows it
the same way, so a file without a record is ignored. The last two steps are kept; older ones are deleted
on a thread.

Copies are this run's only: the run's directory is named by its name and its shared checkpoint
directory, which the directory lock gives to one live run at a time; a first start (not an in-job restart)
deletes what an earlier job of the run left there, and a run that ends deletes its copies; each record
names the run (`RunIdentity.digest`: its config, data and checkpoint directory) and a copy of another is
never read.

After an in-job restart (HPC_TRAIN_RESTART > 0) `restore` finds the newest step newer than the shared
checkpoint for which every rank's state exists in this layout, its own copy or its partner's (a node whose
disk was lost), agreed over all ranks: the partner sends a rank its copy back, every rank verifies what it
reads and restores it. A copy that fails its checks counts as lost: its partner's is read instead, or,
where that fails too, an older step (the shared checkpoint where none is left).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.bootstrap import node_name
from hpc_train.checkpoint.integrity import WRITE_ALGORITHM, file_record, new_digest
from hpc_train.checkpoint.memory_copy import MemoryCopy, split_pieces
from hpc_train.checkpoint.store import CheckpointError, empty_trash, step_dir_name, to_trash
from hpc_train.config import ConfigError, expand_on_node
from hpc_train.distributed.agree import raise_together
from hpc_train.resilience.faults import fault_point

KEEP = 2  # local steps kept


def own_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def replica_name(rank: int) -> str:
    return f"replica_of_rank{rank:05d}.pt"


def write_verified(path: Path, pieces: list[memoryview], record: dict[str, Any]) -> None:
    """`pieces`, one after another, to `path` (hashed as they go out) and its record (size, checksum and
    `record`) to `path`.json, each under a temporary name, then renamed: a file is whole once its record
    exists. Not fsynced: a copy outlives its process's death in the page cache, a node's loss is what the
    partner's copy is for, and a file torn by a crash fails its checksum (`restore` passes it over); the
    flush to disk, which costs a local save more than half its time, is left to the kernel, and a file
    pruned before it is never written at all."""
    digest, size = new_digest(), sum(len(piece) for piece in pieces)
    for target, content in ((path, pieces), (path.with_suffix(".json"), None)):
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as f:
            for piece in content or [json.dumps({**record, **file_record(size, digest)}).encode()]:
                f.write(piece)
                if content:
                    digest.update(piece)
        os.replace(tmp, target)


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
                 layout: dict[str, Any], report: Any):  # fmt: skip
        """Collectively: `run_id` names the run in each record (a copy of another run is never read)."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # bytes between host buffers, on CPU and GPU alike
        problem = None
        try:
            self.root = local_run_root(local_dir, run_name, checkpoint_dir)
        except ConfigError as err:
            problem = str(err)
        raise_together(problem, self.group, ConfigError)  # a node's own unset variable stops every rank
        self.copy, self.report = copy, report
        self.record = {"layout": layout, "run": run_id}  # what a copy must hold to be read
        nodes: list[str | None] = [None] * self.world
        dist.all_gather_object(nodes, node_name(), group=self.group)
        self.partners = partner_ranks(nodes)
        if len(set(nodes)) > 1 and self.partners[self.rank] == self.rank:
            report("node-local checkpoints: the nodes hold different numbers of ranks; no partner copies are kept")
        # this rank's partner keeps this rank's copy; this rank keeps its source's
        self.partner, self.source = self.partners[self.rank], self.partners.index(self.rank)
        self.pruning: threading.Thread | None = None  # older steps being deleted after a save

    def start(self) -> None:
        """Collectively, once the run holds its checkpoint directory: on a first start (not an in-job restart,
        which reads them) delete what an earlier job of this run left on the node, which a resumed run
        could otherwise take for its own steps (the shared checkpoint it resumes may be older)."""
        problem = None
        if os.environ.get("HPC_TRAIN_RESTART", "0") == "0":
            try:
                discard([self.root]).join()
            except OSError as err:  # a node whose disk refuses: every rank stops, none waits on it
                problem = f"node-local checkpoints: cannot clear {self.root} on {node_name()}: {err}"
        raise_together(problem, self.group)  # and nothing is deleted once any rank saves

    def finish(self) -> None:
        """Collectively, at the run's end: its copies deleted on every node (the shared checkpoint holds its
        end; an in-job restart reads them only within the job)."""
        if self.pruning is not None:
            self.pruning.join()
        dist.barrier(group=self.group)  # no rank still writing or reading a copy
        try:
            discard([self.root]).join()
        except OSError as err:  # the run itself ended well
            self.report(f"node-local checkpoints: could not delete {self.root} on {node_name()}: {err}")

    def save(self, step: int) -> dict[str, Any]:
        """Write this rank's state of `step` here and on its partner; the bytes written and the partner's rank."""
        self.copy.take(step)
        pieces = self.copy.pieces()  # views of the copy: written and sent as it lies in memory
        directory = self.root / step_dir_name(step)
        directory.mkdir(parents=True, exist_ok=True)
        record = {"step": step, **self.record}
        write_verified(directory / own_name(self.rank), pieces, record)
        replicated = self.partner != self.rank  # one node: nowhere else to keep it
        if replicated:
            received = self._exchange(pieces, self.partner, self.source)
            write_verified(directory / replica_name(self.source), [received], record)
        dist.barrier(group=self.group)  # every copy of this step written before an older one goes
        self._prune()
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
        return {"local_bytes": sum(len(piece) for piece in pieces), "partner": self.partner if replicated else None}

    def _exchange(self, pieces: list[memoryview] | None, to: int | None, source: int | None) -> memoryview:
        """Send a state copy's `pieces` (header, buffer) to rank `to` while receiving a rank `source`'s into one
        buffer (None: not that half), their sizes first."""
        sizes = torch.zeros(2, dtype=torch.int64)
        sent = [torch.tensor([len(p) for p in pieces], dtype=torch.int64)] if to is not None else []
        self._send_receive(sent, to, [sizes] if source is not None else [], source)
        buffer, head = torch.empty(int(sizes.sum()), dtype=torch.uint8), int(sizes[0])
        sent = [torch.frombuffer(p, dtype=torch.uint8) for p in pieces if len(p)] if to is not None else []
        self._send_receive(sent, to, [part for part in (buffer[:head], buffer[head:]) if len(part)], source)
        return memoryview(buffer.numpy())

    def _send_receive(self, sends: list[torch.Tensor], to: int | None, receives: list[torch.Tensor],
                      source: int | None) -> None:  # fmt: skip
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in receives]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def _prune(self) -> None:
        """Steps older than the last KEEP out of `restore`'s sight at once, deleted behind the training on a
        thread (freeing a GB takes ~1 s)."""
        if self.pruning is not None:
            self.pruning.join()
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        self.pruning = discard(steps[:-KEEP])

    def _inventory(self) -> dict[str, list[int]]:
        """The steps of this run and layout whose own copy, and whose copy of `source`, have their record here."""
        found: dict[str, list[int]] = {"own": [], "replica": []}
        for directory in self.root.glob("step_*"):
            for kind, name in (("own", own_name(self.rank)), ("replica", replica_name(self.source))):
                try:
                    record = json.loads((directory / name).with_suffix(".json").read_text())
                except (OSError, ValueError):
                    continue
                if all(record.get(key) == value for key, value in self.record.items()):
                    found[kind].append(int(record["step"]))
        return found

    def restore(self, newer_than: int) -> dict[str, Any] | None:
        """Collectively: restore the newest step after `newer_than` that every rank can have, from its own copy
        or its partner's, passing over a copy that fails its checks (to the partner's, else to an older step);
        what was restored (`step`, the ranks that read their partner's copy, the copies passed over), or None."""
        every = [None] * self.world
        dist.all_gather_object(every, self._inventory(), group=self.group)

        def have(r: int, s: int) -> bool:  # rank r's state of step s: its own copy, or its partner's
            return s in every[r]["own"] or s in every[self.partners[r]]["replica"]

        steps = sorted({s for inv in every for s in inv["own"] + inv["replica"] if s > newer_than}, reverse=True)
        passed_over: list[str] = []
        restored = None
        for step in (s for s in steps if all(have(r, s) for r in range(self.world))):
            if (restored := self._restore_step(step, every, passed_over)) is not None:
                break
        for problem in passed_over:
            self.report(f"node-local checkpoints: passed over {problem}")
        return None if restored is None else {**restored, "passed_over": passed_over}

    def _restore_step(self, step: int, every: list[dict], passed_over: list[str]) -> dict[str, Any] | None:
        """Every rank reads its own copy of `step` (a rank whose copy is missing or fails its checks gets its
        partner's), agreed over all ranks: what was restored, or None (nothing changed) where some rank's state
        is in neither copy; what failed its checks joins `passed_over`."""
        directory = self.root / step_dir_name(step)
        own = self._read(directory / own_name(self.rank)) if step in every[self.rank]["own"] else None
        lost = self._agree(own, passed_over)
        # the partner of a rank whose own copy is unusable reads its replica (on one node there is none: the
        # rank is its own partner, and its state is missing)
        keeps_replica = self.source in lost and self.source != self.rank and step in every[self.rank]["replica"]
        replica = self._read(directory / replica_name(self.source)) if keeps_replica else None
        if self._agree(replica if self.source in lost else b"", passed_over):
            return None
        sends = self.source if self.source in lost else None  # send this rank's copy of `source` back
        pieces = split_pieces(replica) if sends is not None else None
        if self.rank in lost or sends is not None:
            received = self._exchange(pieces, sends, self.partner if self.rank in lost else None)
            if self.rank in lost:  # verified by the partner's read; kept here again for a later restart
                own = received
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
