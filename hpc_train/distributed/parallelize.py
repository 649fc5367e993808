"""This rank's part of the model on the mesh, and how to run forward/backward on it.

`parallelize` builds the local pipeline stage(s) of a model family on the meta device, shards them over
tp, allocates and initializes only the local shards, and builds the pipeline schedule;
`forward_backward` / `forward_only` run one rank-local batch (a list of micro-batches) through it, with
the same result as the single-process model on the same global batch.

Tied embeddings across pipeline stages (Megatron's design): the last stage holds its own copy of the
first stage's embedding as its head, initialized identically; before the gradients are reduced over dp,
the two copies' gradients are summed over the pair (first, last) of each pipeline, so both take the
same optimizer step and stay equal. Gradient norms count only the first stage's copy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from hpc_train.config import ModelConfig
from hpc_train.config.schema import V_SHAPED
from hpc_train.data.batch import Batch
from hpc_train.distributed.grads import all_reduce_on, fix_grad_placements
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.mesh import Mesh
from hpc_train.distributed.pipeline import build_schedule, stage_ids
from hpc_train.distributed.transforms import StagePlan
from hpc_train.models.spec import ModelSpec, StageModule, is_frozen
from hpc_train.placement import gathered, local

MicroBatches = list[Batch]


@dataclass
class ParallelModel:
    model_cfg: ModelConfig
    spec: ModelSpec
    chunks: list[StageModule]  # this rank's pipeline stages (one without pipeline parallelism)
    mesh: Mesh
    device: torch.device  # where the compute and the collectives run (FSDP2's offloaded shards are on the host)
    grad_accum: int = 1  # micro-batches per step: each one's loss is its share of the batch's
    autocast_dtype: torch.dtype | None = None  # compute dtype under autocast; None = no autocast
    schedule: Any | None = None  # the pipeline schedule when pp > 1
    loss_scale: float | torch.Tensor = 1.0  # fp16 dynamic loss scale (a device tensor), applied before backward
    tied_copy: nn.Parameter | None = None  # an embedding tied across pipeline stages, as held here
    tied_group: dist.ProcessGroup | None = None  # the (first, last) stage pair that shares it
    quantized: set[str] = field(default_factory=set)  # QLoRA's NF4 weights: rebuilt from their source, not saved
    masked_loss: bool = False  # the data has a loss mask: the loss is a mean over the global batch's counted targets
    loss_tokens: torch.Tensor | None = None  # with a mask, this step's counted targets per micro-batch (Decoder.loss)
    schedule_mode: str | None = None  # the pipeline schedule's last call, step or eval (a switch re-infers shapes)
    stages: list[int] = field(default_factory=lambda: [0])  # the pipeline stages this rank holds, one per chunk
    num_stages: int = 1
    hooks: list[StepHooks] = field(default_factory=list)  # the features' parts in every step (the builder's)

    def scaled_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's share of the batch loss (from the last stage's final-norm output), times
        the fp16 loss scale: its gradients are final as backward leaves them (what lets a dp reduction start
        from inside backward)."""
        loss = self.chunks[-1].loss(hidden, targets, self.loss_tokens)
        return loss * (self.loss_scale / self.grad_accum)

    @property
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter this rank holds, frozen or not, under its whole-model name (`layers.<i>....`;
        a tied head copy under the embedding's name): the same names whatever the layout."""
        named: dict[int, tuple[str, nn.Parameter]] = {}  # a parameter two stages share (a V's tied head) once
        for chunk in self.chunks:
            for n, p in chunk.named_parameters():
                named.setdefault(id(p), (chunk.canonical_name(n), p))
        return list(named.values())

    def parameter_names(self) -> dict[int, str]:
        """Each parameter's whole-model name, by the parameter's id."""
        return {id(p): name for name, p in self.named_parameters}

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters]

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters if p.requires_grad]

    @property
    def persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Buffers that belong in a checkpoint (the RoPE tables and the vocabulary mask are recomputed)."""
        out = []
        for chunk in self.chunks:
            params = {n for n, _ in chunk.named_parameters(remove_duplicate=False)}
            out += [(n, t) for n, t in chunk.state_dict(keep_vars=True).items() if n not in params]
        return out

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank computes the loss (the first pipeline rank too under a V-shaped schedule)."""
        return self.num_stages - 1 in self.stages

    def backward_passes(self, p: nn.Parameter) -> int:
        """How many of this rank's stages use `p`: the backward passes that each give part of its gradient of
        a micro-batch (two for a V's tied embedding, whose stages run their backwards apart)."""
        return sum(any(q is p for q in chunk.parameters()) for chunk in self.chunks)

    def counted_in_norm(self, p: nn.Parameter) -> bool:
        """False for the last stage's copy of a tied embedding: its gradient is the first stage's."""
        return p is not self.tied_copy or self.holds_first_stage

    def holds_tied_copy(self, params: list[nn.Parameter]) -> bool:
        """Whether finalizing `params` talks to another pipeline stage (so never from inside backward)."""
        return self.tied_group is not None and any(p is self.tied_copy for p in params)

    def finalize_grads(self, params: list[nn.Parameter]) -> None:
        """Before `params`' gradients are reduced over dp: each in its parameter's tp placement, and a
        tied embedding's summed over the pipeline stages that hold it."""
        fix_grad_placements(params)
        if self.holds_tied_copy(params) and self.tied_copy.grad is not None:
            all_reduce_on(self.device, local(self.tied_copy.grad), group=self.tied_group)

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def freeze(model: ParallelModel, patterns: tuple[str, ...] | list[str]) -> None:
    """train.freeze's patterns: those parameters are held fixed."""
    for name, p in model.named_parameters:
        if is_frozen(name, patterns):
            p.requires_grad_(False)


