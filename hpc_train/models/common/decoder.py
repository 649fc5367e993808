"""The decoder skeleton both model families share: token embedding (plus learned positions or RoPE),
pre-norm blocks of causal SDPA attention and an MLP, final norm, output head over a padded vocabulary.

A family is an `Architecture`: which norm, which MLP, biases or not, rotary or learned positions, tied
embeddings by default. Attention reshapes by head dimension, not by head count, so the same code runs on
the local head shard of a tensor-parallel rank. The embedding and head are padded to `padded_vocab_size`
rows (Megatron's vocabulary padding); the padded entries get -inf logits, so they never enter the loss.
Its tensor-parallel plan is tp_plan.py's, its FLOP and activation formulas costs.py's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.data.batch import IGNORE, SequenceShard
from hpc_train.models.common.document_attention import flex_document_attention, tiled_document_attention
from hpc_train.models.common.moe import MoE, is_moe_layer
from hpc_train.models.common.regather import gathered_projections
from hpc_train.models.spec import param_generator
from hpc_train.placement import distribute_like

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"
VOCAB_PARAMS = (EMBEDDING, HEAD)  # rows padded to the vocabulary multiple; checkpoints store them unpadded


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one decoder family from another inside the shared skeleton."""

    norm: Callable[[int, float], nn.Module]  # (width, eps) -> a norm module
    mlp: type[nn.Module]  # built as mlp(d_model, hidden, bias); names its column- and row-parallel
    # layers and how many T x hidden tensors it keeps for backward (saved_widths; recomputed_when_compiled
    # of them are not kept when compiled)
    ffn_size: Callable[[ModelConfig], int]  # the MLP's hidden width
    linear_bias: bool  # biases in the attention and MLP projections
    rotary: bool  # RoPE; otherwise learned position embeddings
    tie_embeddings: bool  # the family's default when model.tie_embeddings is not set
    residual_projections: tuple[str, ...]  # initialized with init_std / sqrt(2 * n_layers)
    # (tokens, width, element bytes, weight trainable, compiled): one norm's saved tensors
    norm_saved_bytes: Callable[[int, int, int, bool, bool], int]
    moe: bool = False  # model.moe can replace the MLP of blocks (models/common/moe.py; experts are SwiGLU)


def padded_vocab_size(cfg: ModelConfig, tp: int = 1) -> int:
    multiple = cfg.vocab_multiple * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def ties_embeddings(cfg: ModelConfig, arch: Architecture) -> bool:
    return arch.tie_embeddings if cfg.tie_embeddings is None else cfg.tie_embeddings


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


def repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each kv head repeated for the `heads` q heads of its group."""
    if k.shape[1] == heads:
        return k, v
    repeat = heads // k.shape[1]
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal SDPA over (batch, heads, seq, head_dim); grouped-query k, v shared by their q heads. With
    packed `documents` (each token's document, (batch, seq)) attention also stays inside a document, without
    an S x S mask (document_attention.py: FlexAttention on CUDA, query tiles on CPU)."""
    if documents is not None and q.device.type == "cuda":
        return flex_document_attention(q, k, v, documents)
    k, v = repeat_kv(k, v, q.shape[1])
    if documents is not None:
        return tiled_document_attention(q, k, v, documents)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# (q, k, v, documents) -> attention output; `documents`: the whole sample's document of each token, or None
