"""The Llama family's modules: the SwiGLU MLP and its width, and the `Architecture` that sets them into the
shared skeleton with RMSNorm, rotary positions, no biases and untied embeddings by default."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import Architecture
from hpc_train.models.common.norms import RMSNorm
from hpc_train.models.common.regather import gathered_projections
from hpc_train.models.llama.costs import rms_norm_saved_bytes


class SwiGLU(nn.Module):
    column_parallel, row_parallel = ("w1", "w3"), "w2"
    saved_widths = 4  # w1 and w3 outputs, silu output, their product (w2's input)
    recomputed_when_compiled = 1  # inductor recomputes the silu output from w1's

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=bias)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=bias)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=bias)  # down (residual projection)
        self.sequence_gather = nn.Identity()  # where tensor parallelism all-gathers a sequence-sharded input

    def forward(self, x):
        gate, up = gathered_projections(self, x, self.column_parallel)
        return self.w2(F.silu(gate) * up)


def ffn_size(cfg: ModelConfig) -> int:
    """ffn_hidden, or 8/3 * d_model rounded up to ffn_multiple."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    return math.ceil(int(8 * cfg.d_model / 3) / cfg.ffn_multiple) * cfg.ffn_multiple


ARCH = Architecture(
    norm=lambda width, eps: RMSNorm(width, eps=eps),
    mlp=SwiGLU,
    ffn_size=ffn_size,
    linear_bias=False,
    rotary=True,
    tie_embeddings=False,
    residual_projections=("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight"),
    norm_saved_bytes=rms_norm_saved_bytes,
    moe=True,
)