def _tied_pipeline_copy(
    chunks: list[StageModule], mesh: Mesh, v_shaped: bool
) -> tuple[nn.Parameter | None, dist.ProcessGroup | None]:
    """With tied embeddings and pp > 1: every rank creates the (first, last) stage pair groups; the
    first and last stages get theirs and the embedding (or head copy) they hold. Under a V-shaped schedule
    the first rank holds both ends: its head uses the embedding's parameter itself, as one process does."""
    if mesh.size("pp") == 1 or not chunks[0].tied:
        return None, None
    if v_shaped:
        if mesh.is_first_stage:
            chunks[-1].output.weight = chunks[0].tok_embeddings.weight
        return None, None
    pairs = [[line[0], line[-1]] for line in mesh.ranks_along("pp")]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    if mesh.is_first_stage:
        return chunks[0].tok_embeddings.weight, group
    if mesh.is_last_stage:
        return chunks[-1].output.weight, group
    return None, None


def materialize(chunk: StageModule, device: torch.device, params_on_host: bool) -> None:
    """Allocate a stage built on the meta device on `device`. With `params_on_host` (FSDP2's CPU offload)
    the parameters are allocated in host memory and only the buffers on `device`: a DTensor keeps reporting
    the device it was made on (FSDP2 moving its local shard to the host changes nothing), FSDP2's first
    forward refuses offloaded parameters that report a GPU, and torch's fused AdamW groups the parameters,
    their state and its skip flag by that device."""
    if not params_on_host:
        chunk.to_empty(device=device)
        return
    chunk.to_empty(device=torch.device("cpu"))
    for module in chunk.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))  # still a buffer, persistent or not, as before


