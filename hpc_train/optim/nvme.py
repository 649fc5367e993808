"""optim.offload=nvme (ZeRO-Infinity's optimizer offload): state that fits neither the device nor the host.

A rank's fp32 master weights and its update rule's state (AdamW's two moments) live in files under
`optim.offload_dir/rank<r>/`, one file per key, each laid out as the rank's flat owned slice. An update
streams them through a ring of host buffers (`optim.offload_buffer_mb` in all; pinned on CUDA): while one
chunk updates, a reader thread reads the next into the next slot and a writer thread writes the last one
back, so host memory holds the ring whatever the state's size. The files are opened with O_DIRECT where
the filesystem takes it (the page cache would otherwise keep a second copy of the state in host memory),
and `describe` says which. The files are the working copy of the state and a checkpoint is its durable
one: a run (re)starting writes them again, from the checkpoint or from the model's weights.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_train.config import ConfigError

ALIGN = 4096  # bytes: O_DIRECT's alignment of buffers, offsets and lengths on any common device
ELEMENTS = ALIGN // 4  # fp32 elements per aligned block
# chunks in flight: two read ahead, one updating, one being written behind (a slot is read into two
# chunks after its write began, so the write overlaps the next chunk's update)
SLOTS = 4
READ_AHEAD = SLOTS - 2
# filesystems a node's own disk is not: the state would cross a network every step (memory-backed ones,
# tmpfs and ramfs, are the node's own, but hold the state in host memory: the start-up line says so)
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "wekafs",
                       "panfs", "afs", "9p", "fuse.sshfs", "fuse.glusterfs", "fuse.juicefs", "fuse.gcsfuse",
                       "fuse.s3fs", "fuse.ceph"}  # fmt: skip
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}


def filesystem_of(path: str | os.PathLike, mounts_text: str | None = None) -> str:
    """The type of the filesystem `path` is on ('' where unknown): the longest mount point of /proc/mounts
    (or `mounts_text`, as it reads) that holds it, its escapes (a space is \\040) decoded."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return ""
    target = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def aligned_empty(numel: int, pinned: bool) -> torch.Tensor:
    """fp32 host memory whose first element sits on an ALIGN boundary, as O_DIRECT wants it: pinned memory
    comes in whole pages already (asked for as is: its allocator rounds a request up to a power of two)."""
    if pinned:
        buffer = torch.empty(numel, dtype=torch.float32, pin_memory=True)
        assert buffer.data_ptr() % ALIGN == 0, "pinned host memory off a page boundary"
        return buffer
    raw = torch.empty(numel + ELEMENTS, dtype=torch.float32)
    skip = (-raw.data_ptr() % ALIGN) // 4
    return raw[skip : skip + numel]


