"""The Llama family (the default, `model.arch=llama`): RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention, no biases, untied embeddings unless `model.tie_embeddings=true`."""

from __future__ import annotations

from hpc_train.models.common.family import decoder_spec
from hpc_train.models.llama.hf import LLAMA_HF
from hpc_train.models.llama.mixtral_hf import MIXTRAL_HF
from hpc_train.models.llama.model import ARCH

LLAMA = decoder_spec("llama", ARCH, (LLAMA_HF, MIXTRAL_HF))

__all__ = ["LLAMA"]
