"""This rank's part of the model on the (pp, dp, tp) mesh, and how to run forward/backward on it.

`parallelize` builds the local pipeline stage(s), shards them over tp, and builds the pipeline schedule;
`forward_backward` / `forward_only` run one rank-local batch (a list of micro-batches) through it, with
the same result as the single-process model on the same global batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpc_train.config import JobConfig
from hpc_train.distributed.grads import local
from hpc_train.distributed.pipeline import build_schedule, build_stage_model, stage_ids
from hpc_train.distributed.tensor_parallel import apply_tensor_parallel
from hpc_train.model.gpt import GPT, cross_entropy, init_weights, padded_vocab_size

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelModel:
    cfg: JobConfig
    chunks: list[GPT]  # this rank's pipeline stages (one without pipeline parallelism)
    mesh: DeviceMesh
    schedule: Any | None = None  # the pipeline schedule when pp > 1
    loss_scale: float = 1.0  # fp16 dynamic loss scale, applied to the loss before backward

    def scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's share of the batch loss, times the fp16 loss scale: its gradients are
        final as backward leaves them (what lets a dp reduction start from inside backward)."""
        return cross_entropy(logits, targets) * (self.loss_scale / self.cfg.train.grad_accum)

    @property
    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Global names (`layers.<i>....`), the same whatever the layout."""
        return [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters() if p.requires_grad]

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh[dim].get_group()

    def rank(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    @property
    def is_first_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank("pp") == self.cfg.parallel.pp - 1

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def parallelize(cfg: JobConfig, mesh: DeviceMesh, device: torch.device) -> ParallelModel:
    """Build this rank's stages on the meta device, shard them over tp, then allocate only the local shards
    on `device` and initialize them (identically to the single-process model): no rank ever holds more
    than its own part of the model, plus one full parameter at a time during init."""
    pp, tp = cfg.parallel.pp, cfg.parallel.tp
    num_stages = pp * cfg.parallel.virtual_stages
    stages = stage_ids(mesh["pp"].get_local_rank(), pp, cfg.parallel.virtual_stages)
    chunks = []
    for stage in stages:
        with torch.device("meta"):
            chunk = build_stage_model(cfg, stage, num_stages, tp)
        if tp > 1:
            apply_tensor_parallel(chunk, mesh["tp"], cfg.parallel.sequence_parallel)
        chunk.to_empty(device=device)
        init_weights(chunk, cfg.train.seed)
        chunks.append(chunk)
    model = ParallelModel(cfg, chunks, mesh)
    if pp > 1:
        model.schedule = build_schedule(chunks, stages, cfg, mesh["pp"], device, model.scaled_loss)
    return model


def weights_in_training_dtype(cfg: JobConfig) -> bool:
    """bf16/fp16 weights when ZeRO-1 holds the fp32 master copy; otherwise fp32 weights under autocast."""
    return cfg.optim.zero_stage == 1 and cfg.train.precision != "fp32"


def cast_parameters(model: ParallelModel) -> None:
    """Keep the model's parameters in the training dtype where `weights_in_training_dtype` says so. The
    Parameter objects stay the same (the optimizer holds them); buffers (RoPE tables, the vocab mask)
    stay fp32. `param.data = ...` would leave a DTensor's local shard in fp32, so swap whole tensors."""
    if weights_in_training_dtype(model.cfg):
        dtype = AUTOCAST_DTYPES[model.cfg.train.precision]
        for param in model.parameters:
            cast = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, cast)


def step_context(model: ParallelModel, device: torch.device) -> contextlib.ExitStack:
    """Autocast for the configured precision, and loss_parallel when the logits are vocab-sharded."""
    stack = contextlib.ExitStack()
    dtype = AUTOCAST_DTYPES[model.cfg.train.precision]
    if dtype is not None:
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
    if model.cfg.parallel.tp > 1:
        stack.enter_context(loss_parallel())
    return stack


def _run(model: ParallelModel, micro_batches: MicroBatches, backward: bool) -> torch.Tensor:
    """Mean (unscaled) loss over this rank's micro-batches (zero on pipeline stages without the loss)."""
    device = micro_batches[0][0].device
    total = torch.zeros((), device=device)
    with step_context(model, device):
        if model.schedule is None:
            for tokens, targets in micro_batches:
                loss = model.chunks[0](tokens, targets) / len(micro_batches)
                if backward:
                    (loss * model.loss_scale).backward()
                total += local(loss.detach())
            return total
        tokens = torch.cat([t for t, _ in micro_batches])
        targets = torch.cat([t for _, t in micro_batches])
        inputs = (tokens,) if model.is_first_stage else ()
        target = targets if model.is_last_stage else None
        losses: list[torch.Tensor] = []
        run = model.schedule.step if backward else model.schedule.eval
        run(*inputs, target=target, losses=losses)
        for loss in losses:
            total += local(loss.detach()) / model.loss_scale
    return total


def forward_backward(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    return _run(model, micro_batches, backward=True)


@torch.no_grad()
def forward_only(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    return _run(model, micro_batches, backward=False)


def reduce_loss(model: ParallelModel, loss: torch.Tensor) -> float:
    """The global-batch mean: taken from the last pipeline stage, averaged over dp."""
    for dim in ("pp", "dp"):
        if model.mesh[dim].size() > 1:
            dist.all_reduce(loss, group=model.group(dim))
    return loss.item() / model.mesh["dp"].size()


def full_state_dict(model: ParallelModel) -> dict[str, torch.Tensor] | None:
    """Consolidated weights on global rank 0 (None elsewhere), in the single-process model's layout
    (vocabulary padded for tp=1), whatever the layout they were trained with."""
    state = {}
    for chunk in model.chunks:
        for name, value in chunk.state_dict().items():
            state[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
    if model.rank("dp") != 0 or model.rank("tp") != 0:
        return None
    if model.mesh["pp"].size() > 1:  # the pp group of global rank 0: every stage's (dp=0, tp=0) rank
        parts = [None] * model.mesh["pp"].size() if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0, group=model.group("pp"))
        state = {k: v for part in parts or [] for k, v in part.items()}
    if dist.get_rank() != 0:
        return None
    vocab = padded_vocab_size(model.cfg.model, tp=1)
    for name in ("tok_embeddings.weight", "output.weight"):
        if name in state:  # padding rows are zero (never looked up, -inf logits): re-pad for tp=1
            rows = state[name][: model.cfg.model.vocab_size]
            state[name] = torch.cat([rows, rows.new_zeros(vocab - rows.shape[0], rows.shape[1])])
    return state
