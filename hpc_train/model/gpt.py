"""A GPT-style decoder: token embedding, rotary positions, pre-norm RMSNorm, causal SDPA attention,
SwiGLU MLP, optional tied output head.

Attention reshapes by head dimension, not by head count, so the same code runs on the local head shard
of a tensor-parallel rank. The embedding and head are padded to `padded_vocab_size` rows (Megatron's
vocabulary padding); the padded entries get -inf logits, so they never enter the loss.
"""

from __future__ import annotations

import inspect
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from hpc_train.config import ModelConfig


def padded_vocab_size(cfg: ModelConfig, tp: int = 1) -> int:
    multiple = cfg.vocab_multiple * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotate-half form of RoPE."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.recompute_core = False  # selective recompute: keep only q, k, v for the attention core
        self.head_dim = cfg.d_model // cfg.n_heads
        kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos[:seq], sin[:seq]), apply_rotary(k, cos[:seq], sin[:seq])
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head across its q group
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(F.scaled_dot_product_attention, q, k, v, is_causal=True, use_reentrant=False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.ffn_size()
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down (residual projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.recompute_all = False  # full recompute: keep only the block's input
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute_all and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def apply_recompute(model: GPT, cfg: ModelConfig) -> None:
    """Activation recompute (torch.utils.checkpoint, non-reentrant) for the blocks of this model or
    pipeline stage: `selective` recomputes the attention core, `full` whole blocks; with
    `recompute_every=k` only every k-th block of the stage, with `recompute_first=M` only its first M."""
    for i, block in enumerate(model.layers.values()):
        chosen = cfg.recompute != "none" and i % cfg.recompute_every == 0
        chosen = chosen and (cfg.recompute_first is None or i < cfg.recompute_first)
        block.recompute_all = chosen and cfg.recompute == "full"
        block.attn.recompute_core = chosen and cfg.recompute == "selective"


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it: `layer_ids` picks the blocks (their names stay global,
    `layers.<i>`), `first` adds the embedding, `last` the final norm and output head. `tp` only sets the
    vocabulary padding; the tensor-parallel sharding itself is applied by `distributed.tensor_parallel`."""

    def __init__(
        self, cfg: ModelConfig, tp: int = 1, layer_ids: range | None = None, first: bool = True, last: bool = True
    ):
        super().__init__()
        self.cfg = cfg
        vocab = padded_vocab_size(cfg, tp)
        layer_ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(vocab, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layer_ids})
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.d_model, vocab, bias=False) if last else None
        self.tie_weights()
        for name, value in self.buffer_values(vocab if last else None).items():
            self.register_buffer(name, value, persistent=False)

    def tie_weights(self) -> None:
        """The head shares the embedding's parameter (again after `to_empty`, which allocates them apart)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def buffer_values(self, vocab: int | None) -> dict[str, torch.Tensor]:
        """The RoPE tables and, on the last stage, the vocabulary mask: padded entries get -inf logits, so
        they never take part in the softmax."""
        cfg = self.cfg
        cos, sin = rotary_tables(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        values = {"rope_cos": cos, "rope_sin": sin}
        if vocab is not None:
            values["vocab_mask"] = torch.full((vocab,), float("-inf"))
            values["vocab_mask"][: cfg.vocab_size] = 0.0
        return values

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or a previous stage's hidden states) -> hidden states, or padded logits on the last
        stage; with `targets`, the mean next-token loss."""
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        if self.output is None:
            return x
        logits = self.output(self.norm(x)) + self.vocab_mask
        return logits if targets is None else cross_entropy(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in fp32; works on vocab-sharded DTensor logits inside `loss_parallel()`."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _set_full(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size value into `t`, or, when `t` is a tensor-parallel DTensor, this rank's shard of it
    (every rank computes the same full value, so nothing is sent where torch lets us say so)."""
    if isinstance(t, DTensor):
        accepts_source = "src_data_rank" in inspect.signature(distribute_tensor).parameters
        local_only = {"src_data_rank": None} if accepts_source else {}
        full = distribute_tensor(full.to(t.device), t.device_mesh, t.placements, **local_only)
    t.copy_(full)


def init_weights(model: GPT, seed: int) -> None:
    """Deterministic init of every parameter and buffer, in place: a model built on the meta device and
    materialized with `to_empty` (then possibly tensor-parallel) gets exactly the single-process values.
    Each parameter draws from its own generator, seeded by `seed` and its name, so a pipeline stage or a
    differently padded vocabulary gets the values of the full model. N(0, std) for matrices,
    std / sqrt(2 * n_layers) for the residual projections (GPT-2 / Megatron), ones for norms, zeros for
    the vocabulary padding rows. One full parameter at a time is generated, on the host."""
    cfg = model.cfg
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    model.tie_weights()
    with torch.no_grad():
        vocab = model.vocab_mask.shape[0] if model.output is not None else None
        for name, value in model.buffer_values(vocab).items():
            _set_full(getattr(model, name), value)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # mt19937: 32-bit seeds
            std = residual_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else cfg.init_std
            if name in ("tok_embeddings.weight", "output.weight"):
                full = torch.zeros(param.shape)
                torch.randn((cfg.vocab_size, *param.shape[1:]), generator=gen, out=full[: cfg.vocab_size])
            else:
                full = torch.randn(param.shape, generator=gen)
            _set_full(param, full.mul_(std))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token, 6N + 12 * L * d * s (Megatron / nanoGPT / PaLM): N counts every weight
    that takes part in a matmul (the input embedding is a lookup, so it counts only when tied to the head)."""
    d, layers, vocab = cfg.d_model, cfg.n_layers, padded_vocab_size(cfg)
    head_dim = d // cfg.n_heads
    kv = (cfg.n_kv_heads or cfg.n_heads) * head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * cfg.ffn_size()
    matmul_params = layers * per_layer + vocab * d
    return 6 * matmul_params + 12 * layers * d * cfg.seq_len
