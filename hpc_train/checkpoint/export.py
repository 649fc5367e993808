"""`hpc-train ckpt convert`: a checkpoint as files that other tools read without hpc_train.

hpc_train's shards hold RAW records (checkpoint/dcp_io.py), which stock DCP readers (`dcp.load` with the
stock FileSystemReader, `dcp_to_torch_save`) refuse. Converting reads every stored tensor whole, in the
shape and dtype DCP's metadata gives it (any layout's shards put together), through our own reader, in one
process and without a process group, and writes them out as one `torch.save` file (`torch`), one
safetensors file (`safetensors`) or a DCP directory of stock `torch.save` records (`dcp`). The whole state
(model and optimizer) is in this process's memory at once. Nothing is written over: the output appears
under its name only when complete (a temporary name beside it, then a rename).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

import hpc_train
from hpc_train.checkpoint.checkpointer import load_errors_named
from hpc_train.checkpoint.dcp_io import ParallelReader
from hpc_train.checkpoint.hf_io import require_module
from hpc_train.checkpoint.init_from import checkpoint_store
from hpc_train.checkpoint.safe_load import CheckpointError, read_dcp_metadata
from hpc_train.checkpoint.store import CheckpointInfo, fsync_path
from hpc_train.errors import UserError

FORMATS = ("torch", "safetensors", "dcp")
STEP_KEY = "step"  # beside the tensors (whose keys all start with their part's name: `model.`, `optim.`)
READ_THREADS = 4  # shard files read at a time


@dataclass
class Converted:
    path: Path
    tensors: int
    bytes: int


def chosen_checkpoint(path: str | os.PathLike, step: int | None = None, report: Callable = print) -> CheckpointInfo:
    """The checkpoint to convert under `path` (a run directory or its checkpoints directory): that of `step`,
    else the newest usable one (the others reported as skipped), fully verified, checksums included: every
    byte of it is read."""
    store = checkpoint_store(path)
    found = store.scan()
    if not found:
        raise FileNotFoundError(f"no checkpoints under {store.root}")
    if step is None:
        info = store.newest_valid(full=True, report=report)
        if info is None:
            raise CheckpointError(f"no usable checkpoint under {store.root}")
        return info
    of_step = [info for info in found if info.step == step]
    if not of_step:
        raise FileNotFoundError(f"no checkpoint of step {step} under {store.root}")
    info = store.verify(of_step[0])  # a committed one before a leftover .tmp of the same step (scan's order)
    if info.problem is not None:
        raise CheckpointError(f"no usable checkpoint of step {step}: {info.path}: {info.problem}")
    return info


def read_whole(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint stores, whole, by its stored key. DCP loads without a process group into
    empty host tensors sized from its metadata: `_load_state_dict(no_dist=True)`, the call torch's own
    `dcp_to_torch_save` makes (public `dcp.load` warns that no group is there). Our reader reads RAW records
    and earlier versions' torch.save records alike."""
    metadata = read_dcp_metadata(info.path, set(info.manifest["files"])).state_dict_metadata
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in sorted(metadata.items())}
    with load_errors_named(str(info.path)):
        _load_state_dict(state, storage_reader=ParallelReader(info.path, READ_THREADS), no_dist=True)
    return state


def convert(info: CheckpointInfo, out: str | os.PathLike, to: str) -> Converted:
    """Write the checkpoint `info` (verified) to `out`, a new file (torch, safetensors) or directory (dcp),
    in format `to`; the step goes with it (safetensors: in its metadata, with hpc_train's version)."""
    if to not in FORMATS:
        raise UserError(f"--to {to}: the formats are {', '.join(FORMATS)}")
    save_file = require_module("safetensors.torch").save_file if to == "safetensors" else None
    with published(Path(out), directory=to == "dcp") as tmp:
        state = read_whole(info)
        if to == "torch":
            torch.save({**state, STEP_KEY: info.step}, tmp)
        elif to == "safetensors":  # it refuses tensors that share memory or are not contiguous
            metadata = {"format": "pt", STEP_KEY: str(info.step), "hpc_train_version": hpc_train.__version__}
            save_file({key: t.contiguous() for key, t in state.items()}, str(tmp), metadata=metadata)
        else:  # stock torch.save records, the step as DCP's bytes entry (dcp_to_torch_save gives torch's file)
            _save_state_dict({**state, STEP_KEY: info.step}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    size = sum(f.stat().st_size for f in Path(out).iterdir()) if to == "dcp" else Path(out).stat().st_size
    return Converted(Path(out), len(state), size)


def refuse_existing(out: str | os.PathLike) -> None:
    """Nothing is written over: checked before the checkpoint is read (and again before the rename)."""
    if Path(out).exists() or Path(out).is_symlink():
        raise UserError(f"{out} already exists; convert writes a new file or directory, never over one: give "
                        "another path or remove it")  # fmt: skip


@contextmanager
def published(out: Path, directory: bool) -> Iterator[Path]:
    """A new file (or directory) beside `out` to write into, synced and renamed to `out` once the block has
    written all of it; removed if it fails. `out` must not exist, before or after: nothing is written over."""
    refuse_existing(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    if directory:
        tmp.mkdir()
    else:
        tmp.touch(exist_ok=False)
    mode = stat.S_IMODE(tmp.stat().st_mode)  # as the umask has it (safetensors writes its file 0600)
    try:
        yield tmp
        os.chmod(tmp, mode)
        for path in [*tmp.iterdir(), tmp] if directory else [tmp]:
            fsync_path(path)
        if out.exists() or out.is_symlink():  # appeared while converting
            raise UserError(f"{out} appeared while converting; nothing was written over it")
        os.rename(tmp, out)
    except BaseException:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    fsync_path(out.parent)
