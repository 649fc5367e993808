"""What a model family supplies to the rest of hpc_train (torchtitan's TrainSpec is the model): how to
build it (whole or as a pipeline stage), initialize it, shard it over tensor parallelism (a TP plan, or
its own hook), count its FLOPs and its activation memory, which of its tensors are padded to the
vocabulary, and which head is tied to which embedding. Parallelize, optimizers, checkpoints and the
planner read the model through this seam; what they still take from the shared decoder skeleton
(models/common) directly (the recompute selection, the embedding's parameter name) is family-neutral
there."""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from hpc_train.config import ModelConfig
from hpc_train.models.common.hf import HFAdapter


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch on one rank looks like to the activation formulas."""

    tokens: int  # micro-batch tokens on the rank (micro-batch size x sequence length)
    tp: int
    sequence_parallel: bool
    element_bytes: int  # of activations in the training dtype
    lora_targets: tuple[str, ...] = ()  # LoRA's adapted projections (everything else frozen); () = full training
    lora_rank: int = 0
    compiled: bool = False  # train.compile: inductor recomputes some cheap tensors rather than keeping them
    # autocast over fp32 weights (zero_stage 0 in bf16/fp16): `element_bytes` is the autocast dtype's (the
    # residual stream's too), and autocast keeps a cast of each weight for the step
    autocast_casts: bool = False
    # train.fp8: the projections are float8 linears, which keep their input and their weight itself (a view
    # of the parameter) for backward, never a cast of the weight
    float8: bool = False
    first_block_recompute: str = "none"  # the recompute choice of a stage's first block (none, selective, full)
    # data.document_mask: elements of the bias one query tile of an attention builds, alive while it computes
    # (models/common/document_attention.py; nothing seq x seq is kept); 0 for none
    document_tile: int = 0
    # the attention core keeps its output apart from the copy the output projection reads (context
    # parallelism's Ulysses: SDPA's, in head shards)
    core_output_copy: bool = False
    # tensor parallelism's column-parallel projections keep their sequence-parallel input sharded and gather it
    # again in backward (models/common/regather.py); not in compiled blocks, nor under LoRA (costs.py `regathered`)
    regather: bool = False
    # rows of the RoPE tables a stage keeps (0: the whole table, seq_len rows): a cp rank gathers its
    # positions' rows, and with data.reset_position_ids every row of the micro-batch its own
    rope_rows: int = 0


@dataclass(frozen=True)
class StageActivations:
    """Bytes one micro-batch keeps for backward, by part of a pipeline stage."""

    layer: dict[str, int]  # per block, by recompute choice: none, selective, full
    every_stage: int  # held once per stage (e.g. RoPE tables)
    first_stage: int  # the embeddings
    last_stage: int  # final norm, head and loss
    # not kept but alive while the loss's backward runs (one chunk's logits and their gradient): on top of
    # everything kept, since that backward comes first
    loss_backward: int = 0
    # alive while a block's backward runs, beyond what it keeps: the gradients of its output (the residual
    # stream) and of its widest activation (the MLP's hidden)
    block_backward: int = 0
    # ... and, where a block is not recomputed whole, the projections' input gathered again while its backward
    # runs (sequence parallelism: models/common/regather.py)
    regathered_input: int = 0
    # what regathering saves a block: a block recomputed whole (which does not regather) keeps that much more
    # than `layer["none"]` while its backward runs
    regather_saving: int = 0
    # what an MoE block keeps beyond a dense one, unless it is recomputed whole
    moe_block: int = 0
    # held between a split backward's input half and its weight half (interleaved_zb, zbv, dualpipev): the
    # gradients reaching the outputs of a block's projections and norms, and of the last stage's head
    weight_grads_block: int = 0
    weight_grads_last_stage: int = 0
    # autocast's casts of fp32 weights (zero_stage 0 in bf16/fp16): one per weight for the whole step, whatever
    # the micro-batches in flight or the recompute: a block's linear layers (an MoE block's dense and shared
    # ones: `moe_weight_casts` more) and the last stage's head
    weight_casts_block: int = 0
    moe_weight_casts: int = 0
    weight_casts_last_stage: int = 0

    def block(self, choice: str, moe: bool = False) -> int:
        """What one block keeps, by its recompute choice (and whether it is an MoE block)."""
        return self.layer[choice] + self.moe_block * (moe and choice != "full")


class StageModule(Protocol):
    """What `build_stage` returns, besides being an nn.Module whose forward maps token ids (first stage) or
    hidden states to hidden states, or logits on the last stage (the loss too, given targets)."""

    tied: bool  # the head shares the embedding's parameter
    tok_embeddings: nn.Embedding | None  # on the first stage
    output: nn.Linear | None  # the head, on the last stage
    emits_hidden: bool  # the last stage's forward without targets returns its final hidden states, not logits
    scores_rows: bool  # the last stage's loss returns each row's (summed loss, tokens not the greedy one) instead

    def canonical_name(self, name: str) -> str:
        """A parameter's name in the whole model (a last stage's tied head copy is the embedding)."""
        ...

    def tie_weights(self) -> None:
        """Share the embedding's parameter with the head again (after `to_empty` or sharding)."""

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, loss_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last stage's mean loss of its hidden output (with `emits_hidden` set, forward stops there)."""
        ...

    def compile_regions(self) -> None:
        """torch.compile its repeated blocks (and loss) in place."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build_stage: Callable[..., StageModule]  # (cfg, stage=0, num_stages=1, tp=1): whole model for 0 of 1
    init_weights: Callable[[StageModule, int], None]  # (stage built on meta and materialized, seed), in place
    tp_plan: Callable[[StageModule, bool], dict[str, ParallelStyle]]  # (stage, sequence_parallel)
    flops_per_token: Callable[[ModelConfig], int]
    activations: Callable[[ModelConfig, ActivationShape], StageActivations]
    padded_vocab_size: Callable[[ModelConfig, int], int]  # (cfg, tp)
    # the head shares the embedding (model.tie_embeddings, or the family's default)
    ties_embeddings: Callable[[ModelConfig], bool]
    validate: Callable[[ModelConfig, int], None]  # (cfg, tp): raises ConfigError
    vocab_params: tuple[str, ...]  # padded on their vocabulary rows: checkpoints store them unpadded
    # its Hugging Face transformers counterparts, for import-hf / export-hf: at most one for dense configs and
    # one for model.moe's (`experts`); the registry (models/__init__.py) picks among them
    hf: tuple[HFAdapter, ...] = ()
    # (stage, tp_mesh, sequence_parallel): shards a stage over tp in place, for a family whose layers a TP dict
    # cannot describe (e.g. MoE experts); None: `tp_plan` is applied (torchtitan's parallelize_fn)
    parallelize_fn: Callable[[StageModule, DeviceMesh, bool], None] | None = None


def projections(chunk: nn.Module) -> dict[str, nn.Linear]:
    """The blocks' linear projections, by name within the stage (`layers.<i>.attn.wq`): what LoRA adapts,
    QLoRA quantizes and float8 converts. Not an MoE router's gate, whose weight the router reads itself, in
    fp32 (models/common/moe.py): a module put in its place would never run."""
    found = {name: m for name, m in chunk.named_modules() if name.startswith("layers.") and isinstance(m, nn.Linear)}
    return {name: m for name, m in found.items() if not name.endswith(".router.gate")}


def is_frozen(name: str, patterns: list[str]) -> bool:
    """Whether train.freeze holds the parameter of this whole-model name fixed (fnmatch patterns)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def param_generator(seed: int, name: str) -> torch.Generator:
    """The generator a parameter's initial value is drawn from: seeded by the run's seed and its whole-model
    name, so every layout (stage split, tp shard, padding) draws the single-process values."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # mt19937: 32-bit seeds
