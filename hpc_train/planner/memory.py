"""Bytes per rank for a layout before anything runs.

Parameters, gradients and optimizer state are counted exactly: the model family's stages are built on the
meta device, what its tensor-parallel plan shards is divided by tp, the data-parallel strategy says what
it keeps per trainable element and the update rule what state it holds (optim/). Activations use the
family's formula (models/common/costs.py `decoder_activations`, with the family's norm and MLP), derived
from the block's saved-tensor trace, per block and recompute choice, times the micro-batches the pipeline
schedule keeps in flight on a pipeline rank r: pp - r with 1F1B, (v-1)pp + 2(pp-1-r) + 1 chunks with
interleaved 1F1B (torch's warmup; measured 2.00 and 2.50 micro-batches for pp=2, v=2). The total is the
peak over the moments of a step where it can lie (`stage_estimate`), with the buffers each moment holds;
every pipeline rank is estimated and the worst reported (`estimate`): the first holds the most
micro-batches, a middle one two receive buffers per micro-batch, the last the head and the loss. Validated
against exact CPU measurement in tests/test_planner.py: every category within 5%, and the total within
5% of the step's measured peak of live tensor bytes. On CUDA the caching allocator adds fragmentation on
top, which is not modelled (the norms run outside autocast, so CUDA's autocast keeps no fp32 copy of their
input: models/common/norms.py; not yet run on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hpc_train.config import ModelConfig
from hpc_train.config.schema import SPLIT_BACKWARD
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import held_at_peak, in_flight_chunks, stage_ids
from hpc_train.features.feature import Memory
from hpc_train.features.lora.adapters import NF4_BLOCK, nf4_scaler_block
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.features.tensor_parallel.sharding import sharded_parameter_names
from hpc_train.job import JobConfig, block_policy, declared
from hpc_train.models import get_spec
from hpc_train.models.common.document_attention import document_tile
from hpc_train.models.common.moe import is_moe_layer, moe_layers
from hpc_train.models.spec import ActivationShape, StageActivations, is_frozen, projections
from hpc_train.optim import optimizer_class, precision_policy
from hpc_train.optim.buckets import largest_bucket
from hpc_train.optim.nvme import padded, ring_bytes
from hpc_train.optim.rules import UpdateRule, is_hidden_matrix, rule_class

GiB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes on one rank: the rank of pipeline rank `stage` (of `stages`), the one that needs the most."""

    params: int
    grads: int
    optimizer: int
    activations_per_microbatch: int
    microbatches_in_flight: int
    activations: int
    comm_buffers: int
    loss_backward: int  # alive only while the loss's backward runs (on the last pipeline rank: it holds the head)
    block_backward: int  # alive only while a block's backward runs: its fresh gradients, the activations'
    # gradients, QLoRA's dequantization
    host: int  # in host memory, not in the device total: offloaded optimizer state (parameters, gradients)...
    total: int
    host_features: int = 0  # ... and, of `host`, what features keep there (activation offload's activations)
    # in host memory besides `host`: the copy of the parameters and optimizer state that train.spike_guard
    # and node-local checkpoints keep (and, across nodes, the partner's a local save receives)
    host_copy: int = 0
    stage: int = 0  # the pipeline rank these bytes are of
    stages: int = 1  # pp
    disk: int = 0  # on the node's own disk: the optimizer state under optim.offload=nvme
    weight_casts: int = 0  # autocast's casts of fp32 weights, through forward and backward (zero_stage 0, bf16/fp16)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class LocalParams:
    total: int  # parameter elements on the rank (its tp shards)
    trainable: int
    shard_total: int  # of those, the ZeRO-3 (FSDP) dim-0 shard of dp rank 0 (the largest)
    shard_trainable: int
    trainable_matrices: int  # of the trainable elements, those in hidden-layer matrices (Muon's)
    largest_block: int  # elements of the largest FSDP unit besides the root (one transformer block)
    root: int  # elements outside the blocks (embeddings, final norm, head): FSDP's root unit
    quantized: int  # elements held in NF4 (QLoRA's frozen projections); their bytes in quantized_bytes
    quantized_bytes: int
    largest_projection: int  # elements of the largest block projection (QLoRA dequantizes one at a time)
    trainable_sizes: tuple[int, ...]  # elements of each trainable (tp-local) tensor, in order: the buckets
    # under tp the vocab-parallel embedding's gradient arrives full-size and Replicate (a DTensor behaviour)
    # before it is cut to its shard at the reduction (or in backward, by an optimizer that takes gradients
    # there); not when a head tied to it is on the same rank
    # (the head's sharded gradient accumulates into it)
    full_size_embedding_grad: bool
    experts: int = 0  # of the trainable elements, the routed experts' (their 1/ep under expert parallelism)
    # elements FSDP gathers for the stage's last block (its unit, and its experts' own unit under ep unless
    # that spans one rank, edp = 1, where they stay whole and are never gathered): the running block at
    # backward's start
    last_block: int = 0
    trainable_is_matrix: tuple[bool, ...] = ()  # per trainable_sizes entry: a hidden-layer matrix (Muon's)


