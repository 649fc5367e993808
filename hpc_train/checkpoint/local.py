"""Node-local checkpoints replicated to a partner node (checkpoint.local_dir, checkpoint.local_interval): an
in-job restart reads its state from node-local disk, not the shared filesystem.

Every `local_interval` steps each rank writes its own state as it holds it (checkpoint/memory_copy.py: its
shards in this layout, nothing resharded) to `local_dir` (environment variables expanded on each node, so
`$SLURM_TMPDIR` or `/tmp/x/$SLURMD_NODENAME` name each node's own disk), and sends the same bytes through a
gloo group of its own to its partner, the rank of the same local rank on the next node, which writes them
beside its own: two copies on two nodes. Each file is written under a temporary name, fsynced, checksummed
(xxh3) and renamed; its record (size, checksum, step, layout) follows it the same way, so a file without a
record is ignored. The last two steps are kept.

After an in-job restart (HPC_TRAIN_RESTART > 0) `restore` finds the newest step newer than the shared
checkpoint for which every rank's state exists in this layout, its own copy or its partner's (a node whose
disk was lost), agreed over all ranks: the partner sends a rank its copy back, every rank verifies what it
reads and restores it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.checkpoint.integrity import WRITE_ALGORITHM, file_record, new_digest
from hpc_train.checkpoint.memory_copy import MemoryCopy, split_pieces
from hpc_train.checkpoint.store import CheckpointError, step_dir_name
from hpc_train.resilience.faults import fault_point

KEEP = 2  # local steps kept


def own_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def replica_name(rank: int) -> str:
    return f"replica_of_rank{rank:05d}.pt"


def write_verified(path: Path, pieces: list[memoryview], record: dict[str, Any]) -> None:
    """`pieces`, one after another, to `path` (hashed as they go out) and its record (size, checksum and
    `record`) to `path`.json, each under a temporary name, fsynced, then renamed: a file is whole once its
    record exists."""
    digest, size = new_digest(), sum(len(piece) for piece in pieces)
    for target, content in ((path, pieces), (path.with_suffix(".json"), None)):
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as f:
            for piece in content or [json.dumps({**record, **file_record(size, digest)}).encode()]:
                f.write(piece)
                if content:
                    digest.update(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)


def read_verified(path: Path) -> memoryview:
    """The bytes of a file `write_verified` wrote, checked against its record."""
    record = json.loads(path.with_suffix(".json").read_text())
    data = memoryview(bytearray(record["size"]))  # one copy, writable: it may be sent (torch.frombuffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(data) and (n := f.readinto(data[done:])):  # a read returns at most ~2 GiB
            done += n
        if done != len(data) or f.read(1):
            raise CheckpointError(f"{path} is not {record['size']} bytes long, as its record says (corrupted)")
    digest = new_digest()
    digest.update(data)
    if digest.hexdigest() != record[WRITE_ALGORITHM]:
        raise CheckpointError(f"{path} fails its {WRITE_ALGORITHM} checksum (corrupted)")
    return data


class LocalCheckpoints:
    def __init__(self, local_dir: str, run_name: str, copy: MemoryCopy, layout: dict[str, Any], ranks_per_node: int,
                 report: Any):  # fmt: skip
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node_dir = Path(os.path.expandvars(local_dir))
        self.root = self.node_dir / run_name
        self.copy, self.layout, self.report, self.ranks_per_node = copy, layout, report, ranks_per_node
        # the same local rank on the next node keeps this rank's copy; this rank keeps the previous node's
        self.partner = (self.rank + ranks_per_node) % self.world
        self.source = (self.rank - ranks_per_node) % self.world
        self.group = dist.new_group(backend="gloo")  # bytes between host buffers, on CPU and GPU alike

    def save(self, step: int) -> dict[str, Any]:
        """Write this rank's state of `step` here and on its partner; the bytes written and the partner's rank."""
        self.copy.take(step)
        pieces = self.copy.pieces()  # views of the copy: written and sent as it lies in memory
        directory = self.root / step_dir_name(step)
        directory.mkdir(parents=True, exist_ok=True)
        record = {"step": step, "layout": self.layout}
        write_verified(directory / own_name(self.rank), pieces, record)
        replicated = self.partner != self.rank  # one node: nowhere else to keep it
        if replicated:
            received = self._exchange(pieces, self.partner, self.source)
            write_verified(directory / replica_name(self.source), [received], record)
        dist.barrier(group=self.group)  # every copy of this step written before an older one goes
        self._prune()
        if fault_point("local_saved", step, self.rank):  # a planted loss of this node: its disk, then the rank
            shutil.rmtree(self.node_dir, ignore_errors=True)
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
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)

    def _inventory(self) -> dict[str, list[int]]:
        """The steps of this layout whose own copy, and whose copy of `source`, have their record here."""
        found: dict[str, list[int]] = {"own": [], "replica": []}
        for directory in self.root.glob("step_*"):
            for kind, name in (("own", own_name(self.rank)), ("replica", replica_name(self.source))):
                try:
                    record = json.loads((directory / name).with_suffix(".json").read_text())
                except (OSError, ValueError):
                    continue
                if record.get("layout") == self.layout:
                    found[kind].append(int(record["step"]))
        return found

    def restore(self, newer_than: int) -> dict[str, Any] | None:
        """Collectively: restore the newest step after `newer_than` that every rank can have, from its own copy
        or its partner's; what was restored (`step`, the ranks that read their partner's copy), or None."""
        every = [None] * self.world
        dist.all_gather_object(every, self._inventory(), group=self.group)

        def have(r: int, s: int) -> bool:  # rank r's state of step s: its own copy, or its partner's
            return s in every[r]["own"] or s in every[(r + self.ranks_per_node) % self.world]["replica"]

        steps = sorted({s for inv in every for s in inv["own"] + inv["replica"] if s > newer_than}, reverse=True)
        step = next((s for s in steps if all(have(r, s) for r in range(self.world))), None)
        if step is None:
            return None
        lost = [r for r in range(self.world) if step not in every[r]["own"]]
        directory = self.root / step_dir_name(step)
        if self.rank in lost or self.source in lost:  # send this rank's copy of `source` back, get its own
            sends = self.source if self.source in lost else None
            pieces = split_pieces(read_verified(directory / replica_name(self.source))) if sends is not None else None
            received = self._exchange(pieces, sends, self.partner if self.rank in lost else None)
            if self.rank in lost:
                directory.mkdir(parents=True, exist_ok=True)
                write_verified(directory / own_name(self.rank), [received], {"step": step, "layout": self.layout})
        own = directory / own_name(self.rank)
        self.copy.load_bytes(read_verified(own))
        self.copy.restore()
        return {"step": step, "from_partner": lost, "committed_at": own.with_suffix(".json").stat().st_mtime}
