"""The GPT-2 family (`model.arch=gpt2`): LayerNorm with bias, a GELU MLP 4x wide, learned position
embeddings (model.max_position_embeddings of them, or model.seq_len), biases in every projection, tied
input/output embeddings."""

from __future__ import annotations

from hpc_train.models.common.family import decoder_spec
from hpc_train.models.gpt2.hf import GPT2_HF
from hpc_train.models.gpt2.model import ARCH

GPT2 = decoder_spec("gpt2", ARCH, (GPT2_HF,))

__all__ = ["GPT2"]
