"""`hpc-train import-hf` and `export-hf`: Hugging Face folders to sharded checkpoints of any layout, and any
checkpoint back to a folder `transformers` loads (LoRA adapters merged, or alone in PEFT's format); and
either loaded whole into one process (`load_model`, for export and `generate`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from hpc_train.bootstrap import RankEnv, distributed, select_device
from hpc_train.builder import build_model
from hpc_train.checkpoint.checkpointer import read_parts
from hpc_train.checkpoint.hf_io import (
    check_tokenizer,
    is_hf_folder,
    require_module,
    save_hf,
    save_tokenizer,
    written_into,
)
from hpc_train.checkpoint.init_from import (
    base_fingerprint,
    checkpoint_store,
    load_base,
    newest_checkpoint,
    source_model_fields,
    with_source_model,
)
from hpc_train.checkpoint.state import ModelState
from hpc_train.checkpoint.store import CheckpointError, CheckpointInfo
from hpc_train.config import ConfigError
from hpc_train.data.indexed import replace_file
from hpc_train.data.prepare import dataset_tokenizer
from hpc_train.data.tokenizer import TOKENIZER_FILE
from hpc_train.distributed.mesh import Mesh, ParallelDims
from hpc_train.distributed.parallelize import ParallelModel, full_state_dict
from hpc_train.features.lora.adapters import merge_adapters
from hpc_train.job import JobConfig, load_config
from hpc_train.models import hf_adapter_writing
from hpc_train.models.common.hf import hf_modules

# what a checkpoint of any layout is loaded into for export: one process, whole fp32 weights
SINGLE_PROCESS = ["parallel.nproc=1", "parallel.tp=1", "parallel.pp=1", "parallel.dp=null",
                  "parallel.virtual_stages=1", "parallel.schedule=1f1b", "parallel.sequence_parallel=false",
                  "optim.zero_stage=0", "optim.offload=none", "optim.reshard_after_forward=null",
                  "parallel.cp=1", "parallel.ep=1", "train.precision=fp32", "train.device=cpu", "train.fp8=off",
                  "train.fp8_all_gather=false"]  # fmt: skip


def whole_context(source: str) -> list[str]:
    """A conversion trains nothing: its model.seq_len (RoPE tables, generate's window) is the source's whole
    context, unless the overrides after this say otherwise."""
    context = source_model_fields(source).get("max_position_embeddings")
    return [f"model.seq_len={context}"] if context else []


def import_config(hf_dir: str, out: str, overrides: list[str]) -> JobConfig:
    """The run import-hf builds: the layout of `overrides`, the model of `hf_dir`, checkpoints into `out`.
    It starts the ranks that layout needs: parallel.nproc is at least tp x pp x dp (dp left out: 1)."""
    if checkpoint_store(out).scan():
        raise ConfigError(f"'{out}' already holds checkpoints; import into a new directory")
    fixed = [f"model.init_from={hf_dir}", f"run_dir={out}", f"checkpoint.dir={out}", "checkpoint.async_save=false"]
    cfg = with_source_model(load_config(None, [*whole_context(hf_dir), *overrides, *fixed]))
    p = cfg.parallel
    nproc = max(p.nproc, p.tp * p.pp * (p.dp or 1))
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, nproc=nproc))


def import_hf(rank_env: RankEnv, cfg: JobConfig) -> None:
    """Per rank: build the layout with the Hugging Face weights (builder's `model.init_from`), save step 0;
    rank 0 then copies the folder's tokenizer.json, if any, beside the checkpoints (`source_tokenizer`)."""
    from hpc_train.builder import build_run

    device = select_device(cfg.train.device, rank_env.local_rank)
    p = cfg.parallel
    with distributed(rank_env, device, p.backend, p.timeout_s, p.rendezvous_timeout_s):
        run = build_run(cfg, rank_env, device, with_data=False)
        run.checkpointer.claim()
        try:
            run.checkpointer.save(0)
        finally:
            run.checkpointer.release()
    tokenizer = Path(cfg.model.init_from) / TOKENIZER_FILE
    if rank_env.rank == 0 and tokenizer.is_file():
        replace_file(Path(cfg.run_dir) / TOKENIZER_FILE, tokenizer.read_bytes())


def load_model(
    source: str, base: str | None = None, info: CheckpointInfo | None = None
) -> tuple[JobConfig, ParallelModel]:
    """The model of the newest verified checkpoint under `source` (or `info`, one already found there: any
    layout; adapters and QLoRA's NF4 base as trained) or of a Hugging Face folder, in one process, with its
    config; needs a one-rank process group. `base`: where a QLoRA run's base weights are now, if they moved
    since training."""
    if info is None and not is_hf_folder(source):
        info = newest_checkpoint(source)
    if info is None:
        whole = [*SINGLE_PROCESS, *whole_context(source), f"model.init_from={source}"]
        cfg = with_source_model(load_config(None, whole))
    else:
        moved = [f"model.init_from={base}"] if base else []
        cfg = load_config(None, [*SINGLE_PROCESS, *moved], saved=info.manifest["config"])
    model = build_model(cfg, Mesh(ParallelDims(), "cpu"), torch.device("cpu"))
    qlora = cfg.finetune.quantized_base
    if info is None or qlora:  # a checkpoint holds its weights, except QLoRA's NF4 base: rebuilt as in training
        fingerprint = base_fingerprint(cfg.model.init_from, cfg.train.seed) if qlora else None
        if qlora and fingerprint != info.manifest.get("base_weights"):
            raise CheckpointError(f"{info.path} was trained on the base weights {info.manifest.get('base_weights')}"
                                  f", but model.init_from={cfg.model.init_from} holds {fingerprint}; give where "
                                  "they are now with --base")  # fmt: skip
        load_base(model, cfg.model.init_from, qlora)
    if info is not None:
        part = ModelState(model)
        part.load(read_parts(str(info.path), info.manifest, {"model": part}, cfg.checkpoint.io_threads)["model"], 0)
    return cfg, model


def load_whole(source: str, base: str | None = None) -> tuple[JobConfig, dict[str, torch.Tensor]]:
    """`load_model`'s weights as whole unpadded tensors (adapters too, NF4 dequantized)."""
    cfg, model = load_model(source, base)
    state, chunk, vocab = full_state_dict(model), model.chunks[0], cfg.model.vocab_size
    return cfg, {
        name: t[:vocab] if name in model.spec.vocab_params else t
        for name, t in state.items()
        if chunk.canonical_name(name) == name
    }  # a tied head: the embedding


def export_hf(
    source: str, out: str, adapters_only: bool = False, base: str | None = None, tokenizer: str | None = None
) -> Path:
    """Write the checkpoint under `source` as a Hugging Face folder at `out`, with `tokenizer` (default: the
    one the run recorded, `source_tokenizer`; none known: no tokenizer files); needs a one-rank process group."""
    cfg, state = load_whole(source, base)
    tokenizer = tokenizer or source_tokenizer(source)
    if adapters_only:
        return save_peft_adapters(out, cfg, state, tokenizer)
    if cfg.finetune.adapters:
        state = merge_adapters(state, cfg.finetune)
    return save_hf(out, hf_adapter_writing(cfg.model), cfg.model, state, tokenizer)


def source_tokenizer(source: str) -> str | None:
    """The tokenizer the model under `source` was trained with, as `build_tokenizer` takes it: SOURCE's
    tokenizer.json (a Hugging Face folder, or the run directory, where the run records it at its start),
    else that of the run directory its newest checkpoint names (checkpoint.dir elsewhere), else, for a
    checkpoint that trained (step > 0: not one `import-hf` wrote), the one its training data records
    (data/prepare.py's `dataset_tokenizer`: a run from before runs recorded theirs, its data still in place).
    None: none known."""
    if (Path(source) / TOKENIZER_FILE).is_file():
        return str(Path(source) / TOKENIZER_FILE)
    if is_hf_folder(source):
        return None
    info = newest_checkpoint(source, report=lambda message: None, full=False)  # its manifest only
    saved = load_config(None, [], saved=info.manifest["config"])
    if (Path(saved.run_dir) / TOKENIZER_FILE).is_file():
        return str(Path(saved.run_dir) / TOKENIZER_FILE)
    if info.step == 0:
        return None
    prefixes = [s.path for s in saved.data.sources] or [saved.data.train_path]
    return next(filter(None, map(dataset_tokenizer, prefixes)), None)


def save_peft_adapters(out: str, cfg: JobConfig, state: dict[str, torch.Tensor], tokenizer: str | None) -> Path:
    """LoRA adapters alone, as PEFT saves them (adapter_model.safetensors + adapter_config.json), named after
    the Hugging Face modules they sit beside, with `tokenizer`'s files if given."""
    save_file = require_module("safetensors.torch").save_file
    ft = cfg.finetune
    if not ft.adapters:
        raise CheckpointError("--adapters-only: this checkpoint was trained with finetune.method=full; it has none")
    modules = [name.removesuffix(".lora_a") for name in state if name.endswith(".lora_a")]
    theirs, fan_in_fan_out = hf_modules(hf_adapter_writing(cfg.model), cfg.model, modules)
    tensors = {}
    for module in modules:
        tensors[f"base_model.model.{theirs[module]}.lora_A.weight"] = state[f"{module}.lora_a"].contiguous()
        tensors[f"base_model.model.{theirs[module]}.lora_B.weight"] = state[f"{module}.lora_b"].contiguous()
    # target_modules: whole names (GPT-2's attn.c_proj and mlp.c_proj share their last part)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ft.lora_rank, "lora_alpha": ft.lora_alpha,
              "lora_dropout": ft.lora_dropout, "target_modules": sorted(set(theirs.values())), "bias": "none",
              "fan_in_fan_out": fan_in_fan_out, "inference_mode": True,
              "base_model_name_or_path": None}  # fmt: skip
    special = check_tokenizer(tokenizer, cfg.model.vocab_size) if tokenizer else None
    with written_into(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        if special:
            save_tokenizer(tmp, tokenizer, special, cfg.model.context_len)
    return Path(out)
