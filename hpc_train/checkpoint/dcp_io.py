"""DCP's file storage, made fast: each rank writes its shards as `threads` files in parallel, every file
checksummed as its bytes go out (no read-back), and reads its shards back in parallel threads.

A shard file holds each tensor's bytes as they lie in memory (row-major, little-endian, the tensor's own
dtype), one record after another, written straight from the tensor (`RAW`, marked in DCP's metadata as the
record's one transform): no serialization, no per-record CRC, no small writes. The shape and dtype are in
DCP's metadata; the manifest's xxh3 digest of the whole file is the integrity check. Checkpoints written
before (torch.save records, one zip per tensor) still load. A record whose tensor lies in a file
(optim.offload=nvme's `FileRegion`) is copied from there a piece at a time (`RegionSavePlanner` hands it
to the writer as it is).

A resume checks the files' checksums in the same pass as it reads them (`ParallelReader` given the manifest's
records): a file that some rank reads whole, in order, is hashed by one of those ranks as its bytes arrive,
and every other file is checksummed alone by one rank, chosen when DCP plans the reads (the coordinator sees
every rank's reads); the ranks then agree on the outcome (`agree_on_checks`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.storage import WriteResult

from hpc_train.checkpoint.integrity import (
    digest_for,
    digest_problem,
    file_problem,
    file_record,
    first_mismatch,
    new_digest,
)
from hpc_train.checkpoint.safe_load import RAW, SafeFileSystemReader
from hpc_train.optim.nvme import FileRegion
from hpc_train.resilience.faults import fault_point

SECONDS = ("io_s", "hash_s", "fsync_s")  # where a writer thread's time goes
WRITE_BUFFER = 2**20  # records under this size are gathered into writes of it; larger ones go out directly
REGION_PIECE = 2**24  # bytes of a FileRegion read and written at a time (a buffer per writer thread)


class _HashingStream:
    """A write stream that feeds every byte it writes to a digest, and is fsynced as it closes; it counts the
    seconds it spends writing to the OS, hashing and in fsync (`seconds`)."""

    def __init__(self, raw: io.BufferedWriter):
        self.raw, self.digest, self.size = raw, new_digest(), 0
        self.seconds = dict.fromkeys(SECONDS, 0.0)

    def write(self, data: Any) -> int:
        start = time.perf_counter()
        written = self.raw.write(data)
        hashed = time.perf_counter()
        self.digest.update(memoryview(data).cast("B")[:written])
        self.seconds["io_s"] += hashed - start
        self.seconds["hash_s"] += time.perf_counter() - hashed
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:  # for an fsync: what is still in Python's buffer goes out first
        self.raw.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.raw.closed:  # durable before it counts as written (DCP's own fsync is off: timed here)
            start = time.perf_counter()
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.seconds["fsync_s"] += time.perf_counter() - start
        self.raw.close()

    def writable(self) -> bool:
        return True


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: size and digest} of the file DCP itself writes (its
    `.metadata`), fsynced as it closes."""

    def __init__(self, step: int, rank: int):
        super().__init__()
        self.step, self.rank = step, rank
        self.records: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
            stream.close()
        self.records[Path(path).name] = file_record(stream.size, stream.digest)
        fault_point("mid_write", self.step, self.rank)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.records[Path(new_path).name] = self.records.pop(Path(path).name)


