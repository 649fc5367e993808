"""The GPT-2 family (`model.arch=gpt2`): LayerNorm with bias, a GELU MLP 4x wide, learned position
embeddings (as many as model.seq_len), biases in every projection, tied input/output embeddings."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from hpc_train.config import ModelConfig
from hpc_train.models import decoder


class GeluMLP(nn.Module):
    column_parallel, row_parallel = ("fc",), "proj"
    saved_widths = 2  # fc output (kept by GELU), GELU output (proj's input)

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)  # residual projection

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def ffn_size(cfg: ModelConfig) -> int:
    return cfg.ffn_hidden if cfg.ffn_hidden is not None else 4 * cfg.d_model


def layer_norm_saved_bytes(tokens: int, width: int, element_bytes: int) -> int:
    """LayerNorm keeps its input, and a mean and rstd per token, in the activation dtype."""
    return tokens * width * element_bytes + 2 * tokens * element_bytes


ARCH = decoder.Architecture(
    norm=lambda width, eps: nn.LayerNorm(width, eps=eps),
    mlp=GeluMLP,
    ffn_size=ffn_size,
    linear_bias=True,
    rotary=False,
    tie_embeddings=True,
    residual_projections=("attn.wo.weight", "mlp.proj.weight"),
    norm_saved_bytes=layer_norm_saved_bytes,
)
GPT2 = decoder.decoder_spec("gpt2", ARCH)
