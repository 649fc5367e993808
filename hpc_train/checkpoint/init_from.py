"""`model.init_from`: the weights a run starts from (step 0, fresh optimizer), from a Hugging Face folder or
an hpc_train checkpoint of any layout, loaded into this run's layout. The architecture keys of the model
section come from the source; only the base model's weights are loaded (LoRA adapters start fresh)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import yaml

from hpc_train.checkpoint.checkpointer import read_parts
from hpc_train.checkpoint.hf_io import CONFIG, HFFolder, is_hf_folder
from hpc_train.checkpoint.integrity import WRITE_ALGORITHM, file_digest, new_digest
from hpc_train.checkpoint.state import ModelState
from hpc_train.checkpoint.store import CheckpointError, CheckpointInfo, CheckpointStore
from hpc_train.config import ConfigError, ModelConfig
from hpc_train.distributed.parallelize import ParallelModel, pad_rows
from hpc_train.features.lora.adapters import is_adapter, quantize_projections
from hpc_train.models.common.hf import ARCH_FIELDS, import_tensor, plan_import
from hpc_train.placement import distribute_like, local

Config = TypeVar("Config")  # a job's config (hpc_train.job): whatever holds a `model` section


def checkpoint_store(path: str | os.PathLike) -> CheckpointStore:
    """The checkpoints of a run directory (its `checkpoints/`) or of a checkpoints directory itself."""
    root = Path(path)
    return CheckpointStore(root / "checkpoints" if (root / "checkpoints").is_dir() else root)


def newest_checkpoint(path: str | os.PathLike, report=print, full: bool = True) -> CheckpointInfo:
    """The newest checkpoint under `path` that verifies (with `full`, checksums included)."""
    store = checkpoint_store(path)
    info = store.newest_valid(full=full, report=report)
    if info is None:
        raise CheckpointError(f"no usable checkpoint under '{store.root}' (nor a Hugging Face folder at '{path}')")
    return info


def source_model_fields(path: str) -> dict[str, Any]:
    """The architecture keys of the weights at `path`."""
    if is_hf_folder(path):
        return HFFolder(path).model_fields()
    info = newest_checkpoint(path, report=lambda message: None, full=False)  # its manifest only
    model = yaml.safe_load(info.manifest["config"])["model"]
    # max_position_embeddings: None before it was recorded; checkpoints written before model.moe were dense
    saved = {**model, **{f"moe.{key}": value for key, value in (model.get("moe") or {}).items()}}
    if model.get("moe") and "norm_topk_prob" not in model["moe"]:  # written before it: gates renormalized always
        saved["moe.norm_topk_prob"] = True
    return {key: saved.get(key, _model_key(ModelConfig(), key) if key.startswith("moe.") else None)
            for key in ARCH_FIELDS}  # fmt: skip


def _model_key(model: ModelConfig, key: str) -> Any:
    """An ARCH_FIELDS key's value: `moe.<key>` is model.moe's."""
    return functools.reduce(getattr, key.split("."), model)


def with_model_fields(model: ModelConfig, fields: dict[str, Any]) -> ModelConfig:
    """`model` with ARCH_FIELDS' `fields` (a source's) set, model.moe's in its section."""
    moe = {key.removeprefix("moe."): value for key, value in fields.items() if key.startswith("moe.")}
    rest = {key: value for key, value in fields.items() if not key.startswith("moe.")}
    return dataclasses.replace(model, **rest, moe=dataclasses.replace(model.moe, **moe))


def with_source_model(cfg: Config) -> Config:
    """`cfg`, a job's config, with its model section's architecture keys from `model.init_from`."""
    model = source_model(cfg.model)
    return cfg if model is cfg.model else dataclasses.replace(cfg, model=model)


