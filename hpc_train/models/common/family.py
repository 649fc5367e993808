"""A family built on the shared skeleton, as a `ModelSpec`: its `Architecture` bound into the skeleton's
stage builder, init, tensor-parallel plan, cost formulas and checks."""

from __future__ import annotations

import functools

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.models.common.costs import decoder_activations, decoder_flops_per_token
from hpc_train.models.common.decoder import (
    VOCAB_PARAMS,
    Architecture,
    build_stage,
    init_weights,
    padded_vocab_size,
    ties_embeddings,
    validate_decoder,
)
from hpc_train.models.common.hf import HFAdapter
from hpc_train.models.common.moe import expert_hidden, reset_expert_bias, validate_moe
from hpc_train.models.common.tp_plan import decoder_tp_plan
from hpc_train.models.spec import ModelSpec, StageModule


def init_stage(model: StageModule, seed: int) -> None:
    """The skeleton's init, and the MoE routing biases at zero."""
    init_weights(model, seed)
    reset_expert_bias(model)


def validate_family(cfg: ModelConfig, tp: int, *, name: str, arch: Architecture) -> None:
    """The skeleton's shape checks, and model.moe's (for a family whose blocks take experts)."""
    validate_decoder(cfg, tp, arch=arch)
    if cfg.moe.num_experts and not arch.moe:
        raise ConfigError(f"model.moe.num_experts={cfg.moe.num_experts}: model.arch={name} has no MoE blocks; "
                          "use model.arch=llama or model.moe.num_experts=0")  # fmt: skip
    validate_moe(cfg)
    shared = expert_hidden(cfg, arch.ffn_size(cfg)) * cfg.moe.num_shared_experts
    if cfg.moe.num_experts and shared % tp:
        raise ConfigError(f"the shared experts' width {shared} is not divisible by parallel.tp={tp}; set "
                          "model.moe.expert_ffn_hidden to a multiple of tp")  # fmt: skip


def decoder_spec(name: str, arch: Architecture, hf: tuple[HFAdapter, ...] = ()) -> ModelSpec:
    """The registry entry of a family built on this skeleton."""
    return ModelSpec(
        name=name,
        build_stage=functools.partial(build_stage, arch=arch),
        init_weights=init_stage,
        tp_plan=decoder_tp_plan,
        flops_per_token=functools.partial(decoder_flops_per_token, arch=arch),
        activations=functools.partial(decoder_activations, arch=arch),
        padded_vocab_size=padded_vocab_size,
        ties_embeddings=functools.partial(ties_embeddings, arch=arch),
        validate=functools.partial(validate_family, name=name, arch=arch),
        vocab_params=VOCAB_PARAMS,
        hf=hf,
    )
