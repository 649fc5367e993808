"""The GPT-2 family (`model.arch=gpt2`): LayerNorm with bias, a GELU MLP 4x wide, learned position
embeddings (as many as model.seq_len), biases in every projection, tied input/output embeddings."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

from hpc_train.config import ModelConfig
from hpc_train.models import decoder
from hpc_train.models.spec import ActivationShape, ModelSpec, StageActivations


class GeluMLP(nn.Module):
    column_parallel, row_parallel = ("fc",), "proj"

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)  # residual projection

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def ffn_size(cfg: ModelConfig) -> int:
    return cfg.ffn_hidden if cfg.ffn_hidden is not None else 4 * cfg.d_model


ARCH = decoder.Architecture(
    norm=lambda width, eps: nn.LayerNorm(width, eps=eps),
    mlp=GeluMLP,
    ffn_size=ffn_size,
    linear_bias=True,
    rotary=False,
    tie_embeddings=True,
    residual_projections=("attn.wo.weight", "mlp.proj.weight"),
)


def activations(cfg: ModelConfig, shape: ActivationShape) -> StageActivations:
    """Derived from this block's saved-tensor trace, in units of T x d elements per block:

      two LayerNorms  2 x (the input + its mean and rstd of T), in the activation dtype
      matmul inputs   2 (the normed input of attention and of the MLP, in the activation dtype)
      q, k, v         1 + 2 kv/a, kept by SDPA
      attention out   1 (shared with wo's input), plus SDPA's fp32 logsumexp of T x a
      GELU MLP        2 f/d (fc output, kept by GELU; GELU output, proj's input)

    Biases keep nothing; the learned positions are a slice of a parameter. Division by tp and sequence
    parallelism as for Llama (models/llama.py)."""
    tokens, tp, e = shape.tokens, shape.tp, shape.element_bytes
    d, a, kv, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, ffn_size(cfg)
    norm_tokens = tokens // tp if shape.sequence_parallel else tokens
    norm = norm_tokens * d * e + 2 * norm_tokens * e
    selective = (
        2 * norm
        + 2 * tokens * d * e
        + tokens * d * e * (1 + 2 * kv / a) // tp
        + tokens * d * e // tp
        + 2 * tokens * f * e // tp
    )
    vocab = decoder.padded_vocab_size(cfg, tp)
    return StageActivations(
        layer={
            "none": int(selective + tokens * a * 4 // tp),
            "selective": int(selective),
            "full": norm_tokens * d * e,
        },
        every_stage=0,
        first_stage=tokens * 8,  # token ids kept by the embedding
        last_stage=norm + tokens * d * e + tokens * vocab // tp * 4 + tokens * 8,  # head + fp32 log-softmax
    )


GPT2 = ModelSpec(
    name="gpt2",
    build_stage=functools.partial(decoder.build_stage, arch=ARCH),
    init_weights=decoder.init_weights,
    tp_plan=decoder.decoder_tp_plan,
    flops_per_token=functools.partial(decoder.decoder_flops_per_token, arch=ARCH),
    activations=activations,
    padded_vocab_size=decoder.padded_vocab_size,
    validate=functools.partial(decoder.validate_decoder, arch=ARCH),
    vocab_params=decoder.VOCAB_PARAMS,
)
