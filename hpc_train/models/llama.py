"""The Llama family (the default, `model.arch=llama`): RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention, no biases, untied embeddings unless `model.tie_embeddings=true`."""

from __future__ import annotations

import functools
import math

import torch.nn.functional as F
from torch import nn

from hpc_train.config import ModelConfig
from hpc_train.models import decoder
from hpc_train.models.spec import ActivationShape, ModelSpec, StageActivations


class SwiGLU(nn.Module):
    column_parallel, row_parallel = ("w1", "w3"), "w2"

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=bias)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=bias)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=bias)  # down (residual projection)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def ffn_size(cfg: ModelConfig) -> int:
    """ffn_hidden, or 8/3 * d_model rounded up to ffn_multiple."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    return math.ceil(int(8 * cfg.d_model / 3) / cfg.ffn_multiple) * cfg.ffn_multiple


ARCH = decoder.Architecture(
    norm=lambda width, eps: nn.RMSNorm(width, eps=eps),
    mlp=SwiGLU,
    ffn_size=ffn_size,
    linear_bias=False,
    rotary=True,
    tie_embeddings=False,
    residual_projections=("attn.wo.weight", "mlp.w2.weight"),
)


def activations(cfg: ModelConfig, shape: ActivationShape) -> StageActivations:
    """Derived from this block's saved-tensor trace, in units of T x d elements (T tokens on the rank, d
    model width, a heads, f the SwiGLU width) per block:

      two RMSNorms    2 x (2 fp32 tensors + an fp32 rstd of T)   input and normalized output kept in fp32
      matmul inputs   2 (the normed input of attention and of the MLP, in the activation dtype)
      q, k, v         1 + 2 kv/a                                 after RoPE, kept by SDPA
      attention out   1 (shared with wo's input), plus SDPA's fp32 logsumexp of T x a
      SwiGLU          4 f/d (w1 and w3 outputs, silu output, their product: w2's input)

    Fused SDPA never keeps the s x s attention matrix, so Korthikanti et al.'s 5as/h term does not exist
    here, and `selective` recompute saves only the logsumexp; `full` keeps only the block's input. Under
    tp everything after the column-parallel matmuls is divided by tp; with sequence parallelism the norm
    regions are too (the gathered matmul inputs are not)."""
    tokens, tp, e = shape.tokens, shape.tp, shape.element_bytes
    d, a, kv, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, ffn_size(cfg)
    norm_tokens = tokens // tp if shape.sequence_parallel else tokens
    norm = 2 * norm_tokens * d * 4 + norm_tokens * 4
    selective = (
        2 * norm
        + 2 * tokens * d * e
        + tokens * d * e * (1 + 2 * kv / a) // tp
        + tokens * d * e // tp
        + 4 * tokens * f * e // tp
    )
    vocab = decoder.padded_vocab_size(cfg, tp)
    return StageActivations(
        layer={
            "none": int(selective + tokens * a * 4 // tp),
            "selective": int(selective),
            "full": norm_tokens * d * e,
        },
        every_stage=2 * cfg.seq_len * (d // a) * 4,  # the RoPE tables
        first_stage=tokens * 8,  # token ids kept by the embedding
        last_stage=norm + tokens * d * e + tokens * vocab // tp * 4 + tokens * 8,  # head + fp32 log-softmax
    )


LLAMA = ModelSpec(
    name="llama",
    build_stage=functools.partial(decoder.build_stage, arch=ARCH),
    init_weights=decoder.init_weights,
    tp_plan=decoder.decoder_tp_plan,
    flops_per_token=functools.partial(decoder.decoder_flops_per_token, arch=ARCH),
    activations=activations,
    padded_vocab_size=decoder.padded_vocab_size,
    validate=functools.partial(decoder.validate_decoder, arch=ARCH),
    vocab_params=decoder.VOCAB_PARAMS,
)
