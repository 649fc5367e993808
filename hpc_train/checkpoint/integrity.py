"""Checksums of checkpoint files. New files are checksummed with xxh3-128 (xxhash, ~10 GB/s per core) as
their bytes are written, so a save never reads its files back; the manifest records each file's digest
under the algorithm's name, and checkpoints from before (sha256) still verify. Checking reads the files
in parallel threads (the hashing releases the GIL); a resume checks them as it reads them for its load
(checkpoint/dcp_io.py's ParallelReader)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

WRITE_ALGORITHM = "xxh3_128"
ALGORITHMS: dict[str, tuple[Callable[[], Any], re.Pattern]] = {
    "xxh3_128": (xxhash.xxh3_128, re.compile(r"^[0-9a-f]{32}$")),
    "sha256": (hashlib.sha256, re.compile(r"^[0-9a-f]{64}$")),  # manifests written before xxh3
}
CHUNK = 16 * 2**20


def new_digest() -> Any:
    return ALGORITHMS[WRITE_ALGORITHM][0]()


def file_record(size: int, digest: Any) -> dict[str, Any]:
    """A manifest's record of one file: its size and its digest under the algorithm's name."""
    return {"size": size, WRITE_ALGORITHM: digest.hexdigest()}


def record_algorithm(record: Any) -> str | None:
    """The checksum algorithm of a manifest record: the one known name whose value is a well-formed digest."""
    if not isinstance(record, dict) or not isinstance(record.get("size"), int) or record["size"] < 0:
        return None
    found = [name for name, (_, form) in ALGORITHMS.items() if form.match(str(record.get(name, "")))]
    return found[0] if len(found) == 1 else None


def file_digest(path: Path, algorithm: str) -> str:
    digest = ALGORITHMS[algorithm][0]()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def digest_for(record: dict) -> Any:
    """A new digest of the algorithm `record` (a manifest's record of a file) names."""
    return ALGORITHMS[record_algorithm(record)][0]()


def digest_problem(name: str, record: dict, hexdigest: str, found: str = "") -> str | None:
    """What is wrong with file `name` whose content hashes to `hexdigest`, against its `record`; None if
    nothing. `found`: how the mismatch was found, for the message."""
    algorithm = record_algorithm(record)
    return None if hexdigest == record[algorithm] else f"{name} fails its {algorithm} checksum (corrupted{found})"


def file_problem(directory: Path, name: str, record: dict) -> str | None:
    """What is wrong with the content of file `name` against its record's digest (the whole file read), or None."""
    try:
        return digest_problem(name, record, file_digest(directory / name, record_algorithm(record)))
    except OSError as err:
        return f"{name} cannot be read ({err.strerror or err})"


def first_mismatch(directory: Path, records: dict[str, dict], names: Iterable[str], threads: int) -> str | None:
    """The first of `names` whose content does not match its record's digest (checked `threads` at a time)."""
    names = sorted(names, key=lambda n: -records[n]["size"])  # the largest first: the threads finish together
    with ThreadPoolExecutor(max(1, threads)) as pool:
        problems = pool.map(lambda name: file_problem(directory, name, records[name]), names)
        return next((problem for problem in problems if problem), None)
