"""Checkpoints on disk: the commit protocol, verification and retention.

A save writes into `step_XXXXXXX.tmp/`. Each rank records the size and checksum of every file it wrote
as it wrote and fsynced it (checkpoint/integrity.py); rank 0 then writes `manifest.json` (files, sizes,
checksums, layout, config, code version), fsyncs it and the directory, renames the directory to
`step_XXXXXXX/`, and only then replaces the `latest` pointer atomically (temp file, fsync, rename). A
crash at any point leaves either the previous state or a `.tmp` directory, which is never loaded.
Loading picks the newest checkpoint that verifies. Retention renames a checkpoint out of sight before
deleting it, so a kill inside a deletion leaves no half-deleted checkpoint behind.

Verification is closed: the manifest must be well formed, every file in the directory must be listed
in it (and nothing else), names are plain file names (no paths, no symbolic links), and DCP's metadata
must name only those files. Any problem is reported by name and the checkpoint skipped, never raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.integrity import first_mismatch, record_algorithm
from hpc_train.checkpoint.safe_load import DCP_METADATA, PLAIN_NAME, CheckpointError, load_rank_file, read_dcp_metadata
from hpc_train.resilience.faults import fault_point

MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{7,})$")
TRASH = ".hpc_train_deleting_"  # what a directory being deleted is renamed to first

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointStore", "ChecksumMismatch"]


class ChecksumMismatch(CheckpointError):
    """A file of a checkpoint whose content fails its manifest's checksum, found as the checkpoint was read for
    a load and raised on every rank together: the checkpoint is skipped for an older one."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    problem: str | None = None  # why it cannot be used; None when it verified
    manifest: dict | None = None


class CheckpointStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def tmp_dir(self, step: int) -> Path:
        return self.root / f"{step_dir_name(step)}.tmp"

    def commit(self, step: int, files: dict[str, dict], manifest: dict) -> Path:
        """Rank 0, after every rank has written and described its files: manifest, fsync, rename, latest."""
        tmp, final = self.tmp_dir(step), self.root / step_dir_name(step)
        fault_point("before_manifest", step, 0)
        manifest = {**manifest, "step": step, "files": files, "created": time.time()}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # an older save of the same step (e.g. a rerun): replaced only now, complete
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        fault_point("before_latest", step, 0)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(step_dir_name(step) + "\n")
        with open(pointer) as f:
            os.fsync(f.fileno())
        os.replace(pointer, self.root / LATEST)
        fsync_path(self.root)
        return final

    def latest_pointer(self) -> str | None:
        path = self.root / LATEST
        return path.read_text().strip() if path.is_file() else None

    def scan(self) -> list[CheckpointInfo]:
        """Every checkpoint directory, newest first, unverified; leftover `.tmp` saves marked unusable."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            if match := STEP_DIR.match(path.name):
                not_dir = path.is_symlink() or not path.is_dir()
                found.append(CheckpointInfo(path, int(match.group(1)), "not a directory" if not_dir else None))
            elif path.name.endswith(".tmp") and path.is_dir() and (m := STEP_DIR.match(path.name[:-4])):
                found.append(CheckpointInfo(path, int(m.group(1)), "incomplete save (.tmp, never committed)"))
        return sorted(found, key=lambda c: (c.step, c.problem is None), reverse=True)

    def verify(self, info: CheckpointInfo, full: bool = True, threads: int = 4) -> CheckpointInfo:
        """Check the manifest, that it lists exactly the directory's files, each file's size and (full) its
        checksum (`threads` files at a time), and DCP's .metadata."""
        if info.problem:
            return info
        manifest, problem = read_manifest(info.path, info.step)
        if problem is None:
            problem = check_files(info.path, manifest["files"])
        if problem is None:
            try:  # the files that are unpickled on load, checked without running anything
                read_dcp_metadata(info.path, set(manifest["files"]))
                for name in manifest["files"]:
                    if name.endswith(".pt"):
                        load_rank_file(info.path / name)
            except CheckpointError as err:
                problem = str(err)
            except Exception as err:  # bytes not yet checksummed can make the unpickler fail any way
                problem = f"unreadable metadata or rank file ({type(err).__name__}: {err})"
        if problem is None and full:
            problem = first_mismatch(info.path, manifest["files"], manifest["files"], threads)
        return CheckpointInfo(info.path, info.step, problem, manifest if problem is None else None)

    def candidates(self, report=print) -> Iterator[CheckpointInfo]:
        """Checkpoints whose manifest, file list, sizes and metadata check out, newest first (checksums not
        checked); the others reported as skipped."""
        for info in self.scan():
            checked = self.verify(info, full=False)
            if checked.problem is None:
                yield checked
            else:
                report(f"checkpoint {info.path} skipped: {checked.problem}")

    def newest_valid(self, full: bool = True, report=print, threads: int = 4) -> CheckpointInfo | None:
        for info in self.candidates(report):
            files = info.manifest["files"]
            problem = first_mismatch(info.path, files, files, threads) if full else None
            if problem is None:
                return info
            report(f"checkpoint {info.path} skipped: {problem}")
        return None

    def prune(self, keep_last: int, keep_every: int, protect: Path | None = None) -> list[Path]:
        """Delete committed checkpoints beyond the newest `keep_last`, except every `keep_every`-th step and
        `protect`; leftover `.tmp` directories older than the newest commit go too."""
        committed = [c for c in self.scan() if c.problem is None]
        if not committed or keep_last <= 0:
            return []
        keep = {c.path for c in committed[:keep_last]}
        removed = [
            c.path
            for c in committed[keep_last:]
            if c.path != protect and c.path not in keep and not (keep_every and c.step % keep_every == 0)
        ]
        newest = committed[0].step
        removed += [c.path for c in self.scan() if c.path.name.endswith(".tmp") and c.step < newest]
        for path in removed:
            to_trash(path)
        fault_point("pruned", newest, 0)
        empty_trash(self.root)
        return removed