class ChecksummedWriter(FileSystemWriter):
    """DCP's writer into `path`: this rank's tensors as RAW records in `threads` files, written in parallel,
    hashed as written and fsynced, each recorded in `records` (name -> size and digest) once durable.
    `figures`: the wall seconds of the data write, and the writer threads' seconds writing to the OS, hashing
    and in fsync (summed over threads: where the write's time goes)."""

    def __init__(self, path: Path, threads: int, step: int, rank: int):
        super().__init__(path, thread_count=threads, sync_files=False, overwrite=False)
        self.fs = _HashingFileSystem(step, rank)
        self.data_s = 0.0
        self.seconds = dict.fromkeys(SECONDS, 0.0)
        self.lock = threading.Lock()

    @property
    def records(self) -> dict[str, dict]:
        return self.fs.records

    @property
    def figures(self) -> dict[str, float]:
        return {"data_s": self.data_s, **self.seconds}

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[list[WriteResult]]:
        """Every file written and durable, or the first error raised (no file's results go missing)."""
        start = time.perf_counter()
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        files = [(f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}", bucket) for i, bucket in enumerate(buckets)]
        with ThreadPoolExecutor(max(1, len(files))) as pool:
            written = [r for results in pool.map(lambda f: self._write_file(*f, planner), files) for r in results]
        self.data_s = time.perf_counter() - start
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(written)
        return done

    def _write_file(self, name: str, items: list, planner: Any) -> list[WriteResult]:
        """`items`' tensors, one RAW record each, into the new file `name`: large records go to the OS
        straight from the tensor's memory, small ones through one buffer; hashed in the same pass."""
        results, buffer = [], None
        with open(Path(self.path) / name, "xb", buffering=WRITE_BUFFER) as raw:
            stream = _HashingStream(raw)
            for item in items:
                source = planner.resolve_data(item)
                if isinstance(source, FileRegion):  # from its file, a piece at a time
                    buffer = buffer or bytearray(REGION_PIECE)
                    start, pieces = stream.size, source.pieces(buffer)
                else:
                    start, pieces = stream.size, [raw_bytes(source, item.index.fqn)]
                for piece in pieces:
                    stream.write(piece)
                info = _StorageInfo(name, start, stream.size - start, transform_descriptors=[RAW])
                results.append(WriteResult(index=item.index, size_in_bytes=stream.size - start, storage_data=info))
            stream.close()  # flushed and fsynced (timed)
        with self.lock:
            self.records[name] = file_record(stream.size, stream.digest)
            for key, value in stream.seconds.items():
                self.seconds[key] += value
        fault_point("mid_write", self.fs.step, self.fs.rank)  # one file complete, others maybe half written
        return results


class RegionSavePlanner(DefaultSavePlanner):
    """DCP's save planner, handing a `FileRegion` to the writer as it is (DCP looks up only tensors by their
    shard offsets)."""

    def lookup_object(self, index: Any) -> Any:
        value = self.state_dict.get(index.fqn)
        return value if isinstance(value, FileRegion) else super().lookup_object(index)


def _little_endian_host() -> None:
    """RAW records are written and read as the host lays the bytes out: refuse a big-endian one."""
    if sys.byteorder != "little":
        raise OSError("RAW checkpoint records are little-endian; this host is not")


def raw_bytes(tensor: torch.Tensor, name: str) -> memoryview:
    """A tensor's RAW record: its elements' bytes, row-major, read from its memory where it is contiguous on
    the host (copied to the host, or made contiguous, otherwise)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: a checkpoint holds tensors only, not {type(tensor).__name__}")
    _little_endian_host()
    return _byte_view(tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous())


class ParallelReader(SafeFileSystemReader):
    """DCP's reader (with the restricted metadata unpickler), reading its files `threads` at a time. What a
    read asks of a stored tensor in its own dtype, when those elements lie in one stretch of it (the whole
    tensor, whole rows, part of a row: a reshard's slice, ZeRO's owned range), is read straight from the
    file, only those bytes, into the tensor it loads into (or, where that is not contiguous host memory,
    a buffer of their size). From a RAW record anything else (a box across rows) reads the whole record and
    cuts it, and a dtype change is made by the copy; from a torch.save record of an earlier version it goes
    through torch.load of the stored tensor, as in DCP's own reader.

    Given `records` (a manifest's files), it checks every one of them once over all ranks in the same pass
    (`checks`): the global plan (`prepare_global_plan`) gives each file that a rank reads whole and in order
    to one such rank, which hashes it as it reads it, and each other file to the rank with the fewest bytes
    to read, which checksums it alone beside its reads."""

    def __init__(self, path: str | os.PathLike, threads: int, records: dict[str, dict] | None = None):
        super().__init__(path)
        self.threads = threads
        self.checks = ReadChecks(records)
        self.metadata: Any = None

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Each rank's plan with the files it checks (`storage_data`: those it hashes as it reads them, and
        those it checksums alone), every file of `records` given to one rank."""
        if self.checks.records is None:
            return plans
        reads = [self._read_ranges(plan) for plan in plans]
        tasks = assign_checks(self.checks.records, reads)
        return [dataclasses.replace(plan, storage_data=task) for plan, task in zip(plans, tasks, strict=True)]

    def _read_ranges(self, plan: Any) -> dict[str, list[tuple[int, int] | None]]:
        """{file: the byte ranges the plan's items read of it}; None for an item whose bytes are not known
        before it is read (a torch.save record's: through its zip)."""
        ranges: dict[str, list[tuple[int, int] | None]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append(self._byte_range(item))
        return ranges

    def _byte_range(self, item: Any) -> tuple[int, int] | None:
        """The bytes `_read_raw` reads of the file for `item` (None: not a RAW record, or not one it can read)."""
        info = self.storage_data[item.storage_index]
        if not info.transform_descriptors:
            return None
        stored = self.metadata.state_dict_metadata[item.storage_index.fqn]
        at = tuple(item.storage_index.offset)
        shape = next((tuple(c.sizes) for c in stored.chunks if tuple(c.offsets) == at), None)
        if shape is None:
            return None
        start = _contiguous_start(shape, item.storage_offsets, item.lengths)
        if start is None:  # the whole record, cut afterwards
            return info.offset, info.offset + info.length
        size = torch.empty((), dtype=stored.properties.dtype).element_size()
        return info.offset + start * size, info.offset + (start + math.prod(item.lengths)) * size

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        hashed, alone = plan.storage_data if self.checks.records is not None and plan.storage_data else ((), ())

        def read_file(relative_path: str) -> None:
            def starts(item: Any) -> tuple[int, int]:  # in file order: the order a hash as read needs
                info = self.storage_data[item.storage_index]
                return info.offset, (self._byte_range(item) or (info.offset,))[0]

            items = sorted(per_file[relative_path], key=starts)
            record = self.checks.records.get(relative_path) if relative_path in hashed else None
            with open(Path(self.path) / relative_path, "rb", buffering=0) as raw:
                os.posix_fadvise(raw.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)  # the whole file read ahead, in order
                f = _ReadThrough(raw, None if record is None else digest_for(record))
                try:
                    for item in items:
                        self._read_item(f, relative_path, item, planner)
                finally:
                    self.checks.add(loaded=f.bytes_read)
            if record is not None:
                self._verdict(relative_path, record, f)

        def check_alone(name: str) -> None:
            self.checks.add(name, file_problem(Path(self.path), name, self.checks.records[name]),
                            checked=self.checks.records[name]["size"])  # fmt: skip

        tasks = [(sum(self.storage_data[i.storage_index].length for i in items), read_file, name)
                 for name, items in per_file.items()]  # fmt: skip
        tasks += [(self.checks.records[name]["size"], check_alone, name) for name in alone]
        tasks.sort(key=lambda task: -task[0])  # the largest first: the threads finish together
        with ThreadPoolExecutor(max(1, min(self.threads, len(tasks)))) as pool:
            list(pool.map(lambda task: task[1](task[2]), tasks))
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_item(self, f: Any, relative_path: str, item: Any, planner: Any) -> None:
        target = planner.resolve_tensor(item).detach()
        stored = planner.metadata.state_dict_metadata[item.storage_index.fqn]
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors:  # RAW: safe_load admits no other
            _read_raw(f, info, item, stored, target)
            planner.commit_tensor(item, target)
            return
        stored_dtype = stored.properties.dtype
        direct = target.device.type == "cpu" and target.is_contiguous()
        staged = target if direct else torch.empty(target.shape, dtype=target.dtype)
        if _read_in_place(f, info, item, staged, stored_dtype):
            if not direct:
                target.copy_(staged)
        else:
            target.copy_(self._load_slice(f, relative_path, item, target))
        planner.commit_tensor(item, target)

    def _verdict(self, name: str, record: dict, f: _ReadThrough) -> None:
        """The checksum of a file this rank was to hash as it read it: from that hash where the reads ran
        through the whole file in order, else (a plan not read as foreseen) the file checksummed again."""
        if f.in_order and f.hashed == record["size"]:
            self.checks.add(name, digest_problem(name, record, f.digest.hexdigest(), "; found as it was read"))
        else:
            self.checks.add(name, file_problem(Path(self.path), name, record), checked=record["size"])

    def _load_slice(self, f: Any, relative_path: str, item: Any, target: torch.Tensor) -> torch.Tensor:
        info = self.storage_data[item.storage_index]
        f.seek(info.offset)
        record = bytearray(info.length)
        _read_exactly(f, memoryview(record), item.storage_index.fqn)
        stored = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            stored = stored.narrow(dim, start, length)
        if target.shape != stored.shape:
            raise ValueError(f"{relative_path}: {item.storage_index.fqn} has shape {tuple(stored.shape)}, "
                             f"{tuple(target.shape)} expected")  # fmt: skip
        return stored


class ReadChecks:
    """What a read checked of a checkpoint's files (`records`, the manifest's; None: no checks): the files
    whose checksums it verified, the first problem it found, and the bytes it read for the load (`loaded`)
    and for checksums alone (`checked`). Added to by the reader's threads."""

    def __init__(self, records: dict[str, dict] | None):
        self.records = records
        self.verified: set[str] = set()
        self.problem: str | None = None
        self.loaded = self.checked = 0
        self.lock = threading.Lock()

    def add(self, name: str | None = None, problem: str | None = None, loaded: int = 0, checked: int = 0) -> None:
        with self.lock:
            self.loaded, self.checked = self.loaded + loaded, self.checked + checked
            if problem is not None:
                self.problem = self.problem or problem
            elif name is not None:
                self.verified.add(name)


class _ReadThrough:
    """A file read for a load: counts the bytes read (`bytes_read`) and, given a `digest`, feeds it every byte
    while the reads run on from byte 0 with no gap and no step back (`in_order`; `hashed` bytes so far)."""

    def __init__(self, f: Any, digest: Any):
        self.f, self.digest = f, digest
        self.bytes_read = self.hashed = 0
        self.in_order = digest is not None

    def seek(self, position: int, whence: int = 0) -> int:
        return self.f.seek(position, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, buffer: Any) -> int:
        at = self.f.tell() if self.in_order else -1
        n = self.f.readinto(buffer) or 0
        self.bytes_read += n
        if self.in_order and at != self.hashed:
            self.in_order = False
        elif self.in_order:
            self.digest.update(memoryview(buffer).cast("B")[:n])
            self.hashed += n
        return n

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])


def covers(ranges: list[tuple[int, int] | None] | None, size: int) -> bool:
    """Whether byte ranges read one after another in file order run through a file of `size` bytes, each
    from where the one before ended."""
    if not ranges or None in ranges:
        return False
    end = 0
    for first, last in sorted(ranges):
        if first != end:
            return False
        end = last
    return end == size


def assign_checks(records: dict[str, dict], reads: list[dict[str, list]]) -> list[tuple[list[str], list[str]]]:
    """Per rank, (the files it hashes as it reads them, the files it checksums alone): each file of `records`
    once. A file some rank reads whole and in order (`reads`: each rank's byte ranges per file) goes to the one
    of those with the fewest bytes to hash so far; every other file (read in part, in pieces, or by no rank)
    to the rank with the fewest bytes to read, the largest file first."""
    world = len(reads)
    hashed: list[list[str]] = [[] for _ in range(world)]
    alone: list[list[str]] = [[] for _ in range(world)]
    hashing = [0] * world
    load = [sum(b - a for ranges in r.values() for a, b in filter(None, ranges)) for r in reads]
    rest = []
    for name in sorted(records, key=lambda n: (-records[n]["size"], n)):
        size = records[name]["size"]
        whole = [rank for rank in range(world) if covers(reads[rank].get(name), size)]
        if whole:
            rank = min(whole, key=lambda r: (hashing[r], r))
            hashed[rank].append(name)
            hashing[rank] += size
        else:
            rest.append(name)
    for name in rest:
        rank = min(range(world), key=lambda r: (load[r], r))
        alone[rank].append(name)
        load[rank] += records[name]["size"]
    return list(zip(hashed, alone, strict=True))


def agree_on_checks(directory: Path, checks: ReadChecks, threads: int) -> tuple[str | None, dict[str, int]]:
    """After a read with checks (whether it finished or raised), on every rank: the first problem any rank
    found (None: every file verifies), and the bytes read over all ranks (`loaded_bytes`, `checked_bytes`
    for checksums alone, `total_bytes` in the checkpoint's files). The files no rank checked (a read that
    failed before it reached them) are split over the ranks and checksummed first, and agreed on too."""
    records = checks.records
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    every = [(sorted(checks.verified), checks.problem, checks.loaded, checks.checked)]
    if world > 1:
        mine, every = every[0], [None] * world
        dist.all_gather_object(every, mine)
    problem = next((problem for _, problem, _, _ in every if problem), None)
    figures = {"loaded_bytes": sum(e[2] for e in every), "checked_bytes": sum(e[3] for e in every),
               "total_bytes": sum(r["size"] for r in records.values())}  # fmt: skip
    rest = set(records) - {name for verified, *_ in every for name in verified}
    if problem is None and rest:
        mine = sorted(rest, key=lambda n: (-records[n]["size"], n))[rank::world]
        problems = [first_mismatch(directory, records, mine, threads)]
        if world > 1:
            found, problems = problems[0], [None] * world
            dist.all_gather_object(problems, found)
        problem = next((p for p in problems if p), None)
        figures["checked_bytes"] += sum(records[n]["size"] for n in rest)
    return problem, figures


def _read_raw(f: Any, info: Any, item: Any, stored: Any, target: torch.Tensor) -> None:
    """The elements `item` asks for of a RAW record into `target`: only their bytes when they are one stretch
    of the stored tensor (straight into `target` when it is contiguous host memory of the stored dtype),
    else the whole record, cut to the box; a dtype change is made by the copy."""
    fqn = item.storage_index.fqn
    _little_endian_host()
    shape = next((tuple(c.sizes) for c in stored.chunks if tuple(c.offsets) == tuple(item.storage_index.offset)), None)
    if shape is None:
        raise ValueError(f"{info.relative_path}: {fqn} has no stored chunk at {tuple(item.storage_index.offset)}")
    dtype = stored.properties.dtype
    size = torch.empty((), dtype=dtype).element_size()
    if info.length != math.prod(shape) * size:
        raise ValueError(f"{info.relative_path}: {fqn} holds {info.length} bytes, not a {dtype} tensor of {shape}")
    if tuple(target.shape) != tuple(item.lengths):
        raise ValueError(f"{info.relative_path}: {fqn} is read as {tuple(item.lengths)} into {tuple(target.shape)}")
    start = _contiguous_start(shape, item.storage_offsets, item.lengths)
    if start is None:
        whole = torch.empty(shape, dtype=dtype)
        f.seek(info.offset)
        _read_exactly(f, _byte_view(whole), fqn)
        for dim, (first, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            whole = whole.narrow(dim, first, length)
        target.copy_(whole)
        return
    direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype
    part = target if direct else torch.empty(target.shape, dtype=dtype)
    f.seek(info.offset + start * size)
    _read_exactly(f, _byte_view(part), fqn)
    if not direct:
        target.copy_(part)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class _RecordView(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a file of their own (for zipfile)."""

    def __init__(self, f: Any, offset: int, length: int):
        self.f, self.offset, self.length, self.position = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = 0) -> int:
        self.position = min(self.length, {0: 0, 1: self.position, 2: self.length}[whence] + position)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        self.f.seek(self.offset + self.position)
        n = self.f.readinto(memoryview(buffer)[: self.length - self.position])
        self.position += n
        return n


def _contiguous_start(shape: tuple[int, ...], offsets: list[int], lengths: list[int]) -> int | None:
    """Where the box at `offsets` of `lengths` starts in a row-major tensor of `shape`, when its elements are
    one stretch of it (every dimension after the first one longer than 1 whole); None when not."""
    if len(offsets) != len(shape):
        return None
    first = next((d for d, n in enumerate(lengths) if n != 1), len(shape))
    if any(offsets[d] or lengths[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    return sum(o * math.prod(shape[d + 1 :]) for d, o in enumerate(offsets))


def _read_in_place(f: Any, info: Any, item: Any, target: torch.Tensor, stored_dtype: torch.dtype) -> bool:
    """Read the stored elements `item` asks for straight into `target` when their bytes are the same (dtype,
    row-major layout, one stretch of the stored tensor, contiguous host memory), and only those; False when
    not, nothing read. A DCP record is a torch.save zip: the tensor's layout is in the member
    `<archive>/data.pkl`, its bytes uncompressed in `<archive>/data/0` (torch's per-member CRC is not
    checked: the file's checksum is)."""
    nbytes = target.numel() * target.element_size()
    if target.device.type != "cpu" or not target.is_contiguous() or target.dtype != stored_dtype or nbytes == 0:
        return False
    if sys.byteorder != "little" or math.prod(item.lengths) != target.numel():
        return False
    with zipfile.ZipFile(_RecordView(f, info.offset, info.length)) as record:
        members = {m.filename.split("/", 1)[-1]: m for m in record.infolist()}  # without the archive's name
    data, pickled, byteorder = members.get("data/0"), members.get("data.pkl"), members.get("byteorder")
    if data is None or pickled is None or byteorder is None:
        return False
    if {data.compress_type, pickled.compress_type, byteorder.compress_type} != {zipfile.ZIP_STORED}:
        return False
    f.seek(_member_data_at(f, info.offset + byteorder.header_offset))
    if f.read(byteorder.file_size) != b"little":
        return False
    f.seek(_member_data_at(f, info.offset + pickled.header_offset))
    layout = _stored_layout(f.read(pickled.file_size))
    if not isinstance(layout, tuple) or len(layout) != 4 or layout[0] != 0 or layout[3]:
        return False
    shape = layout[1]
    row_major = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    start = _contiguous_start(shape, item.storage_offsets, item.lengths)
    if layout[2] != row_major or start is None or data.file_size != math.prod(shape) * target.element_size():
        return False
    data_at = _member_data_at(f, info.offset + data.header_offset) + start * target.element_size()
    if data_at + nbytes > info.offset + info.length:
        return False
    f.seek(data_at)
    _read_exactly(f, _byte_view(target), item.storage_index.fqn)
    return True


def _read_exactly(f: Any, view: memoryview, name: str) -> None:
    """Fill `view` from `f` (one read returns at most ~2 GiB)."""
    while view:
        n = f.readinto(view)
        if not n:
            raise ValueError(f"{name}: the file ends inside its data")
        view = view[n:]


def _member_data_at(f: Any, header_at: int) -> int:
    """Where a zip member's data starts, from its local header."""
    f.seek(header_at)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"no zip member header at byte {header_at}")
    return header_at + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


class _LayoutUnpickler(pickle.Unpickler):
    """Reads (storage offset, size, stride) from a torch.save record of one tensor, building nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):  # (a conj or neg bit: extra metadata)
            return lambda storage, offset, size, stride, grad=False, hooks=None, extra=None: (
                offset, tuple(size), tuple(stride), bool(extra))  # fmt: skip
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> None:
        return None


def _stored_layout(pickled: bytes) -> tuple | None:
    try:
        return _LayoutUnpickler(io.BytesIO(pickled)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError):
        return None
