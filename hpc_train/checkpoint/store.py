"""Checkpoints on disk: the commit protocol, verification and retention.

A save writes into `step_XXXXXXX.tmp/`. Each rank records the size and sha256 of every file it wrote;
rank 0 then writes `manifest.json` (files, sizes, checksums, layout, config, code version), fsyncs the
files and the directory, renames it to `step_XXXXXXX/`, and only then replaces the `latest` pointer
atomically (temp file, fsync, rename). A crash at any point leaves either the previous state or a
`.tmp` directory, which is never loaded. Loading picks the newest checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_train.faults import fault_point

MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{7,})$")
CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, naming the checkpoint and the file."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """Size and sha256 of files this rank wrote (read back from disk, so the record is what landed)."""
    out = {}
    for name in names:
        path = directory / name
        fsync_path(path)
        out[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return out


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
                found.append(CheckpointInfo(path, int(match.group(1))))
            elif path.name.endswith(".tmp") and path.is_dir() and (m := STEP_DIR.match(path.name[:-4])):
                found.append(CheckpointInfo(path, int(m.group(1)), "incomplete save (.tmp, never committed)"))
        return sorted(found, key=lambda c: (c.step, c.problem is None), reverse=True)

    def verify(self, info: CheckpointInfo, full: bool = True) -> CheckpointInfo:
        """Check the manifest, every file's size and (full) its sha256, and DCP's .metadata."""
        if info.problem:
            return info
        try:
            manifest = json.loads((info.path / MANIFEST).read_text())
        except FileNotFoundError:
            return CheckpointInfo(info.path, info.step, f"missing {MANIFEST}")
        except json.JSONDecodeError:
            return CheckpointInfo(info.path, info.step, f"unreadable {MANIFEST}")
        files = manifest.get("files", {})
        if ".metadata" not in files or not (info.path / ".metadata").is_file():
            return CheckpointInfo(info.path, info.step, "missing .metadata (DCP's index of the shards)", manifest)
        for name, record in files.items():
            path = info.path / name
            if not path.is_file():
                return CheckpointInfo(info.path, info.step, f"missing file {name}", manifest)
            if path.stat().st_size != record["size"]:
                problem = f"{name} has {path.stat().st_size} bytes, the manifest says {record['size']} (truncated?)"
                return CheckpointInfo(info.path, info.step, problem, manifest)
            if full and sha256_file(path) != record["sha256"]:
                return CheckpointInfo(info.path, info.step, f"{name} fails its sha256 checksum (corrupted)", manifest)
        return CheckpointInfo(info.path, info.step, None, manifest)

    def newest_valid(self, full: bool = True, report=print) -> CheckpointInfo | None:
        for info in self.scan():
            checked = self.verify(info, full)
            if checked.problem is None:
                return checked
            report(f"checkpoint {info.path} skipped: {checked.problem}")
        return None

    def prune(self, keep_last: int, keep_every: int, protect: Path | None = None) -> list[Path]:
        """Delete committed checkpoints beyond the newest `keep_last`, except every `keep_every`-th step and
        `protect`; leftover `.tmp` directories older than the newest commit go too."""
        committed = [c for c in self.scan() if c.problem is None]
        if not committed or keep_last <= 0:
            return []
        keep = {c.path for c in committed[:keep_last]}
        removed = []
        for c in committed[keep_last:]:
            if c.path == protect or c.path in keep or (keep_every and c.step % keep_every == 0):
                continue
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
        newest = committed[0].step
        for c in self.scan():
            if c.problem and c.step < newest:
                shutil.rmtree(c.path, ignore_errors=True)
                removed.append(c.path)
        return removed