def to_trash(path: Path) -> None:
    """`path` out of every reader's sight at once, before it is deleted (a deletion takes a while, and a
    process killed inside it would leave a half-deleted checkpoint that looks like one): renamed to a unique
    TRASH name beside it, which `empty_trash` deletes, or the next one where a kill came first. Already gone
    (another rank of the node took it first) is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, path.with_name(f"{TRASH}{path.name}.{uuid.uuid4().hex}"))


def empty_trash(directory: Path) -> None:
    for trash in directory.glob(f"{TRASH}*"):
        shutil.rmtree(trash, ignore_errors=True)


def read_manifest(directory: Path, step: int) -> tuple[dict | None, str | None]:
    """(manifest, None), or (None, what is wrong with it)."""
    path = directory / MANIFEST
    if path.is_symlink() or not path.is_file():
        return None, f"missing {MANIFEST}"
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"unreadable {MANIFEST} ({err})"
    except OSError as err:
        return None, f"unreadable {MANIFEST} ({err.strerror})"
    if not isinstance(manifest, dict):
        return None, f"malformed {MANIFEST}: not an object"
    for key, kind in (("files", dict), ("layout", dict), ("config", str), ("step", int)):
        if not isinstance(manifest.get(key), kind):
            return None, f"malformed {MANIFEST}: '{key}' missing or not a {kind.__name__}"
    for name, record in manifest["files"].items():
        if not PLAIN_NAME.match(name) or name == MANIFEST:
            return None, f"malformed {MANIFEST}: file name {name!r} is not a plain name inside the checkpoint"
        if record_algorithm(record) is None:
            return None, f"malformed {MANIFEST}: the record of {name} needs an integer size and one checksum"
    if manifest["step"] != step:
        return None, f"{MANIFEST} is of step {manifest['step']}, not {step} (a renamed directory?)"
    if DCP_METADATA not in manifest["files"]:
        return None, f"missing {DCP_METADATA} (DCP's index of the shards)"
    return manifest, None


def check_files(directory: Path, files: dict[str, dict]) -> str | None:
    """What is wrong with the files of a checkpoint against its manifest's list and sizes, or None."""
    unlisted = sorted(set(os.listdir(directory)) - set(files) - {MANIFEST})
    if unlisted:
        return f"holds files its manifest does not list: {', '.join(unlisted[:5])}"
    for name, record in files.items():
        path = directory / name
        if path.is_symlink():
            return f"{name} is a symbolic link"
        if not path.is_file():
            return f"missing file {name}"
        size = path.stat().st_size
        if size != record["size"]:
            return f"{name} has {size} bytes, the manifest says {record['size']} (truncated?)"
    return None


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` on a daemon thread (a process that is failing is not held at exit by a save whose peers
    are gone); its result or exception in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            future.set_exception(err)

    threading.Thread(target=run, name="checkpoint-save", daemon=True).start()
    return future
