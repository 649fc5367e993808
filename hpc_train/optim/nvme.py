"""optim.offload=nvme (ZeRO-Infinity's optimizer offload): state that fits neither the device nor the host.

A rank's fp32 master weights and its update rule's state (AdamW's two moments) live in files in
`optim.offload_dir`, one file per key, each laid out as the rank's flat owned slice. The files never have a
name (O_TMPFILE), only the process's descriptors: the kernel frees their space when the process ends, however
it ends (a SIGKILL, a time limit, a node crash), and no run can meet another's files. An update
streams them through a ring of host buffers (`optim.offload_buffer_mb` in all; pinned on CUDA): while one
chunk updates, a reader thread reads the next into the next slot and a writer thread writes the last one
back, so host memory holds the ring whatever the state's size. The files are opened with O_DIRECT where
the filesystem takes it (the page cache would otherwise keep a second copy of the state in host memory),
and `describe` says which. The files are the working copy of the state and a checkpoint is its durable
one: a run (re)starting writes them again, from the checkpoint or from the model's weights.

A save never reads the state into host memory: the strategies hand the checkpoint `FileRegion`s, where a
tensor's elements lie in a file, and the checkpoint's writer copies each one into its own file a piece at a
time (checkpoint/dcp_io.py). An async save, written while the next updates change the files, is handed a
`snapshot` of them, copied on the disk (by the kernel, or shared blocks where the filesystem has reflinks)
into an unnamed file that goes when the save is written.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import secrets
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hpc_train.config import ConfigError, expand_on_node
from hpc_train.distributed.agree import raise_together
from hpc_train.placement import local, origin_of

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


def unnamed(directory: Path, direct: bool) -> int:
    """A new file in `directory` that has no name, open for reading and writing: its space goes back to the
    disk with its last descriptor, whatever ends the process (no finalizer has to run). O_TMPFILE; where the
    filesystem lacks it, a new name unlinked at once."""
    flags = os.O_RDWR | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        return os.open(directory, flags | getattr(os, "O_TMPFILE", 0), 0o600)  # none: EISDIR
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR):  # EISDIR: a kernel without O_TMPFILE
            raise
    path = directory / f".hpc_train_nvme_{secrets.token_hex(8)}"
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    finally:  # an open that fails (O_DIRECT refused) may have made the file
        path.unlink(missing_ok=True)


def reopened(fd: int) -> int:
    """A second descriptor of `fd`'s file, without its flags (O_DIRECT): the file has no name to open it by."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR)


