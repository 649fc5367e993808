"""Model families, selected by `model.arch`: one folder each (llama/, gpt2/) exporting its `ModelSpec`
(models/spec.py), built on what they share (common/)."""

from __future__ import annotations

from hpc_train.config import ConfigError
from hpc_train.models.gpt2 import GPT2
from hpc_train.models.llama import LLAMA
from hpc_train.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA, GPT2)}


def get_spec(arch: str) -> ModelSpec:
    if arch not in MODEL_SPECS:
        raise ConfigError(f"model.arch={arch!r} is not one of {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[arch]
