"""A family built on the shared skeleton, as a `ModelSpec`: its `Architecture` bound into the skeleton's
stage builder, init, tensor-parallel plan, cost formulas and checks."""

from __future__ import annotations

import functools

from hpc_train.models.common.costs import decoder_activations, decoder_flops_per_token
from hpc_train.models.common.decoder import (
    VOCAB_PARAMS,
    Architecture,
    build_stage,
    init_weights,
    padded_vocab_size,
    validate_decoder,
)
from hpc_train.models.common.hf import HFFormat
from hpc_train.models.common.tp_plan import decoder_tp_plan
from hpc_train.models.spec import ModelSpec


def decoder_spec(name: str, arch: Architecture, hf: HFFormat | None = None) -> ModelSpec:
    """The registry entry of a family built on this skeleton."""
    return ModelSpec(
        name=name,
        build_stage=functools.partial(build_stage, arch=arch),
        init_weights=init_weights,
        tp_plan=decoder_tp_plan,
        flops_per_token=functools.partial(decoder_flops_per_token, arch=arch),
        activations=functools.partial(decoder_activations, arch=arch),
        padded_vocab_size=padded_vocab_size,
        validate=functools.partial(validate_decoder, arch=arch),
        vocab_params=VOCAB_PARAMS,
        hf=hf,
    )