def direct_io_works(directory: Path) -> bool:
    """Whether this filesystem takes O_DIRECT reads and writes (some refuse it: EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    block, fd = aligned_empty(ELEMENTS, pinned=False), None
    try:  # refused at the open or at the first write, depending on the filesystem
        fd = unnamed(directory, direct=True)
        return os.pwrite(fd, block.numpy().view("uint8"), 0) == ALIGN
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        if fd is not None:
            os.close(fd)


@dataclass
class Chunk:
    start: int  # first element of the owned slice it covers
    numel: int  # elements it covers (the last chunk may be short; its reads and writes are whole blocks)
    slot: dict[str, torch.Tensor]  # per key, host buffer views of `numel` elements


class StateFiles:
    """The keys' files of one rank (`name`, in messages), each `numel` fp32 elements (padded to whole blocks),
    unnamed in `directory`, and the ring of host buffers the state streams through. Nothing the directory
    holds is read, changed or deleted: its entries are not the run's."""

    def __init__(self, directory: str, name: str, keys: tuple[str, ...], numel: int, buffer_bytes: int,
                 pinned: bool, extra: tuple[str, ...] = ("grad",)) -> None:  # fmt: skip
        problems = check_offload_dir(directory, on_node=True)
        if problems:
            raise ConfigError("\n".join(problems))
        self.dir, self.name = Path(os.path.expandvars(directory)), name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keys, self.numel = keys, numel
        self.filesystem = filesystem_of(self.dir)
        self.direct = direct_io_works(self.dir)
        self.fds = {key: unnamed(self.dir, self.direct) for key in keys}
        # buffered access at any offset, into any buffer: a save's reads, a resume's mapping
        self.buffered = {key: reopened(fd) for key, fd in self.fds.items()}
        self.maps: list[mmap.mmap] = []
        for key, fd in self.fds.items() if numel else ():  # a rank with nothing to update takes no space
            try:  # the disk space taken now: a full disk fails here, not in a writer thread mid-step
                os.posix_fallocate(fd, 0, 4 * padded(numel))
            except OSError as err:
                raise ConfigError(f"{self.dir}: cannot take {4 * padded(numel) / 2**30:.2f} GiB for {name}'s {key} "
                                  f"(optim.offload=nvme; {err.strerror})") from None  # fmt: skip
        self.chunk = chunk_elements(buffer_bytes, numel, len(keys) + len(extra))
        self.slots = [{key: aligned_empty(self.chunk, pinned) for key in (*keys, *extra)} for _ in range(SLOTS)]
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        # at the optimizer's end, the threads and the files are let go (at the process's, the kernel frees them)
        self._finalizer = weakref.finalize(self, _release, self.reader, self.writer, self.fds, self.buffered)

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
                raise OSError(errno.EIO, f"{'write' if write else 'read'} of {self.name}'s {key} in {self.dir} at "
                                         f"{offset + done}")  # fmt: skip
            done += n

    def _blocks(self, start: int, numel: int) -> int:
        return min(padded(numel), padded(self.numel) - start)

    def _read(self, chunk: Chunk, keys: tuple[str, ...]) -> Chunk:
        for key in keys:
            self._io(False, key, chunk.start, chunk.slot[key][: self._blocks(chunk.start, chunk.numel)])
        return chunk

    def _write(self, chunk: Chunk, keys: tuple[str, ...]) -> None:
        for key in keys:
            self._io(True, key, chunk.start, chunk.slot[key][: self._blocks(chunk.start, chunk.numel)])

    def stream(self, update: Callable[[Chunk], None], keys: tuple[str, ...] | None = None,
               read: bool = True, read_keys: tuple[str, ...] | None = None) -> None:  # fmt: skip
        """Every chunk of the files in order through `update` (it changes the slot's buffers in place), each
        read ahead and written back behind it on the I/O threads; `keys` written back (default: every key;
        () for a pass that only reads), `read_keys` read (default: every key). `read=False` skips the reads (a
        pass that writes every element)."""
        keys = self.keys if keys is None else keys
        read_keys = self.keys if read_keys is None else read_keys
        pending: list[Future | None] = [None] * SLOTS  # each slot's write in flight
        reads: dict[int, Future] = {}

        def submit(i: int, start: int) -> None:
            slot = i % SLOTS
            if pending[slot] is not None:
                pending[slot].result()  # the slot is free once its last chunk is written
                pending[slot] = None
            chunk = Chunk(start, min(self.chunk, self.numel - start), self.slots[slot])
            reads[i] = self.reader.submit(self._read, chunk, read_keys) if read else _done(chunk)

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

    def region(self, key: str, start: int, like: torch.Tensor) -> FileRegion:
        """`like`'s part (this rank's, as many elements) of `key` from element `start`, where it lies: what a
        save writes from, valid until the next update."""
        return FileRegion.of(self, self.buffered[key], 4 * start, like, stable=False)

    def mapped(self, key: str) -> torch.Tensor:
        """The `numel` elements of `key`'s file as a tensor over its pages (shared: what is written into it goes
        to the file, written back by the kernel, never a copy in this process's memory); the mapping lasts as
        long as a tensor over it."""
        if not self.numel:
            return torch.empty(0)
        self.maps.append(mmap.mmap(self.buffered[key], 4 * padded(self.numel)))
        return torch.frombuffer(self.maps[-1], dtype=torch.float32, count=self.numel)

    def flush(self) -> None:
        """What was written into the mapped files made durable there, before the ring's direct reads and
        writes take over."""
        for pages in self.maps:
            pages.flush()
        self.maps = []

    def close(self) -> None:
        """Threads stopped, files closed: their space freed (the checkpoints hold the state)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def _release(reader: ThreadPoolExecutor, writer: ThreadPoolExecutor, fds: dict[str, int],
             buffered: dict[str, int]) -> None:  # fmt: skip
    reader.shutdown()
    writer.shutdown()
    for key, fd in list(fds.items()):
        os.close(fd)
        os.close(buffered.pop(key))
        del fds[key]


@dataclass(frozen=True, eq=False)
class FileRegion:
    """A tensor's fp32 elements lying in a file from byte `offset`, row-major: what a save writes from the
    file a piece at a time, never whole in memory. `shape` is this rank's part of a tensor of `size`, at
    `origin` in it (a shard's offsets); `owner` (StateFiles or Scratch) keeps the file open; `stable`: a
    snapshot, which no update changes."""

    owner: Any
    fd: int
    offset: int
    shape: tuple[int, ...]
    origin: tuple[int, ...]
    size: tuple[int, ...]
    stable: bool

    @classmethod
    def of(cls, owner: Any, fd: int, offset: int, like: torch.Tensor, stable: bool) -> FileRegion:
        """The region laid out like `like`: its local shape, and where that lies in the whole."""
        return cls(owner, fd, offset, tuple(local(like).shape), origin_of(like), tuple(like.shape), stable)

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)

    def pieces(self, buffer: bytearray) -> Iterator[memoryview]:
        """The region's bytes, read into `buffer` a piece at a time (each piece's pages dropped from the
        page cache once read: the state is not kept twice in host memory)."""
        if getattr(self.owner, "closed", False):  # its descriptor's number may be another file's by now
            raise OSError(errno.EBADF, f"{self.owner.dir}: the state files were let go before a save wrote them")
        view, at, end = memoryview(buffer), self.offset, self.offset + self.nbytes
        while at < end:
            n = os.preadv(self.fd, [view[: min(len(view), end - at)]], at)
            if n <= 0:
                raise OSError(errno.EIO, f"{self.owner.dir}: the state file ends at byte {at}, inside a region")
            os.posix_fadvise(self.fd, at, n, os.POSIX_FADV_DONTNEED)
            yield view[:n]
            at += n

    def read(self) -> torch.Tensor:
        """The region in a new host tensor of its `shape` (where a whole tensor is needed: the vocabulary's)."""
        out = torch.empty(self.shape, dtype=torch.float32)
        target, at = memoryview(out.numpy()).cast("B"), 0
        for piece in self.pieces(bytearray(min(self.nbytes, 2**24))):
            target[at : at + len(piece)] = piece
            at += len(piece)
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's save plan of it: a shard at `origin` (the whole tensor when it is all of it)."""
        offsets, fp32 = torch.Size(self.origin), TensorProperties(dtype=torch.float32)
        kind = WriteItemType.TENSOR if self.shape == self.size else WriteItemType.SHARD
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(self.shape))
        data = TensorWriteData(chunk=chunk, properties=fp32, size=torch.Size(self.size))
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=kind, tensor_data=data)]


