"""Model families, selected by `model.arch`: one folder each (llama/, gpt2/) exporting its `ModelSpec`
(models/spec.py), built on what they share (common/); and the one place that says which family's Hugging
Face adapter serves a config.json or a ModelConfig."""

from __future__ import annotations

from typing import Any

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.models.common.hf import HFAdapter
from hpc_train.models.gpt2 import GPT2
from hpc_train.models.llama import LLAMA
from hpc_train.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA, GPT2)}


def get_spec(arch: str) -> ModelSpec:
    if arch not in MODEL_SPECS:
        raise ConfigError(f"model.arch={arch!r} is not one of {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[arch]


def hf_adapter_reading(config: dict[str, Any]) -> HFAdapter:
    """The adapter of the transformers class that wrote `config` (a config.json), by its model_type."""
    known = [adapter for spec in MODEL_SPECS.values() for adapter in spec.hf]
    for adapter in known:
        if adapter.model_type == config.get("model_type"):
            return adapter
    names = ", ".join(f"{adapter.model_type} ({adapter.architecture})" for adapter in known)
    raise ConfigError(f"Hugging Face model_type={config.get('model_type')!r} is not supported; hpc_train reads "
                      f"{names}")  # fmt: skip


def hf_adapter_writing(cfg: ModelConfig) -> HFAdapter:
    """The adapter `cfg` exports through: its family's for model.moe configs, or for dense ones."""
    experts = bool(cfg.moe.num_experts)
    for adapter in get_spec(cfg.arch).hf:
        if adapter.experts == experts:
            return adapter
    which = " for model.moe" if experts else ""
    raise ConfigError(f"model.arch={cfg.arch} has no Hugging Face counterpart{which} to export to")
