"""Megatron-style tensor parallelism with DTensor, and sequence parallelism for the norm regions.

Per block: column-parallel q/k/v and MLP gate/up, row-parallel output projections, so that each block
costs one all-reduce (or, with sequence parallelism, one all-gather + one reduce-scatter) forward and
backward. The embedding is vocab-parallel; the output head is column-parallel over the vocabulary and
its logits stay sharded for `loss_parallel` (cross-entropy without gathering the logits).
Attention itself runs on the local head shard with plain SDPA (no DTensor rule for it on CPU).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpc_train.model.gpt import GPT


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> GPT:
    """Shard `model` (a whole model or one pipeline stage) in place over `tp_mesh`."""
    # Between blocks the residual stream is a plain local tensor: full (replicated) without sequence
    # parallelism, this rank's slice of the sequence with it.
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    for name in model.layers:
        block = {
            "attn": PrepareModuleInput(
                input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            block.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    parallelize_module(model, tp_mesh, plan)
    if model.output is not None:  # the -inf padding mask must be sharded like the logits' vocab dimension
        model.vocab_mask = distribute_tensor(model.vocab_mask, tp_mesh, [Shard(0)])
    return model
