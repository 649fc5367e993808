"""The skeleton's tensor-parallel plan (Megatron's), as the TP dict `ModelSpec.tp_plan` returns: which
projection is column- or row-parallel, where the residual stream is sequence-sharded."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hpc_train.models.common.decoder import Decoder
from hpc_train.models.common.moe import MoE


def decoder_tp_plan(model: Decoder, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's tensor parallelism for the skeleton: column-parallel q/k/v and MLP inputs, row-parallel
    output projections (one all-reduce per block and direction, or with sequence parallelism one
    all-gather + one reduce-scatter), a vocab-parallel embedding and a column-parallel head whose logits
    stay sharded for `loss_parallel`. Between blocks the residual stream is a plain local tensor: full
    (replicated) without sequence parallelism, this rank's slice of the sequence with it."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        if model.pos_embeddings is None:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        else:  # learned positions are added to the whole sequence, then scattered
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if sequence_parallel:
                plan["sequence_scatter"] = PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(stream,), use_local_output=True
                )
    if model.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    mlp = model.arch.mlp
    for name in model.layers:
        block = {
            "attn": entering(stream, others=2),  # (x, cos, sin)
            "attn.sequence_gather": gathering(stream),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream),
            "mlp": entering(stream),
            "mlp.sequence_gather": gathering(stream),
            **{f"mlp.{layer}": ColwiseParallel() for layer in mlp.column_parallel},
            f"mlp.{mlp.row_parallel}": RowwiseParallel(output_layouts=stream),
        }
        if isinstance(model.layers[name].mlp, MoE):
            block.update(moe_tp_plan(model.layers[name].mlp, mlp, stream))
            del block[f"mlp.{mlp.row_parallel}"], block["mlp.sequence_gather"]
            for layer in mlp.column_parallel:
                del block[f"mlp.{layer}"]
        if sequence_parallel:
            block.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    return plan


def entering(stream: Replicate | Shard, others: int = 0) -> PrepareModuleInput:
    """A module taking the residual stream (and `others` arguments left alone) as it is, as a DTensor: where
    float8's styles cast it, once for the module's projections and before any gather."""
    layouts = (stream, *[None] * others)
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts)


def gathering(stream: Replicate | Shard) -> PrepareModuleInput:
    """Where the column-parallel projections read the stream: whole, all-gathered there under sequence
    parallelism (models/common/regather.py)."""
    return PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))


def moe_tp_plan(moe: MoE, mlp: type, stream: Replicate | Shard) -> dict[str, ParallelStyle]:
    """An MoE feed-forward under tp: its input as a local tensor, the whole sequence without sequence
    parallelism (every tp rank routes and computes all tokens alike), this rank's slice of it with (each
    tp rank routes and computes its own tokens: features/moe/expert_parallel.py replicates the router and
    the experts over tp); the shared experts column- and row-parallel like the dense MLP, their input
    all-gathered and their output reduce-scattered under sequence parallelism."""
    plan: dict[str, ParallelStyle] = {
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(stream,), use_local_output=True)
    }
    if moe.shared is not None:
        plan["mlp.shared"] = entering(stream)
        plan["mlp.shared.sequence_gather"] = gathering(stream)
        plan.update({f"mlp.shared.{layer}": ColwiseParallel() for layer in mlp.column_parallel})
        plan[f"mlp.shared.{mlp.row_parallel}"] = RowwiseParallel(output_layouts=stream)
    return plan