class Scratch:
    """An unnamed file in `directory` (O_TMPFILE, or unlinked at once): a save's copy of state on the node's
    disk. Its space goes with its last reference, whatever ends the process."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.file = tempfile.TemporaryFile(dir=directory)
        self.fd, self.size = self.file.fileno(), 0

    def _write(self, pieces: Iterable[memoryview]) -> int:
        """The pieces written at the end, one after another; where the first begins."""
        offset = self.size
        for piece in pieces:
            done = 0
            while done < len(piece):
                done += os.pwrite(self.fd, piece[done:], self.size + done)
            self.size += len(piece)
        return offset

    def append(self, values: torch.Tensor, like: torch.Tensor) -> FileRegion:
        """`values` (fp32, any device) written at the end, as a region laid out like `like`."""
        data = memoryview(values.detach().to("cpu", torch.float32).contiguous().numpy()).cast("B")
        return FileRegion.of(self, self.fd, self._write([data]), like, stable=True)

    def copy(self, region: FileRegion) -> FileRegion:
        """`region`'s bytes copied to the end on the disk, not through this process (copy_file_range: a
        reflink where the filesystem shares blocks; read and written here where the kernel cannot), as a
        stable region."""
        offset, done = self.size, 0
        try:
            while done < region.nbytes:
                n = os.copy_file_range(region.fd, self.fd, region.nbytes - done, region.offset + done, offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"{self.dir}: the state file ends inside a region being copied")
                done += n
            self.size += region.nbytes
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            self._write(region.pieces(bytearray(min(region.nbytes, 2**24))))
        os.posix_fadvise(region.fd, region.offset, region.nbytes, os.POSIX_FADV_DONTNEED)
        return replace(region, owner=self, fd=self.fd, offset=offset, stable=True)


def snapshot(state: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """`state`'s regions that an update would change, copied on the disk into one scratch file per directory:
    what an async save writes while training goes on (others as they are). Every rank of `group` calls it:
    a failure on one raises on all."""
    scratch: dict[Path, Scratch] = {}
    out, problem = {}, None
    try:
        for key, value in state.items():
            if isinstance(value, FileRegion) and not value.stable:
                if value.owner.dir not in scratch:
                    scratch[value.owner.dir] = Scratch(value.owner.dir)
                value = scratch[value.owner.dir].copy(value)
            out[key] = value
    except OSError as err:
        problem = f"copying the optimizer state on the node's disk for an async save failed: {err}"
    raise_together(problem, group)
    return out


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
    try:
        expanded = expand_on_node("optim.offload_dir", directory)
    except ConfigError as err:
        return [str(err)] if on_node else []
    kind = filesystem_of(expanded)
    if kind in NETWORK_FILESYSTEMS:
        return [
            f"optim.offload_dir={directory} is on a {kind} filesystem, shared over the network: the optimizer "
            "state would cross it every step; use a directory on the node's own disk (e.g. $SLURM_TMPDIR)"
        ]
    return []