def local_param_count(cfg: JobConfig, pp_rank: int = 0, dp: int = 1) -> LocalParams:
    """Exact parameter elements held by a rank of pipeline rank `pp_rank` (ZeRO-3 shards over `dp`)."""
    p = cfg.parallel
    f = cfg.finetune
    model = tuple((field.name, getattr(cfg.model, field.name)) for field in dataclasses.fields(ModelConfig))
    return _param_count(model, p.tp, p.pp, p.virtual_stages, p.schedule, pp_rank, tuple(cfg.train.freeze), dp,
                        (f.method, f.lora_rank, tuple(f.lora_targets)), p.ep)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _param_count(
    model: tuple,
    tp: int,
    pp: int,
    virtual_stages: int,
    schedule: str,
    pp_rank: int,
    freeze: tuple,
    dp: int,
    finetune: tuple,
    ep: int = 1,
) -> LocalParams:
    """Counted on the meta device (nothing allocated); cached because --search asks for many layouts.
    `finetune`: (method, LoRA rank, LoRA targets); `ep`: the routed experts are split over it."""
    model_cfg = ModelConfig(**dict(model))
    method, rank, targets = finetune
    ft = FinetuneConfig(method, rank, lora_targets=list(targets))
    spec = get_spec(model_cfg.arch)
    total = trainable = shard_total = shard_trainable = quantized = quantized_bytes = largest_projection = 0
    matrices = experts = 0
    full_grad = False
    sizes, is_matrix = [], []
    units: dict[str, int] = {}  # FSDP unit ("" for the root) -> elements
    gathered: dict[str, int] = {}  # block -> the elements FSDP gathers for it
    counted: set[str] = set()  # whole-model names counted
    for stage in stage_ids(pp_rank, pp, virtual_stages, schedule):
        chunk = _meta_stage(model, stage, pp * virtual_stages, tp)
        plan = spec.tp_plan(chunk, False) if tp > 1 else {}
        sharded = sharded_parameter_names(chunk, plan)
        elements = {name: p.numel() // tp if name in sharded else p.numel() for name, p in chunk.named_parameters()}
        routed = {f"{name}.mlp.experts.{weight}" for name, moe in moe_layers([chunk])
                  for weight, _ in moe.experts.named_parameters()}  # fmt: skip
        elements.update({name: elements[name] // ep for name in routed})
        # FSDP shards dim 0 (a stacked experts weight: whole experts), padded to a multiple of its ranks
        rows = {name: p.numel() // p.shape[0] if p.ndim > 1 else 1 for name, p in chunk.named_parameters()}
        ndims = {name: p.ndim for name, p in chunk.named_parameters()}
        trains = {name: not ft.adapters and not is_frozen(chunk.canonical_name(name), list(freeze))
                  for name in elements}  # fmt: skip
        for module_name, module in projections(chunk).items():
            weight = f"{module_name}.weight"
            largest_projection = max(largest_projection, elements[weight])
            if ft.quantized_base:
                quantized += elements[weight]
                quantized_bytes += nf4_bytes(elements[weight])
            if ft.adapters and module_name.rsplit(".", 1)[-1] in targets:  # A (rank, in), B (out, rank)
                column = isinstance(plan.get(module_name), ColwiseParallel)
                row = isinstance(plan.get(module_name), RowwiseParallel)
                out_features, in_features = module.weight.shape
                for adapter, count, width in (
                    ("lora_a", rank * in_features // (tp if row else 1), in_features),
                    ("lora_b", out_features // (tp if column else 1) * rank, rank),
                ):
                    elements[f"{module_name}.{adapter}"], rows[f"{module_name}.{adapter}"] = count, width
                    trains[f"{module_name}.{adapter}"], ndims[f"{module_name}.{adapter}"] = True, 2
        for name, count in elements.items():  # ZeRO-3 shards the routed experts' 1/ep over edp = dp / ep
            if chunk.canonical_name(name) in counted:  # a V's tied head: the embedding the rank holds already
                continue
            counted.add(chunk.canonical_name(name))
            shard = math.ceil(count // rows[name] / (max(1, dp // ep) if name in routed else dp)) * rows[name]
            total, shard_total = total + count, shard_total + shard
            if trains[name]:
                trainable, shard_trainable = trainable + count, shard_trainable + shard
                sizes.append(count)
                experts += count if name in routed else 0
                is_matrix.append(is_hidden_matrix(chunk.canonical_name(name), ndims[name]))
                if is_matrix[-1]:
                    matrices += count
            unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ""
            units[unit] = units.get(unit, 0) + count
            if unit and not (name in routed and ep > 1 and dp // ep <= 1):
                gathered[unit] = gathered.get(unit, 0) + count
            if name == "tok_embeddings.weight" and tp > 1 and trains[name]:
                full_grad = not (chunk.tied and chunk.output is not None)
    root = units.pop("", 0)
    return LocalParams(total, trainable, shard_total, shard_trainable, matrices,
                       max(units.values(), default=0), root,
                       quantized, quantized_bytes, largest_projection, tuple(sizes), full_grad, experts,
                       list(gathered.values())[-1] if gathered else 0, tuple(is_matrix))  # fmt: skip


@functools.lru_cache(maxsize=256)
def _meta_stage(model: tuple, stage: int, num_stages: int, tp: int) -> torch.nn.Module:
    """Pipeline stage `stage` built on the meta device (nothing allocated), and kept: building is most of a
    plan's time, and the counts of one layout's ranks and of --search's layouts share their stages."""
    model_cfg = ModelConfig(**dict(model))
    with torch.device("meta"):
        return get_spec(model_cfg.arch).build_stage(model_cfg, stage, num_stages, tp)


@functools.lru_cache(maxsize=1024)
def _largest_bucket(sizes: tuple[int, ...], element: int, limit: int) -> int:
    """`largest_bucket` of tensors of `sizes` elements of `element` bytes; kept, as --search asks for the
    buckets of the same ranks many times."""
    return largest_bucket([n * element for n in sizes], limit)


def nf4_bytes(elements: int) -> int:
    """torchao's NF4 tensor of `elements` weights: 4-bit codes, an int8 scale per block, a bf16 factor per
    group of scales, a bf16 mean and its 16-entry bf16 table."""
    blocks = elements // NF4_BLOCK
    factors = blocks // nf4_scaler_block(elements)
    factor_bytes = 2 * (blocks if factors == 1 else factors)  # a single factor is a view of a block-wide buffer
    return elements // 2 + blocks + factor_bytes + 2 + 32


def compute_bytes(cfg: JobConfig) -> int:
    """Element size of the weights the model computes with: the weights' own dtype, or with ZeRO-3 the
    dtype FSDP gathers its fp32 shards in (the compute dtype)."""
    if optimizer_class(cfg.optim).shards_params and cfg.train.precision != "fp32":
        return 2
    return precision_policy(cfg.train, cfg.optim).param_bytes


def activation_parts(cfg: JobConfig) -> StageActivations:
    """The family's activation formulas for one micro-batch of this run, by part of a stage: its shape on a
    rank (its cp shard of the tokens, in the compute dtype; autocast's casts of fp32 weights), as each
    feature that is on changes it (float8 projections, compiled blocks, LoRA's adapters...)."""
    m, p = cfg.model, cfg.parallel
    policy, compute = precision_policy(cfg.train, cfg.optim), compute_bytes(cfg)
    casts = policy.autocast_dtype is not None and compute == 4  # autocast over fp32 weights
    rows = cfg.train.micro_batch_size if cfg.data.reset_position_ids else 1  # RoPE rows per position
    shape = ActivationShape(tokens=cfg.train.micro_batch_size * m.seq_len // p.cp, tp=p.tp,  # cp: its shard
                            sequence_parallel=p.sequence_parallel and p.tp > 1,
                            element_bytes=policy.frozen_dtype.itemsize if casts else compute,
                            autocast_casts=casts,
                            document_tile=document_tile(cfg.train.micro_batch_size, m.seq_len, m.seq_len)
                            * cfg.data.document_mask,
                            rope_rows=rows * m.seq_len // p.cp)  # fmt: skip
    for _, adjust in declared(cfg, "activation_shape"):
        shape = adjust(shape)
    return get_spec(m.arch).activations(m, shape)


def activation_bytes(cfg: JobConfig, pp_rank: int = 0, parts: StageActivations | None = None) -> int:
    """Bytes saved for backward by one micro-batch on a rank of pipeline rank `pp_rank`, on its device: what
    the family's formula (`parts`: `activation_parts`, when the caller has it) says its blocks and stage
    parts keep, and what features move off the device."""
    parts = parts or activation_parts(cfg)
    given = {"parts": parts, "block_policy": block_policy(cfg), "pp_rank": pp_rank}
    moved = sum(moved() for _, moved in declared(cfg, "activations", **given))
    return sum(stage_activation_bytes(cfg, pp_rank, parts).values()) + moved


def stage_layers(cfg: JobConfig, pp_rank: int) -> list[tuple[int, range, bool]]:
    """The stages pipeline rank `pp_rank` holds: (stage, its layers' global indices, whether it is the last)."""
    p = cfg.parallel
    num_stages = p.pp * p.virtual_stages
    per_stage = cfg.model.n_layers // num_stages
    return [(stage, range(stage * per_stage, (stage + 1) * per_stage), stage == num_stages - 1)
            for stage in stage_ids(pp_rank, p.pp, p.virtual_stages, p.schedule)]  # fmt: skip


def stage_activation_bytes(cfg: JobConfig, pp_rank: int, parts: StageActivations) -> dict[int, int]:
    """What the family's formula says one micro-batch keeps on each stage pipeline rank `pp_rank` holds."""
    policy = block_policy(cfg)
    kept = {}
    for stage, layers, last in stage_layers(cfg, pp_rank):
        kept[stage] = sum(parts.block(policy(i), is_moe_layer(cfg.model, layer)) for i, layer in enumerate(layers))
        kept[stage] += parts.every_stage
        kept[stage] += parts.first_stage if stage == 0 else 0
        kept[stage] += parts.last_stage if last else 0
    return kept


def weight_cast_bytes(cfg: JobConfig, pp_rank: int, parts: StageActivations) -> int:
    """Autocast's casts of the weights of the stages pipeline rank `pp_rank` holds (zero_stage 0 in
    bf16/fp16): one per weight, from its first forward to the end of the step's last backward."""
    total = 0
    for _, layers, last in stage_layers(cfg, pp_rank):
        total += sum(parts.weight_casts_block + parts.moe_weight_casts * is_moe_layer(cfg.model, i) for i in layers)
        total += parts.weight_casts_last_stage * last
    return total


def in_flight(cfg: JobConfig, pp_rank: int = 0) -> float:
    """Micro-batches (of all its chunks) pipeline rank `pp_rank` holds at its peak: counted on the schedule's
    own actions where torch lists them (`in_flight_chunks`; a zero-bubble schedule holds a micro-batch until
    its weight half), else torch's warmup forwards and the first steady-state one, fewer the later the rank
    (1F1B: the last runs each backward at once; interleaved 1F1B's formula, which its actions match)."""
    p, micro = cfg.parallel, cfg.train.grad_accum
    if p.pp == 1:
        return 1
    chunks = in_flight_chunks(p, micro, pp_rank)
    if chunks is None and p.virtual_stages == 1:
        return min(p.pp - pp_rank, micro)
    if chunks is None:
        chunks = min((p.virtual_stages - 1) * p.pp + 2 * (p.pp - 1 - pp_rank) + 1, micro * p.virtual_stages)
    return chunks / p.virtual_stages  # activation_bytes sums all local chunks


def local_copies(cfg: JobConfig, dims: ParallelDims) -> int:
    """How many copies of a rank's state node-local checkpoints hold in host memory. On disk: the copy they
    are written from, and across nodes the partner's a save receives (sized as this rank's: the same local
    rank on the next node, of the same stage where pp stays in a node), unless a twin on another node (a dp
    replica at ZeRO-0, dp spanning nodes) holds its tensors, when only the small parts come. In memory (a
    tmpfs's pages are the job's memory): the two steps kept of this rank's own, the newer one the copy, and
    of the partner's, received straight into its file."""
    twin = cfg.optim.zero_stage == 0 and cfg.parallel.ep == 1 and dims.world_size // dims.pp > cfg.slurm.tasks_per_node
    partner = cfg.slurm.nodes > 1 and not (twin and dims.dp > 1)
    return (1 + partner) * (2 if cfg.checkpoint.memory_interval else 1)


def rule_state_bytes(rule: type[UpdateRule], owned: int, local: LocalParams) -> int:
    """The update rule's state for `owned` of a rank's trainable elements, tensor by tensor (a low-bit rule
    quantizes by a tensor's size, and keeps a code book per tensor it holds a part of); a ZeRO or FSDP share
    holds the owned fraction of every tensor (the shares rounded so that they add up to `owned`)."""
    trainable, total, before = max(sum(local.trainable_sizes), 1), 0, 0
    for n, matrix in zip(local.trainable_sizes, local.trainable_is_matrix, strict=True):
        share = (before + n) * owned // trainable - before * owned // trainable
        total, before = total + rule.planned_state_bytes(matrix, share, n), before + n
    return total


def pipeline_buffers(cfg: JobConfig, parts: StageActivations, pp_rank: int = 0) -> int:
    """Bytes of the receive buffers torch's pipeline stages on pipeline rank `pp_rank` keep for the whole
    run: per micro-batch, one for the activations a stage receives (not the first stage) and one for the
    gradient of its output (not the last), each the size of a block's input: a middle stage holds two."""
    p, micro = cfg.parallel, cfg.train.grad_accum
    if p.pp == 1:
        return 0
    num_stages = p.pp * p.virtual_stages
    stages = stage_ids(pp_rank, p.pp, p.virtual_stages, p.schedule)
    buffers = sum((stage > 0) + (stage < num_stages - 1) for stage in stages)
    return buffers * micro * parts.layer["full"]


def estimate(cfg: JobConfig, dims: ParallelDims) -> MemoryEstimate:
    """Bytes per rank of the pipeline rank that needs the most (of `stage_estimates`; the first when they
    tie): what a layout must fit, and the rank to look at."""
    return max(stage_estimates(cfg, dims), key=lambda plan: plan.total)


def stage_estimates(cfg: JobConfig, dims: ParallelDims) -> list[MemoryEstimate]:
    """`stage_estimate` of each pipeline rank whose memory can differ (`distinct_ranks`: rank 0 first)."""
    parts = activation_parts(cfg)
    return [stage_estimate(cfg, dims, pp_rank, parts) for pp_rank in distinct_ranks(cfg)]


def distinct_ranks(cfg: JobConfig) -> list[int]:
    """The pipeline ranks whose memory can differ, the first of each kind. Ranks whose stages hold the same
    kinds of parts (the first or last stage's, MoE or dense blocks) differ only in the micro-batches they
    keep in flight, fewer the later the rank, and in whether gradients of an earlier backward are held by
    then; frozen parameters are chosen by name, so with train.freeze every rank is of its own kind. Why:
    counting a rank's parameters builds its stages on the meta device, most of a plan's time, and --search
    plans thousands of layouts."""
    p, m = cfg.parallel, cfg.model
    num_stages = p.pp * p.virtual_stages
    per_stage = m.n_layers // num_stages
    kinds, ranks = set(), []
    for pp_rank in range(p.pp):
        parts = tuple((stage == 0, stage == num_stages - 1,
                       tuple(is_moe_layer(m, stage * per_stage + i) for i in range(per_stage)))
                      for stage in stage_ids(pp_rank, p.pp, p.virtual_stages, p.schedule))  # fmt: skip
        kind = (parts, in_flight(cfg, pp_rank) < cfg.train.grad_accum, pp_rank if cfg.train.freeze else None)
        if kind not in kinds:
            kinds.add(kind)
            ranks.append(pp_rank)
    return ranks


def stage_estimate(
    cfg: JobConfig, dims: ParallelDims, pp_rank: int = 0, parts: StageActivations | None = None
) -> MemoryEstimate:
    """Bytes on a rank of pipeline rank `pp_rank` by category, and the total at the peak (`parts`: the
    family's activation formula, `activation_parts`, when the caller has it). Its stages' layers and
    parameters (embeddings on the first, final norm, head and loss on the last), the micro-batches it keeps
    in flight and its receive buffers. ZeRO stages 1-2 shard the optimizer state (and
    stage 2 the gradients) in the optimizer; stage 3 shards the parameters too (FSDP2), so it counts its
    dim-0 shards exactly. Every category is device memory: offload moves the sharded optimizer state
    (stages 1-2: with a host copy of the owned gradients; stage 3: also the parameter and gradient shards)
    to `host`. The in-memory copy of the state that train.spike_guard and node-local checkpoints keep is
    `host_copy` (the parameters and the optimizer state as this rank holds them, wherever they live; for
    node-local checkpoints, `local_copies` of it), apart from `host`, which the step measures.

    The total is the largest of three moments of a step (each checked against the measured peak of live
    tensor bytes on CPU, tools/validate_planner.py):
      backward's start  every activation kept and the gradients held from a backward before (an earlier
                        micro-batch's, the pipeline's warmup ending with the first backward; stage 2's
                        owned slices from begin_step), then the larger of the loss's backward (on the
                        last pipeline rank) and what the last blocks' backward adds once the head's
                        activations are gone: the first
                        gradient buffer (stage 0: the head's gradients, stage 1: a whole fp32 bucket), the
                        fresh gradients of a block (stage 1: of a tensor) before they join those held, the
                        buckets stage 2 reduce-scatters from backward (two in flight with
                        overlap_grad_reduce), the second block stage 3 gathers with a block's gradients (in
                        the compute dtype as they grow, then FSDP's fp32 copy for the reduce-scatter once
                        the block's activations are freed), and the block's own working set
                        (`block_backward`);
      backward's end    every gradient, the first block's saved tensors (kept or recomputed: with full
                        recompute this is the peak), its working set and, with overlap_grad_reduce at
                        stage 0, every bucket's flat copy still in flight;
      the update        every gradient and the bucket the update gathers the weights in (stages 1-2; in
                        fp32 for a rule that needs whole matrices) or the flat bucket stage 0 all-reduces
                        after backward.
    Throughout the step: the pipeline's receive buffers (`pipeline_buffers`). A block's working set: the
    gradients of its output and of its widest activation. Each feature that is on adds its own bytes at
    these moments (features/*: `Memory`): the buffers of an exchange while a block runs (context and expert
    parallelism), what ZeRO-3 gathers (through the step: its root unit and the next block prefetched, or
    the whole stage; while a block's backward runs: the block and its gradients), the working set of a
    float8 projection's or QLoRA's backward, activations moved to host memory."""
    o, dp = cfg.optim, dims.dp * dims.cp  # gradients are averaged, and ZeRO shards, over dp x cp
    cls = optimizer_class(o)
    local = local_param_count(cfg, pp_rank, dp=dp if cls.shards_params else 1)
    p = cfg.parallel  # the rank holding the final norm, the head and the loss (the first too, in a V):
    last = p.pp * p.virtual_stages - 1 in stage_ids(pp_rank, p.pp, p.virtual_stages, p.schedule)
    policy = precision_policy(cfg.train, cfg.optim)
    element, compute = policy.param_bytes, compute_bytes(cfg)
    parts = parts or activation_parts(cfg)
    flight = in_flight(cfg, pp_rank)
    added = feature_memory(cfg, dims, local=local, parts=parts, compute=compute, in_flight=flight, pp_rank=pp_rank)
    static = pipeline_buffers(cfg, parts, pp_rank) + added.static  # communication buffers alive through the step
    block = added.block  # what the features' exchanges and gathers hold while a block runs
    first = at_end = update = 0  # buffers alive at one of the moments only
    if cls.shards_params:  # the fp32 shards are the master weights (FSDP2's gathers: its feature's memory)
        param_bytes = 4 * local.shard_total
        trainable = local.shard_trainable
        grads, masters, owned = cls.planned_bytes(trainable, 1, element, o.overlap_grad_reduce)
    else:  # LoRA's frozen base in the compute dtype, QLoRA's projections in NF4
        frozen = local.total - local.trainable - local.quantized
        frozen_bytes = policy.frozen_dtype.itemsize if cfg.finetune.adapters else element
        param_bytes = local.trainable * element + frozen * frozen_bytes + local.quantized_bytes
        trainable = local.trainable
        grads, masters, owned = cls.planned_bytes(trainable - local.experts, dp, element, o.overlap_grad_reduce)
        if local.experts:  # the routed experts' shards are reduced (and ZeRO-sharded) over edp = dp / ep
            planned = cls.planned_bytes(local.experts, dp // cfg.parallel.ep, element, o.overlap_grad_reduce)
            grads, masters, owned = (a + b for a, b in zip((grads, masters, owned), planned, strict=True))
        limit = int(o.bucket_mb * 2**20)
        if not cls.shards_state:  # stage 0: the gradients themselves, then a flat copy of a bucket per all-reduce
            first = grads * local.root // local.total if last else 0  # the head's, on the last stage
            if dp > 1 and o.overlap_grad_reduce:  # every bucket's flat copy stays in flight to the end
                at_end = element * trainable
            elif dp > 1:
                update = _largest_bucket(local.trainable_sizes, element, limit)
        else:  # stages 1-2: fp32 buckets; the update gathers each bucket's weights (and its owned slice)
            bucket = _largest_bucket(local.trainable_sizes, 4, limit)
            if dp > 1 or o.offload == "cpu":
                update = bucket * element // 4 * (dp + 1) // dp
                if rule_class(o).gathers_matrices:  # whole matrices for the rule: the same in fp32
                    update = max(update, bucket * (dp + 1) // dp)
            if cls.grads_before_backward:  # stage 2: reduce-scattered from backward, a bucket at a time
                launched = 2 if o.overlap_grad_reduce else 1
                block += launched * bucket * (dp + 1) // dp + bucket * element // 4  # fp32 copy, slice; own grads
            else:  # stage 1: the bucket the head's gradient goes to, allocated whole
                first = min(grads, bucket)
    fresh = 0  # gradients a block's backward makes before they join those held (stage 1: a tensor's at a time)
    if not cls.shards_params and not cls.grads_before_backward and trainable:
        block_trainable = local.largest_block * trainable // local.total  # LoRA: the block's adapters
        fresh = element * (max(local.trainable_sizes) if cls.takes_grads_in_backward else block_trainable)
    optimizer = masters + rule_state_bytes(rule_class(o), owned, local)
    recompute = block_policy(cfg)  # a block recomputed whole gathers nothing again
    regathers = any(recompute(i) != "full" for i in range(cfg.model.n_layers // (p.pp * p.virtual_stages)))
    working = parts.block_backward + parts.regathered_input * regathers + added.working
    if local.full_size_embedding_grad and not (o.overlap_grad_reduce or cls.takes_grads_in_backward):
        vocab_rows = get_spec(cfg.model.arch).padded_vocab_size(cfg.model, dims.tp)
        grads += vocab_rows * cfg.model.d_model * 4 * (dims.tp - 1) // dims.tp
    host = added.host
    # QLoRA's NF4 weights are not copied: they never change
    host_copy = param_bytes - (0 if cls.shards_params else local.quantized_bytes) + optimizer
    host_copy *= local_copies(cfg, dims) if cfg.checkpoint.saves_locally else int(plans_memory_copy(cfg))
    disk = 0
    if o.offload == "nvme" and cls.shards_params:  # FSDP2's shards and gradients in host memory (the shards are
        # the masters); the moments in files, streamed through a ring of two buffers a slot
        ring = ring_bytes(int(o.offload_buffer_mb * 2**20), owned, 2)
        disk, host, optimizer = 2 * 4 * padded(owned), host + ring + param_bytes + grads, 0
        param_bytes, grads = 0, 0
    elif o.offload == "nvme":  # the masters and the rule's state in files, streamed through the ring (with the
        # owned gradients); the updated weights of the owned slice wait on the device for the all-gather (at dp 1:
        # written in place)
        rings = 2 if cfg.parallel.ep > 1 else 1  # under ep the experts' state streams through a ring of its own
        ring = rings * ring_bytes(int(o.offload_buffer_mb * 2**20), owned, 4)
        disk, host, optimizer = 3 * 4 * padded(owned), host + ring, owned * element if dp > 1 else 0
    if o.offload == "cpu":
        host, optimizer = host + optimizer, 0
        if cls.shards_params:
            host, param_bytes, grads = host + param_bytes + grads, 0, 0
        else:  # stages 1-2: the owned fp32 gradients' host copy the update reads
            host += 4 * owned
    per_micro = activation_bytes(cfg, pp_rank, parts)
    activations, awaiting = int(per_micro * flight), 0
    stages = stage_activation_bytes(cfg, pp_rank, parts)  # a feature's moved bytes shared evenly by the stages
    moved = (per_micro - sum(stages.values())) / len(stages)
    # a split backward's gradients awaiting their weight halves, on each stage
    blocks, num_stages = cfg.model.n_layers // (p.pp * p.virtual_stages), p.pp * p.virtual_stages
    weight_grads = {s: (parts.weight_grads_block * blocks + parts.weight_grads_last_stage * (s == num_stages - 1))
                    * (p.schedule in SPLIT_BACKWARD) for s in stages}  # fmt: skip
    held = held_at_peak(p, cfg.train.grad_accum, pp_rank, {s: b + moved for s, b in stages.items()}, weight_grads)
    if held is not None:
        activations, awaiting = int(held[0]), int(held[1])
    loss_backward = parts.loss_backward if last else 0
    head = parts.last_stage if last else 0  # freed once the loss's and the head's backward are done
    # gradients are held at the activation peak from a backward before it: an earlier micro-batch's (the
    # pipeline's warmup ends with the first backward), or stage 2's owned slices from begin_step
    chunks = flight * p.virtual_stages
    held = cls.grads_before_backward or cfg.train.grad_accum * p.virtual_stages > chunks
    casts = weight_cast_bytes(cfg, pp_rank, parts)  # through forward and backward
    start = casts + activations + awaiting + (grads if held else 0)
    start += max(loss_backward, (0 if held else first) + max(0, block + fresh + working - head))
    # the first block's backward: what it keeps (recomputed whole, its projections' inputs gathered)
    end = casts + grads + parts.layer["none"] + parts.regather_saving * (recompute(0) == "full") + working + at_end
    total = param_bytes + optimizer + static + max(start, end, grads + update)
    comm = static + max(block, at_end, update)
    return MemoryEstimate(param_bytes, grads, optimizer, per_micro, math.ceil(flight), activations, comm,
                          loss_backward, fresh + working, host, total, added.host, host_copy, pp_rank,
                          dims.pp, disk, casts)  # fmt: skip


def plans_memory_copy(cfg: JobConfig) -> bool:
    """Whether train.spike_guard keeps an in-memory copy of the state: asked for, or, left to the planner
    (memory_copy unset), always planned; the run drops it where the node's memory cannot hold it
    (`hpc_train.builder.keeps_memory_copy`)."""
    guard = cfg.train.spike_guard
    return guard.enabled and guard.memory_copy is not False


def feature_memory(cfg: JobConfig, dims: ParallelDims, **given) -> Memory:
    """What the features that are on add to one rank's memory, summed by where it sits in a step. `given`:
    the planner's own figures a feature may read (`local`: the rank's parameters, `parts`: the family's
    activation formula, `compute`: the element size of the weights computed with)."""
    terms = [memory() for _, memory in declared(cfg, "memory", dims=dims, block_policy=block_policy(cfg), **given)]
    return Memory(**{f.name: sum(getattr(t, f.name) for t in terms) for f in dataclasses.fields(Memory)})