AttentionCore = Callable[..., torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture):
        super().__init__()
        self.recompute_core = False  # selective recompute: keep only q, k, v for the attention core
        # context parallelism (features/context_parallel): the core that exchanges keys and values between cp ranks
        self.core: AttentionCore = causal_attention
        self.rotary = arch.rotary
        self.head_dim = cfg.d_model // cfg.n_heads
        kv_heads = cfg.n_kv_heads or cfg.n_heads
        bias = arch.linear_bias
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.d_model, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.d_model, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=bias)
        # where the input enters wq, wk and wv: tensor parallelism's all-gather of a sequence-sharded input
        self.sequence_gather = nn.Identity()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`cos`, `sin`: the RoPE tables (or each row's, (batch, 1, seq, head_dim)), or None with learned
        positions. `documents`: each token's document, (batch, seq) of the whole sample (under context
        parallelism too: the core masks the keys it gets from other ranks); None: causal over the sample."""
        q, k, v = gathered_projections(self, x, ("wq", "wk", "wv"))
        batch, seq, _ = q.shape  # (the whole sequence: `x` may be this rank's slice of it)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            if cos.dim() == 2:  # one table for every row
                cos, sin = cos[:seq], sin[:seq]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        core = self.core if documents is None else functools.partial(self.core, documents=documents)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture, layer_id: int = 0):
        super().__init__()
        self.recompute_all = False  # full recompute: keep only the block's input
        self.attn_norm = arch.norm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, arch)
        self.mlp_norm = arch.norm(cfg.d_model, cfg.norm_eps)
        if arch.moe and is_moe_layer(cfg, layer_id):
            self.mlp = MoE(cfg, arch.mlp, arch.ffn_size(cfg))
        else:
            self.mlp = arch.mlp(cfg.d_model, arch.ffn_size(cfg), arch.linear_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.recompute_all and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, documents, use_reentrant=False)
        return self._forward(x, cos, sin, documents)

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        # a keyword: the TP plan prepares (x, cos, sin)
        x = x + self.attn(self.attn_norm(x), cos, sin, documents=documents)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """The whole model, or one pipeline stage of it: `layer_ids` picks the blocks (their names stay global,
    `layers.<i>`), `first` adds the embeddings, `last` the final norm and output head. `tp` only sets the
    vocabulary padding; the tensor-parallel sharding itself is applied by
    features/tensor_parallel.
    With tied embeddings the head shares the embedding's parameter; a last pipeline stage without the
    embedding holds its own copy of it (kept equal by `distributed.parallelize`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        arch: Architecture,
        tp: int = 1,
        layer_ids: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__()
        self.cfg, self.arch = cfg, arch
        self.tied = ties_embeddings(cfg, arch)
        vocab = padded_vocab_size(cfg, tp)
        layer_ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(vocab, cfg.d_model) if first else None
        # learned positions: the model's whole context, of which a run trains the first seq_len
        self.pos_embeddings = nn.Embedding(cfg.context_len, cfg.d_model) if first and not arch.rotary else None
        # where the embedding sum enters the sequence-parallel region: the TP plan makes it a scatter
        self.sequence_scatter = nn.Identity() if self.pos_embeddings is not None else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, arch, i) for i in layer_ids})
        self.norm = arch.norm(cfg.d_model, cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.d_model, vocab, bias=False) if last else None
        self.emits_hidden = False  # a pipeline's last stage: forward ends at the final norm, the loss takes over
        self.scores_rows = False  # the loss gives each row's scores instead (`row_scores`: downstream evaluation)
        self.compiled = False  # compile_regions was applied
        self.shard: SequenceShard | None = None  # context parallelism: the positions of this rank's tokens
        self.tie_weights()
        for name, value in self.buffer_values(vocab if last else None).items():
            self.register_buffer(name, value, persistent=False)

    def canonical_name(self, name: str) -> str:
        """The name a parameter has in the whole model: a tied head copy is the embedding."""
        return EMBEDDING if self.tied and name == HEAD else name

    def tie_weights(self) -> None:
        """The head shares the embedding's parameter (again after `to_empty`, which allocates them apart)."""
        if self.tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def buffer_values(self, vocab: int | None) -> dict[str, torch.Tensor]:
        """The RoPE tables and, on the last stage, the vocabulary mask: padded entries get -inf logits, so
        they never take part in the softmax."""
        cfg, values = self.cfg, {}
        if self.arch.rotary:
            head_dim = cfg.d_model // cfg.n_heads
            values["rope_cos"], values["rope_sin"] = rotary_tables(head_dim, cfg.seq_len, cfg.rope_theta)
        if vocab is not None:
            values["vocab_mask"] = torch.full((vocab,), float("-inf"))
            values["vocab_mask"][: cfg.vocab_size] = 0.0
        return values

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_tokens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (or a previous stage's hidden states) -> hidden states, or padded logits on the last
        stage (its final hidden states with `emits_hidden`); with `targets`, the next-token loss (`loss`).
        Packed documents (data/batch.py Batch): `positions`, each token's position (default: its index);
        `documents`, each token's document: attention stays inside it (default: causal over the sample)."""
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if (learned := self.pos_embeddings) is not None:
                if positions is not None:
                    x = self.sequence_scatter(x + learned(positions))
                else:
                    at = slice(None, x.shape[1]) if self.shard is None else self.shard.positions(x.shape[1], x.device)
                    x = self.sequence_scatter(x + learned.weight[at])
            if torch.is_autocast_enabled(x.device.type):  # the residual stream in the compute dtype (fp32 weights)
                x = x.to(torch.get_autocast_dtype(x.device.type))
        cos, sin = (self.rope_cos, self.rope_sin) if self.arch.rotary else (None, None)
        if cos is not None and positions is not None:  # each row's tables, broadcast over the heads
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        elif cos is not None and self.shard is not None:  # this cp rank's rows, once for every block
            at = self.shard.positions(self.cfg.seq_len // self.shard.size, cos.device)
            cos, sin = cos[at], sin[at]
        if self.compiled and isinstance(x, AsyncCollectiveTensor):
            x = x.clone()  # wait for the embedding's tp collective: compiled regions mishandle its async wrapper
        for layer in self.layers.values():
            x = layer(x, cos, sin, documents)
        if self.output is None:
            return x
        hidden = self.norm(x)
        if targets is not None:
            return self.loss(hidden, targets, loss_tokens)
        return hidden if self.emits_hidden else self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden) + self.vocab_mask

    def summed_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The head and the next-token loss summed over `targets` (IGNORE ones add nothing), in fp32; works
        on vocab-sharded DTensor logits inside `loss_parallel()`."""
        logits = self.logits(hidden).flatten(0, 1).float()
        return F.cross_entropy(logits, targets.flatten(), reduction="sum")

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, loss_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean next-token loss of the final norm's output `hidden`, computed `model.loss_chunk_tokens` at
        a time (`loss_chunk_rows`): each chunk's logits are freed after its loss and recomputed in backward.
        Without a loss mask the mean is over every target; with one (targets IGNORE where the loss does not
        count) it is the sum over `loss_tokens`, the mean count of counted targets per micro-batch of the
        global batch: every counted target weighs the same however the batch is split (and a micro-batch
        with none adds zero, not NaN)."""
        if self.scores_rows:
            return self.row_scores(hidden, targets)
        count = targets.numel() if loss_tokens is None else loss_tokens
        if not isinstance(hidden, DTensor):  # (a DTensor is sequence-sharded: cut between whole sequences)
            hidden, targets = hidden.reshape(-1, 1, hidden.shape[-1]), targets.reshape(-1, 1)
        rows = loss_chunk_rows(self.cfg.loss_chunk_tokens, targets.shape)
        parts = zip(hidden.split(rows), targets.split(rows), strict=True)
        if rows >= targets.shape[0] or not torch.is_grad_enabled():  # one chunk, or evaluation: no recompute
            return sum(self.summed_loss(h, t) for h, t in parts) / count
        recomputed = lambda h, t: checkpoint(self.summed_loss, h, t, use_reentrant=False, preserve_rng_state=False)
        return sum(recomputed(h, t) for h, t in parts) / count

    def row_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(rows, 2) float64: each row's next-token loss summed over its counted targets, and how many of those
        are not the most likely token (0: the continuation is the greedy one), `model.loss_chunk_tokens` at a
        time; under context parallelism, this rank's positions' part. Vocab-sharded logits stay sharded: the
        maximum, the sum of exponentials and the target's logit are reduced over tp."""
        rows = loss_chunk_rows(self.cfg.loss_chunk_tokens, tuple(targets.shape))
        chunks = zip(hidden.split(rows), targets.split(rows), strict=True)
        return torch.cat([self._chunk_row_scores(h, t) for h, t in chunks])

    def _chunk_row_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, group, first = self.logits(hidden), None, 0
        if isinstance(logits, DTensor):
            if isinstance(placed := logits.placements[0], Shard) and placed.dim in (-1, logits.ndim - 1):
                group = logits.device_mesh.get_group()
                logits = logits.to_local()
                first = logits.shape[-1] * dist.get_rank(group)  # this rank's first vocabulary row
            else:
                logits = logits.full_tensor()
        logits = logits.float()
        top = logits.amax(-1)
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = (logits - top.unsqueeze(-1)).exp().sum(-1)
        index = targets - first
        here = (index >= 0) & (index < logits.shape[-1])
        picked = logits.gather(-1, index.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(here, picked, torch.zeros_like(picked))  # a row held by another tp rank (or -inf)
        if group is not None:
            dist.all_reduce(total, group=group)
            dist.all_reduce(picked, group=group)
        counted = targets != IGNORE
        losses = torch.where(counted, top + total.log() - picked, torch.zeros_like(picked))
        missed = counted & (picked < top)
        return torch.stack([losses.double().sum(-1), missed.double().sum(-1)], dim=-1)

    def compile_regions(self) -> None:
        """torch.compile each block and the chunk loss in place (torchtitan's regional compile): names,
        parameters, hooks and the tensor-parallel plan stay as they are, and the blocks share one graph."""
        self.compiled = True
        for block in self.layers.values():
            block.compile()
        if self.output is not None and not isinstance(self.output.weight, DTensor):  # loss_parallel does not compile
            self.summed_loss = torch.compile(self.summed_loss)


def build_stage(cfg: ModelConfig, stage: int = 0, num_stages: int = 1, tp: int = 1, *, arch: Architecture) -> Decoder:
    """Pipeline stage `stage` of `num_stages` (equal layer counts; embeddings first, head last); stage 0 of 1
    is the whole model. Activation recompute is a feature's transform (features/recompute) setting each
    block's switches (`Block.recompute_all`, `Attention.recompute_core`)."""
    per_stage = cfg.n_layers // num_stages
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    return Decoder(cfg, arch, tp=tp, layer_ids=layers, first=stage == 0, last=stage == num_stages - 1)


def loss_chunk_rows(chunk_tokens: int, targets_shape: tuple[int, ...]) -> int:
    """Rows of (rows, length) targets per loss chunk: `chunk_tokens` worth, at least one row (0: all rows)."""
    rows, length = targets_shape
    return max(1, chunk_tokens // length) if chunk_tokens else rows


def validate_decoder(cfg: ModelConfig, tp: int, *, arch: Architecture) -> None:
    """Shapes the skeleton needs, for a tensor-parallel size `tp`."""
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}")
    if arch.rotary and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(f"head dim d_model/n_heads={cfg.d_model // cfg.n_heads} must be even for rotary embedding")
    if cfg.n_heads % kv_heads:
        raise ConfigError(f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={kv_heads}")
    if cfg.n_heads % tp:
        raise ConfigError(f"model.n_heads={cfg.n_heads} is not divisible by parallel.tp={tp}; pick a tp dividing it")
    if arch.ffn_size(cfg) % tp:
        raise ConfigError(
            f"MLP hidden size {arch.ffn_size(cfg)} is not divisible by parallel.tp={tp}; set model.ffn_hidden"
        )
    if kv_heads % tp:
        raise ConfigError(f"model.n_kv_heads={kv_heads} is not divisible by parallel.tp={tp}; pick a tp dividing it")


def init_weights(model: Decoder, seed: int) -> None:
    """Deterministic init of every parameter and buffer, in place: a model built on the meta device and
    materialized with `to_empty` (then possibly tensor-parallel) gets exactly the single-process values.
    Each parameter draws from its own generator, seeded by `seed` and its whole-model name, so a pipeline
    stage, a tied head copy or a differently padded vocabulary gets the values of the full model.
    N(0, std) for matrices and embeddings, std / sqrt(2 * n_layers) for the residual projections
    (GPT-2 / Megatron), ones and zeros for norms, zeros for biases and the vocabulary padding rows.
    One full parameter at a time is generated, on the host."""
    cfg = model.cfg
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    model.tie_weights()
    with torch.no_grad():
        vocab = model.vocab_mask.shape[0] if model.output is not None else None
        for name, value in model.buffer_values(vocab).items():
            getattr(model, name).copy_(distribute_like(value, getattr(model, name)))
        for name, param in model.named_parameters():
            name = model.canonical_name(name)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith("bias"):
                param.zero_()
                continue
            gen = param_generator(seed, name)
            std = residual_std if name.endswith(model.arch.residual_projections) else cfg.init_std
            if name in VOCAB_PARAMS:
                full = torch.zeros(param.shape)
                torch.randn((cfg.vocab_size, *param.shape[1:]), generator=gen, out=full[: cfg.vocab_size])
            else:
                full = torch.randn(param.shape, generator=gen)
            param.copy_(distribute_like(full.mul_(std), param))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
