"""The GPT-2 family's modules: the GELU MLP and its width, and the `Architecture` that sets them into the
shared skeleton with LayerNorm, learned positions, biases everywhere and tied embeddings by default."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import Architecture
from hpc_train.models.common.norms import LayerNorm
from hpc_train.models.common.regather import gathered_projections
from hpc_train.models.gpt2.costs import layer_norm_saved_bytes


class GeluMLP(nn.Module):
    column_parallel, row_parallel = ("fc",), "proj"
    saved_widths = 2  # fc output (kept by GELU), GELU output (proj's input)
    recomputed_when_compiled = 0

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)  # residual projection
        self.sequence_gather = nn.Identity()  # where tensor parallelism all-gathers a sequence-sharded input

    def forward(self, x):
        (hidden,) = gathered_projections(self, x, self.column_parallel)
        return self.proj(F.gelu(hidden, approximate="tanh"))


def ffn_size(cfg: ModelConfig) -> int:
    return cfg.ffn_hidden if cfg.ffn_hidden is not None else 4 * cfg.d_model


ARCH = Architecture(
    norm=lambda width, eps: LayerNorm(width, eps=eps),
    mlp=GeluMLP,
    ffn_size=ffn_size,
    linear_bias=True,
    rotary=False,
    tie_embeddings=True,
    residual_projections=("attn.wo.weight", "mlp.proj.weight"),
    norm_saved_bytes=layer_norm_saved_bytes,
)