def padded(numel: int) -> int:
    return -(-numel // ELEMENTS) * ELEMENTS


def chunk_elements(buffer_bytes: int, numel: int, per_slot: int) -> int:
    """Elements of a chunk: every slot of the ring holds `per_slot` buffers (one per key, and the gradient's
    where the update copies it in), a power of two of whole blocks (what a pinned allocation is rounded to
    anyway), or the state's size if smaller."""
    budget = max(ELEMENTS, buffer_bytes // (4 * SLOTS * per_slot))
    return min(1 << (budget.bit_length() - 1), padded(max(numel, 1)))


def ring_bytes(buffer_bytes: int, numel: int, per_slot: int) -> int:
    """Host bytes of the ring for `numel` elements of state per key (what the planner counts)."""
    return 4 * SLOTS * per_slot * chunk_elements(buffer_bytes, numel, per_slot)


def _open(path: Path, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
    return os.open(path, flags, 0o600)


def direct_io_works(directory: Path) -> bool:
    """Whether this filesystem takes O_DIRECT reads and writes (tmpfs and some others refuse it: EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe, block = directory / ".direct_probe", aligned_empty(ELEMENTS, pinned=False)
    try:
        fd = _open(probe, direct=True)
        try:
            return os.pwrite(fd, block.numpy().view("uint8"), 0) == ALIGN
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        probe.unlink(missing_ok=True)


@dataclass
class Chunk:
    start: int  # first element of the owned slice it covers
    numel: int  # elements it covers (the last chunk may be short; its reads and writes are whole blocks)
    slot: dict[str, torch.Tensor]  # per key, host buffer views of `numel` elements


class StateFiles:
    """The keys' files of one rank, each `numel` fp32 elements (padded to whole blocks), and the ring of host
    buffers the state streams through."""

    def __init__(self, directory: str, name: str, keys: tuple[str, ...], numel: int, buffer_bytes: int,
                 pinned: bool, extra: tuple[str, ...] = ("grad",)) -> None:  # fmt: skip
        problems = check_offload_dir(directory, on_node=True)
        if problems:
            raise ConfigError("\n".join(problems))
        self.dir = Path(os.path.expandvars(directory)) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = os.open(self.dir, os.O_RDONLY)
        try:  # one process per directory: another live one is refused, not overwritten
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock)
            raise ConfigError(f"{self.dir} is in use by another process's optim.offload=nvme; give each run its "
                              "own optim.offload_dir") from None  # fmt: skip
        for stale in self.dir.iterdir():  # a previous attempt's working copy: written again from the start
            stale.unlink()
        self.keys, self.numel = keys, numel
        self.filesystem = filesystem_of(self.dir)
        self.direct = direct_io_works(self.dir)
        self.fds = {key: _open(self.dir / f"{key}.bin", self.direct) for key in keys}
        for key, fd in self.fds.items() if numel else ():  # a rank with nothing to update takes no space
            try:  # the disk space taken now: a full disk fails here, not in a writer thread mid-step
                os.posix_fallocate(fd, 0, 4 * padded(numel))
            except OSError as err:
                raise ConfigError(f"{self.dir / key}.bin: cannot take {4 * padded(numel) / 2**30:.2f} GiB for "
                                  f"optim.offload=nvme ({err.strerror})") from None  # fmt: skip
        self.chunk = chunk_elements(buffer_bytes, numel, len(keys) + len(extra))
        self.slots = [{key: aligned_empty(self.chunk, pinned) for key in (*keys, *extra)} for _ in range(SLOTS)]
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        # at the process's end (or the optimizer's), the threads, the files and the working copy are let go
        self._finalizer = weakref.finalize(self, _release, self.reader, self.writer, self.fds, self.lock, self.dir)

    @property
    def buffer_bytes(self) -> int:
        return sum(t.nbytes for slot in self.slots for t in slot.values())

    @property
    def disk_bytes(self) -> int:
        return 4 * padded(self.numel) * len(self.keys)

    def _io(self, write: bool, key: str, start: int, values: torch.Tensor) -> None:
        """Whole blocks at element `start`, from or into `values` (a slot's buffer), retried until done."""
        view, offset = memoryview(values.detach().numpy()).cast("B"), 4 * start
        done = 0
        while done < len(view):
            part = view[done:]
            n = os.pwrite(self.fds[key], part, offset + done) if write else os.preadv(self.fds[key], [part],
                                                                                       offset + done)  # fmt: skip
            if n <= 0:
                raise OSError(errno.EIO, f"{'write' if write else 'read'} of {self.dir / key}.bin at {offset + done}")
            done += n

    def _blocks(self, start: int, numel: int) -> int:
        return min(padded(numel), padded(self.numel) - start)

    def _read(self, chunk: Chunk) -> Chunk:
        for key in self.keys:
            self._io(False, key, chunk.start, chunk.slot[key][: self._blocks(chunk.start, chunk.numel)])
        return chunk

    def _write(self, chunk: Chunk, keys: tuple[str, ...]) -> None:
        for key in keys:
            self._io(True, key, chunk.start, chunk.slot[key][: self._blocks(chunk.start, chunk.numel)])

    def stream(self, update: Callable[[Chunk], None], keys: tuple[str, ...] | None = None,
               read: bool = True) -> None:  # fmt: skip
        """Every chunk of the files in order through `update` (it changes the slot's buffers in place), each
        read ahead and written back behind it on the I/O threads; `keys` written back (default: every key;
        () for a pass that only reads). `read=False` skips the reads (a pass that writes every element)."""
        keys = self.keys if keys is None else keys
        pending: list[Future | None] = [None] * SLOTS  # each slot's write in flight
        reads: dict[int, Future] = {}

        def submit(i: int, start: int) -> None:
            slot = i % SLOTS
            if pending[slot] is not None:
                pending[slot].result()  # the slot is free once its last chunk is written
                pending[slot] = None
            chunk = Chunk(start, min(self.chunk, self.numel - start), self.slots[slot])
            reads[i] = self.reader.submit(self._read, chunk) if read else _done(chunk)

        starts = list(range(0, self.numel, self.chunk))
        try:
            for i in range(min(READ_AHEAD, len(starts))):
                submit(i, starts[i])
            for i, _ in enumerate(starts):
                if i + READ_AHEAD < len(starts):  # into the slot whose write began two chunks ago
                    submit(i + READ_AHEAD, starts[i + READ_AHEAD])
                chunk = reads.pop(i).result()
                view = Chunk(chunk.start, chunk.numel, {k: v[: chunk.numel] for k, v in chunk.slot.items()})
                update(view)
                if keys:
                    pending[i % SLOTS] = self.writer.submit(self._write, chunk, keys)
        finally:  # every read and write finished (none left writing into a slot), then the first error raised
            futures = [f for f in (*pending, *reads.values()) if f is not None]
            wait(futures)
            for future in futures:
                future.result()

    def read_range(self, key: str, start: int, numel: int) -> torch.Tensor:
        """A new tensor with `numel` elements of `key` from element `start` (a checkpoint's share of a span):
        read through the ring's first slot, a chunk at a time."""
        out = torch.empty(numel, dtype=torch.float32)
        buffer = self.slots[0][key]
        for begin in range(start - start % ELEMENTS, start + numel, self.chunk):
            n = min(self.chunk, padded(start + numel) - begin)  # whole blocks, no further than the range
            self._io(False, key, begin, buffer[:n])
            lo, hi = max(begin, start), min(begin + n, start + numel)
            out[lo - start : hi - start] = buffer[lo - begin : hi - begin]
        return out

    def close(self) -> None:
        """Threads stopped, files closed and deleted (the checkpoints hold the state)."""
        self._finalizer()


def _release(reader: ThreadPoolExecutor, writer: ThreadPoolExecutor, fds: dict[str, int], lock: int,
             directory: Path) -> None:  # fmt: skip
    reader.shutdown()
    writer.shutdown()
    for key, fd in list(fds.items()):
        os.close(fd)
        (directory / f"{key}.bin").unlink(missing_ok=True)
        del fds[key]
    os.close(lock)


def _done(value: Chunk) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def check_offload_dir(directory: str | None, on_node: bool = False) -> list[str]:
    """optim.offload=nvme needs a directory on a node's own disk: checked before any process starts where
    the path is known there (no variable left to expand on the node), and again by each rank on its node
    (`on_node`), where a variable left unexpanded is an error."""
    if not directory:
        return ["optim.offload=nvme needs optim.offload_dir: a directory on each node's local NVMe disk"]
    expanded = os.path.expandvars(directory)
    if "$" in expanded:
        return [f"optim.offload_dir={directory}: {expanded} holds a variable this node does not set; set it, or give "
                "the directory itself"] if on_node else []  # fmt: skip
    kind = filesystem_of(expanded)
    if kind in NETWORK_FILESYSTEMS:
        return [
            f"optim.offload_dir={directory} is on a {kind} filesystem, shared over the network: the optimizer "
            "state would cross it every step; use a directory on the node's own disk (e.g. $SLURM_TMPDIR)"
        ]
    return []