def parallelize(plan: StagePlan) -> ParallelModel:
    """Build this rank's stages on the meta device, apply the plan's transforms in order (tp, recompute,
    adapters, compile, FSDP...: the registered features', bound to their config sections by the builder),
    then allocate only the local shards on the plan's device and initialize them (identically to the
    single-process model; then the features' initializers): no rank ever holds more than its own part of
    the model, plus one full parameter at a time during init."""
    spec, mesh, device, p = plan.spec, plan.mesh, plan.device, plan.parallel
    pp, tp = mesh.size("pp"), mesh.size("tp")
    num_stages = pp * p.virtual_stages
    stages = stage_ids(mesh.rank("pp"), pp, p.virtual_stages, p.schedule)
    chunks = []
    for stage in stages:
        with torch.device("meta"):
            chunk = spec.build_stage(plan.model, stage, num_stages, tp)
        for transform in plan.transforms:
            transform(chunk, plan)
        materialize(chunk, device, plan.params_on_host)
        spec.init_weights(chunk, plan.train.seed)
        for initialize in plan.initializers:
            initialize(chunk)
        chunks.append(chunk)
    tied_copy, tied_group = _tied_pipeline_copy(chunks, mesh, p.schedule in V_SHAPED)
    model = ParallelModel(plan.model, spec, chunks, mesh, device, plan.train.grad_accum, plan.compute_dtype,
                          tied_copy=tied_copy, tied_group=tied_group, stages=stages, num_stages=num_stages)  # fmt: skip
    freeze(model, plan.train.freeze)
    if pp > 1:
        if model.holds_last_stage:  # the schedule's loss function runs the head, a chunk at a time
            chunks[-1].emits_hidden = True
        model.schedule = build_schedule(chunks, stages, p, plan.train.grad_accum, mesh.sub("pp"), device,
                                        model.scaled_loss)  # fmt: skip
    return model


def step_context(model: ParallelModel, device: torch.device) -> contextlib.ExitStack:
    """Autocast for the configured precision, and loss_parallel when the logits are vocab-sharded."""
    stack = contextlib.ExitStack()
    if model.autocast_dtype is not None:
        stack.enter_context(torch.autocast(device.type, dtype=model.autocast_dtype))
    if model.mesh.size("tp") > 1:
        stack.enter_context(loss_parallel())
    return stack


def _run(model: ParallelModel, micro_batches: MicroBatches, backward: bool) -> list[torch.Tensor]:
    """Each micro-batch's (unscaled) loss, as its share of the mean over this rank's micro-batches (none on
    pipeline stages without the loss)."""
    device = micro_batches[0].tokens.device
    parts: list[torch.Tensor] = []
    if model.masked_loss:
        model.loss_tokens = counted_targets(model, micro_batches)
    mode = "step" if backward else "eval"
    infers_shapes = model.schedule is not None and backward and model.schedule_mode != mode
    for hook in model.hooks:
        hook.before_forward(len(micro_batches), model.loss_scale, infers_shapes)
    with step_context(model, device):
        if model.schedule is None:
            for batch in micro_batches:
                loss = model.chunks[0](batch.tokens, batch.labels, model.loss_tokens, positions=batch.positions,
                                       documents=batch.documents) / len(micro_batches)  # fmt: skip
                if backward:
                    (loss * model.loss_scale).backward()
                parts.append(local(loss.detach()))
            return parts
        tokens = torch.cat([b.tokens for b in micro_batches])
        targets = torch.cat([b.labels for b in micro_batches])
        inputs = (tokens,) if model.holds_first_stage else ()
        target = targets if model.holds_last_stage else None
        # packed documents reach every stage as keyword inputs, cut into the same micro-batches as the tokens
        documents = {name: torch.cat([getattr(b, name) for b in micro_batches])
                     for name in ("positions", "documents") if getattr(micro_batches[0], name) is not None}  # fmt: skip
        losses: list[torch.Tensor] = []
        model.schedule_mode = mode  # a switch makes torch infer the stages' shapes again: one more forward
        run = model.schedule.step if backward else model.schedule.eval
        run(*inputs, target=target, losses=losses, **documents)
    return [local(loss.detach()) / model.loss_scale for loss in losses]


