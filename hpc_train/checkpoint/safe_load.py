"""Reading checkpoint files without running code from them.

A checkpoint directory may come from anyone (a shared file system, a download), so nothing read from
it may execute: per-rank files are loaded with `torch.load(weights_only=True)` (tensors and plain
Python values only), and DCP's `.metadata`, a pickle that DCP itself loads with the unrestricted
`pickle.load`, goes through an unpickler that builds only DCP's own metadata classes, torch dtypes and
sizes. The result is then checked: every entry a tensor (a bytes entry would make DCP call
`torch.load(weights_only=False)`), every shard file a plain name inside the checkpoint, no transform but
RAW (a record of a tensor's bytes only, checkpoint/dcp_io.py).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from hpc_train.errors import UserError

PLAIN_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.\-]+$")  # a file directly inside the checkpoint
DCP_METADATA = ".metadata"
RAW = "hpc_train.raw"  # a record of a tensor's bytes only (DCP's metadata has its shape and dtype): dcp_io.py


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used, naming the checkpoint and the file."""


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not part of DCP's metadata")


def read_dcp_metadata(directory: Path, allowed_files: set[str] | None = None) -> dcp_metadata.Metadata:
    """DCP's index of a checkpoint's shards, built without running code and checked for what this
    project writes; `allowed_files`: the shard files it may name (the manifest's)."""
    path = Path(directory) / DCP_METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(f"{path} is not DCP metadata this project wrote: {err}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in (metadata.state_dict_metadata or {}).items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor (hpc_train saves only tensors)")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(name, str):
            raise CheckpointError(f"{path}: a storage entry is malformed")
        if not PLAIN_NAME.match(name) or (allowed_files is not None and name not in allowed_files):
            raise CheckpointError(f"{path} points at {name!r}, which is not a shard file of this checkpoint")
        if info.transform_descriptors and list(info.transform_descriptors) != [RAW]:
            raise CheckpointError(f"{path}: shard {name} asks for load transforms {info.transform_descriptors}, "
                                  f"which hpc_train never writes")  # fmt: skip
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `read_metadata` through the restricted unpickler (the shards themselves
    DCP already reads with `weights_only=True`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not used by hpc_train")
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# numpy arrays in per-rank files of format 1 and 2 (the numpy RNG state): plain arrays, no objects
_numpy_core = getattr(np, "_core", None) or np.core
_LEGACY_NUMPY = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _numpy_core.multiarray._reconstruct]


def load_rank_file(path: str | os.PathLike) -> dict[str, Any]:
    """A per-rank state file: tensors and plain Python values only."""
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} holds something other than tensors and plain values, refused: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a per-rank state file (it holds a {type(state).__name__})")
    return state