def source_model(model: ModelConfig) -> ModelConfig:
    """`model` with its architecture keys taken from `model.init_from`; a key the config sets to something
    else than both its default and the source's is an error (it would not fit the weights)."""
    if not model.init_from:
        return model
    path = model.init_from
    if not Path(path).exists():
        raise ConfigError(f"model.init_from='{path}' does not exist; give a Hugging Face model folder or an "
                          "hpc_train run or checkpoint directory")  # fmt: skip
    try:
        fields = source_model_fields(path)
    except CheckpointError as err:
        raise ConfigError(f"model.init_from: {err}") from None
    default = ModelConfig()
    conflicts = [f"model.{key}={_model_key(model, key)!r} (it has {value!r})" for key, value in fields.items()
                 if _model_key(model, key) not in (value, _model_key(default, key))]  # fmt: skip
    if conflicts:
        raise ConfigError(f"model.init_from='{path}' does not fit {', '.join(conflicts)}: leave these keys out, "
                          "they come from the source")  # fmt: skip
    return with_model_fields(model, fields)


def load_base(model: ParallelModel, init_from: str | None, quantized_base: bool, io_threads: int = 1) -> None:
    """The base a run starts from: `init_from`'s weights (model.init_from), if any, then for QLoRA
    (`quantized_base`) its projections in NF4."""
    if init_from:
        load_initial_weights(model, init_from, io_threads)
    if quantized_base:
        for chunk in model.chunks:  # QLoRA: the block projections' weights (loaded or initialized) to NF4
            model.quantized.update(chunk.canonical_name(name) for name in quantize_projections(chunk))


@torch.no_grad()
def load_initial_weights(model: ParallelModel, path: str, io_threads: int = 1) -> None:
    """Every rank loads its part of the base model's weights from `path`, whatever layout wrote them."""
    if is_hf_folder(path):
        _load_hf(model, HFFolder(path))
    else:
        _load_checkpoint(model, path, io_threads)


def _load_hf(model: ParallelModel, folder: HFFolder) -> None:
    cfg, spec = model.model_cfg, model.spec
    with torch.device("meta"):
        whole = spec.build_stage(cfg)
    expected = {}
    for name, p in whole.named_parameters():
        shape = (cfg.vocab_size, *p.shape[1:]) if name in spec.vocab_params else tuple(p.shape)
        expected[whole.canonical_name(name)] = shape
    plan = plan_import(folder.adapter, cfg, folder.shapes, expected)
    for name, p in model.named_parameters:
        if is_adapter(name):
            continue
        full = import_tensor(plan, name, folder.read).to(p.dtype)
        if name in spec.vocab_params:
            full = pad_rows(full, p.shape[0])
        local(p).copy_(local(distribute_like(full, p)))


def _load_checkpoint(model: ParallelModel, path: str, io_threads: int) -> None:
    """The newest checkpoint under `path` that verifies (chosen by rank 0), its model part only."""
    chosen: list[Any] = [None, None, None]
    if dist.get_rank() == 0:
        try:
            info = newest_checkpoint(path)
            chosen = [str(info.path), info.manifest, None]
        except CheckpointError as err:
            chosen[2] = str(err)
    dist.broadcast_object_list(chosen, src=0)
    source, manifest, problem = chosen
    if problem:
        raise CheckpointError(f"model.init_from: {problem}")
    finetune = yaml.safe_load(manifest["config"]).get("finetune") or {}
    if finetune.get("method", "full") != "full":
        raise CheckpointError(f"model.init_from='{path}' holds LoRA adapters, which a new run would drop: merge "
                              "them with `hpc-train export-hf` and start from the exported folder")  # fmt: skip
    part = ModelState(model, adapters=False)
    part.load(read_parts(source, manifest, {"model": part}, io_threads)["model"], 0)


def base_fingerprint(path: str | None, seed: int) -> str:
    """What QLoRA's NF4 base is rebuilt from, by content (wherever it lies): the xxh3 of `path`'s files
    (model.init_from: a Hugging Face folder's config and safetensors, a checkpoint's manifest of checksummed
    files), or the seed of a random init (train.seed)."""
    if not path:
        return f"random init, train.seed={seed}"
    digest = new_digest()
    if is_hf_folder(path):
        for file in sorted(Path(path).glob("*.safetensors")) + [Path(path) / CONFIG]:
            digest.update(file.name.encode())
            digest.update(file_digest(file, WRITE_ALGORITHM).encode())
    else:
        files = newest_checkpoint(path, report=lambda message: None, full=False).manifest["files"]
        digest.update(json.dumps(files, sort_keys=True).encode())
    return f"xxh3_128:{digest.hexdigest()}"