def counted_targets(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    """The global batch's targets the loss mask counts, per micro-batch and rank of dp x cp (one all-reduce
    over dp x cp; left on the device)."""
    count = sum(b.loss_mask.sum() for b in micro_batches).float()
    if model.mesh.size("dp_cp") > 1:
        dist.all_reduce(count, group=model.mesh.group("dp_cp"))
    return count.clamp(min=1.0) / (len(micro_batches) * model.mesh.size("dp_cp"))


def forward_backward(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    return sum(_run(model, micro_batches, backward=True), torch.zeros((), device=model.device))


@torch.no_grad()
def forward_only(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    return sum(_evaluated(model, micro_batches), torch.zeros((), device=model.device))


def _evaluated(model: ParallelModel, micro_batches: MicroBatches) -> list[torch.Tensor]:
    """`_run` forward only, then the hooks' end of an evaluation."""
    parts = _run(model, micro_batches, backward=False)
    for hook in model.hooks:
        hook.after_eval()
    return parts


@torch.no_grad()
def row_scores(model: ParallelModel, micro_batches: MicroBatches) -> torch.Tensor:
    """(rows, 2) float64 over this rank's micro-batches, the same on every rank of its model replica (pp, cp,
    tp): each row's next-token loss summed over its counted targets, and how many of them are not the
    greedy token (the decoder's `row_scores`: downstream tasks' log-likelihoods, through every layout's own
    forward). Summed over cp (each rank scores its positions), taken from the last pipeline stage."""
    last = model.chunks[-1]
    last.scores_rows = True
    try:
        parts = _evaluated(model, micro_batches)
    finally:
        last.scores_rows = False
    rows = sum(b.tokens.shape[0] for b in micro_batches)
    scores = torch.cat(parts) * len(micro_batches) if parts else torch.zeros(rows, 2, dtype=torch.float64,
                                                                             device=model.device)  # fmt: skip
    for role in ("pp", "cp"):
        if model.mesh.size(role) > 1:
            dist.all_reduce(scores, group=model.mesh.group(role))
    return scores


def reduce_loss(model: ParallelModel, loss: torch.Tensor) -> torch.Tensor:
    """The global-batch mean, the same on every rank: taken from the last pipeline stage, averaged over dp
    and cp (each cp rank's is the mean over its equal share of the tokens; left on the device)."""
    for role in ("pp", "dp_cp"):
        if model.mesh.size(role) > 1:
            dist.all_reduce(loss, group=model.mesh.group(role))
    return loss / model.mesh.size("dp_cp")


def unpadded(spec: ModelSpec, name: str, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A vocabulary-padded tensor's real rows, whole (gathered over tp) and compact; any other as it is."""
    if name not in spec.vocab_params:
        return t
    return gathered(t)[:vocab_size].detach().clone()


def pad_rows(rows: torch.Tensor, total: int) -> torch.Tensor:
    """Unpadded vocabulary rows with zero rows appended up to `total` (padding rows are never looked up
    and get -inf logits)."""
    return torch.cat([rows, rows.new_zeros(total - rows.shape[0], *rows.shape[1:])])


def full_state_dict(model: ParallelModel) -> dict[str, torch.Tensor] | None:
    """Consolidated weights on global rank 0 (None elsewhere), in the single-process model's layout
    (vocabulary padded for tp=1; NF4 weights dequantized), whatever the layout they were trained with."""
    m = model.model_cfg
    state = {}
    for chunk in model.chunks:
        for name, value in chunk.state_dict().items():
            value = gathered(value)
            if chunk.canonical_name(name) in model.quantized:  # QLoRA's NF4, dequantized
                value = value.to(torch.float32)
            state[name] = unpadded(model.spec, name, value, m.vocab_size).detach().cpu()
    if model.mesh.rank("dp_cp") != 0 or model.mesh.rank("tp") != 0:
        return None
    if model.mesh.size("pp") > 1:  # the pp group of global rank 0: every stage's (dp=0, tp=0) rank
        parts = [None] * model.mesh.size("pp") if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0, group=model.mesh.group("pp"))
        state = {k: v for part in parts or [] for k, v in part.items()}
    if dist.get_rank() != 0:
        return None
    vocab = model.spec.padded_vocab_size(m, 1)
    for name in model.spec.vocab_params:
        if name in state:  # re-padded for tp=1
            state[name] = pad_rows(state[name], vocab)
    return state
