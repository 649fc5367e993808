"""Memory planner: bytes per rank for a layout before anything runs, and a search over layouts.

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
import itertools
import math
import shlex
import textwrap
from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.config.schema import SPLIT_BACKWARD
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import bubble_fraction, held_at_peak, in_flight_chunks, stage_ids
from hpc_train.features.feature import Links, Memory
from hpc_train.features.lora.adapters import NF4_BLOCK, nf4_scaler_block
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.features.tensor_parallel.sharding import sharded_parameter_names
from hpc_train.job import JobConfig, block_policy, check_run, declared
from hpc_train.models import get_spec
from hpc_train.models.common.document_attention import document_tile
from hpc_train.models.common.moe import is_moe_layer, moe_layers
from hpc_train.models.spec import ActivationShape, StageActivations, is_frozen, projections
from hpc_train.optim import NVME, OPTIMIZERS, optimizer_class, precision_policy
from hpc_train.optim.buckets import largest_bucket
from hpc_train.optim.nvme import padded, ring_bytes
from hpc_train.optim.rules import UpdateRule, is_hidden_matrix, rule_class

GiB = 2**30
LONG_SEQUENCE = 8192  # `plan --search` tries context parallelism from this model.seq_len on
RECOMPUTE = ("none", "selective", "full")  # model.recompute's choices, which `plan --search` tries


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


LOW_BIT_FALLBACK = {"adamw": ("adamw8bit", "adamw4bit")}  # what `search` tries where a rule's state does not fit
NODE_DISK = "$SLURM_TMPDIR/hpc_train_offload"  # where a searched nvme layout keeps its state: the node's own disk
# step-time estimates this close to the fastest's tie: the estimate's own error (a fixed MFU, no kernel or
# network measured) is larger than that
TIE = 0.05


@dataclass(frozen=True)
class Limits:
    """What a layout of `world` ranks must fit: `gpu_mem` bytes a GPU and, where given, `host_mem` bytes a
    node, which the node's ranks (`node` a node at most) share."""

    world: int
    gpu_mem: float
    host_mem: float | None = None
    node: int = 8

    def over(self, total: float, host: float) -> float:
        """How far a rank's `total` device bytes and `host` bytes are from fitting: their largest ratio to
        what they must fit in (1 or less: it fits)."""
        node_host = host * min(self.world, self.node)
        return max(total / self.gpu_mem, node_host / self.host_mem if self.host_mem else 0.0)

    def fits(self, plan: MemoryEstimate) -> bool:
        host = (plan.host + plan.host_copy) * min(self.world, self.node)
        return plan.total <= self.gpu_mem and (self.host_mem is None or host <= self.host_mem)

    def row_over(self, row: dict) -> float:
        return self.over(row["total_gib"] * GiB, row["host_gib"] * GiB)


def layout_settings(cfg: JobConfig, layout: dict) -> dict[str, object]:
    """The config keys that give `cfg` a `search` row's layout, with their values. dp and the global batch
    follow from the world; sequence parallelism (on with tp) and the cp mode are set only where they act
    (tp > 1, cp > 1); nvme offload goes to the node's own disk unless the config names a directory."""
    settings: dict[str, object] = {"parallel.tp": layout["tp"]}
    if layout["tp"] > 1:
        settings["parallel.sequence_parallel"] = True
    settings |= {"parallel.pp": layout["pp"], "parallel.virtual_stages": layout["vp"],
                 "parallel.schedule": layout["schedule"], "parallel.cp": layout["cp"]}  # fmt: skip
    if layout["cp"] > 1:
        settings["parallel.cp_mode"] = layout["cp_mode"]
    settings |= {"parallel.dp": None, "train.micro_batch_size": layout["mbs"], "train.grad_accum": layout["grad_accum"],
                 "train.global_batch_size": None, "model.recompute": layout["recompute"],
                 "optim.zero_stage": layout["zero"], "optim.offload": layout["offload"]}  # fmt: skip
    if layout["offload"] == "nvme" and not cfg.optim.offload_dir:
        settings["optim.offload_dir"] = NODE_DISK
    settings["optim.name"] = layout["optim"]
    return settings


def with_settings(cfg: JobConfig, settings: dict[str, object]) -> JobConfig:
    """`cfg` with `settings` (`section.key`: value): the sections they set copied, the others shared (the checks
    and the plan only read them)."""
    from copy import copy

    c = copy(cfg)
    for section in {key.split(".")[0] for key in settings}:
        setattr(c, section, copy(getattr(cfg, section)))
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    return c


def overrides(cfg: JobConfig, settings: dict[str, object]) -> list[str]:
    """The `key=value` arguments that give `settings` from `cfg`: the keys whose value differs, as YAML spells
    the value."""
    spelled = {None: "null", True: "true", False: "false"}
    return [f"{key}={spelled.get(value, value) if isinstance(value, bool | None) else value}"
            for key, value in settings.items() if functools.reduce(getattr, key.split("."), cfg) != value]  # fmt: skip


def _row(c: JobConfig, dims: ParallelDims, plan: MemoryEstimate, fits: bool, peak_flops: float,
         changed: list[str]) -> dict:  # fmt: skip
    """A layout as `search` lists it: its settings, its memory, whether it fits, its estimated step time and the
    overrides (`changed`) that give it from the config searched."""
    p, t, o = c.parallel, c.train, c.optim
    return {
        "tp": p.tp, "pp": p.pp, "vp": p.virtual_stages, "schedule": p.schedule, "dp": dims.dp, "cp": p.cp,
        "cp_mode": p.cp_mode, "mbs": t.micro_batch_size, "grad_accum": t.grad_accum, "recompute": c.model.recompute,
        "zero": o.zero_stage, "offload": o.offload, "optim": o.name,
        "total_gib": plan.total / GiB, "host_gib": (plan.host + plan.host_copy) / GiB, "disk_gib": plan.disk / GiB,
        "fits": fits, "step_s": step_time_estimate(c, dims, peak_flops), "overrides": changed,
    }  # fmt: skip


def search(cfg: JobConfig, world: int, gpu_mem_bytes: float, peak_flops: float,
           host_mem_bytes: float | None = None, rule_change: bool = True) -> list[dict]:  # fmt: skip
    """Every layout of `world` ranks (tp within a node of slurm.gpus_per_node or 8, pp, virtual stages and
    schedule, micro-batch size at a fixed global batch, recompute, zero stage, offload: none, cpu, nvme)
    that passes validation, with its memory, estimated step time and the overrides that give it from `cfg`;
    those that fit first, fastest first, each marked `tie` where its estimate is within TIE of the fastest's.
    With `host_mem_bytes` (a node's), a layout fits only where its node's ranks' host memory does too: so
    nvme offload, slower than cpu, comes first where cpu offload's state does not fit the host. A layout
    whose AdamW state does not fit is tried with 8-bit, then 4-bit moments (`LOW_BIT_FALLBACK`): with
    `rule_change`, the first that fits is its row; without, the row keeps the config's rule and `fits_with`
    names the low-bit rule that would fit."""
    t = cfg.train
    # the config's micro-batches per dp rank at `world` (at least one dp rank, where its own layout is larger)
    own_dp = max(1, world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp))
    global_batch = t.micro_batch_size * t.grad_accum * own_dp
    limits = Limits(world, gpu_mem_bytes, host_mem_bytes, cfg.slurm.gpus_per_node or 8)
    choices = itertools.product(
        [x for x in (1, 2, 4, 8) if x <= limits.node],  # tp
        (1, 2, 4, 8, 16),  # pp
        # (virtual stages, schedule) at pp > 1
        ((1, "1f1b"), (2, "interleaved_1f1b"), (2, "interleaved_zb"), (2, "zbv"), (2, "dualpipev")),
        (1, 2, 4, 8),  # micro-batch size
        RECOMPUTE,
        [
            (zero, offload)
            for zero, cls in OPTIMIZERS.items()
            for offload in ("none", "cpu", "nvme")[: (1 + cls.shards_state + (zero in NVME))]
        ],  # fmt: skip
        # context parallelism for long sequences (activations / cp)
        [(1, "ring")]
        + [
            (cp, mode) for cp in (2, 4, 8) for mode in ("ring", "ulysses") if cfg.model.seq_len >= LONG_SEQUENCE
        ],  # fmt: skip
    )
    rows = []
    for tp, pp, (vp, schedule), mbs, recompute, (zero, offload), (cp, cp_mode) in choices:
        if world % (tp * pp * cp) or (vp > 1 and pp == 1) or global_batch % (mbs * (world // (tp * pp * cp))):
            continue
        dp = world // (tp * pp * cp)
        layout = {"tp": tp, "pp": pp, "vp": vp, "schedule": schedule, "cp": cp, "cp_mode": cp_mode, "mbs": mbs,
                  "grad_accum": global_batch // (mbs * dp), "recompute": recompute, "zero": zero, "offload": offload,
                  "optim": cfg.optim.name}  # fmt: skip
        settings = layout_settings(cfg, layout)
        c = with_settings(cfg, settings)
        try:
            dims = check_run(c, world, check_paths=False)
        except ConfigError:
            continue
        plan, fits_with = estimate(c, dims), None
        for rule in LOW_BIT_FALLBACK.get(cfg.optim.name, ()) if not limits.fits(plan) and offload != "nvme" else ():
            low_bit = estimate(with_settings(c, {"optim.name": rule}), dims)
            if limits.fits(low_bit):
                fits_with = rule
                break
        if fits_with and rule_change:
            settings["optim.name"], plan, fits_with = fits_with, low_bit, None
            c = with_settings(cfg, settings)
        row = _row(c, dims, plan, limits.fits(plan), peak_flops, overrides(cfg, settings))
        rows.append({**row, "fits_with": fits_with})
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["total_gib"]))
    fastest = rows[0]["step_s"] if rows and rows[0]["fits"] else 0.0
    for row in rows:
        row["tie"] = row["fits"] and row["step_s"] <= fastest * (1 + TIE)
    return rows


def search_report(cfg: JobConfig, world: int, gpu_mem_bytes: float, peak_flops: float,
                  host_mem_bytes: float | None = None, rule_change: bool = False) -> dict:  # fmt: skip
    """`hpc-train plan --search`'s answer: every layout `search` finds (`rows`), how many fit, the config's own
    layout at `world` ranks (`own`: its rank among those that fit, `error` where it is not valid there), and,
    where nothing fits (the config's own layout neither), the nearest fix (`fix`, `search_fix`). Without
    `rule_change` the config's update rule is kept (a low-bit one changes the numerics); `fit_with_rule_change`
    counts the layouts that fit only with one (with it: the layouts that fit with one)."""
    limits = Limits(world, gpu_mem_bytes, host_mem_bytes, cfg.slurm.gpus_per_node or 8)
    rows = search(cfg, world, gpu_mem_bytes, peak_flops, host_mem_bytes, rule_change)
    fitting = [r for r in rows if r["fits"]]
    changed_rule = sum(r["fits_with"] is not None for r in rows) if not rule_change else \
        sum(r["fits"] and r["optim"] != cfg.optim.name for r in rows)  # fmt: skip
    try:
        dims = check_run(cfg, world, check_paths=False)
    except ConfigError as err:
        own = {"error": str(err)}
    else:
        plan = estimate(cfg, dims)
        own = _row(cfg, dims, plan, limits.fits(plan), peak_flops, [])
        if own["fits"]:
            own["rank"] = 1 + sum(r["step_s"] < own["step_s"] for r in fitting)
            own["tie"] = not fitting or own["step_s"] <= fitting[0]["step_s"] * (1 + TIE)
    return {"world": world, "node": limits.node, "gpu_mem_gib": gpu_mem_bytes / GiB,
            "host_mem_gib": host_mem_bytes / GiB if host_mem_bytes else None, "searched": len(rows),
            "fit": len(fitting), "ties": sum(r["tie"] for r in rows), "tie_within": TIE, "rule_change": rule_change,
            "fit_with_rule_change": changed_rule, "own": own,
            "fix": None if fitting or own.get("fits") else search_fix(cfg, rows, limits, peak_flops),
            "rows": rows}  # fmt: skip


def search_fix(cfg: JobConfig, rows: list[dict], limits: Limits, peak_flops: float) -> dict:
    """Where no layout fits: the one closest to fitting (`closest`, `over`: its ratio to the limit it exceeds
    most) and what would fit it: a GPU (`gpu_mem_gib`) or a node's host memory (`host_mem_gib`) that large, or
    more ranks (`more_ranks`, `_at_more_ranks`, or None). Every recompute choice, zero stage and offload was
    searched."""
    if not rows:
        return {"closest": None}
    closest = min(rows, key=lambda r: (limits.row_over(r), r["step_s"]))
    node_host = closest["host_gib"] * min(limits.world, limits.node)
    return {
        "closest": closest, "over": limits.row_over(closest),
        "gpu_mem_gib": math.ceil(closest["total_gib"]) if closest["total_gib"] * GiB > limits.gpu_mem else None,
        "host_mem_gib": math.ceil(node_host) if limits.host_mem and node_host * GiB > limits.host_mem else None,
        "more_ranks": _at_more_ranks(cfg, closest, limits, peak_flops),
    }  # fmt: skip


def _at_more_ranks(cfg: JobConfig, row: dict, limits: Limits, peak_flops: float) -> dict | None:
    """`row`'s layout on 2, 4 or 8 times the ranks, the extra ones tensor-parallel (within a node), pipeline or
    data-parallel (the global batch kept: fewer micro-batches each): the first that fits, with its `world`
    (of the fewest ranks, the fastest); None where none does."""
    for times in (2, 4, 8):
        more, found = dataclasses.replace(limits, world=limits.world * times), []
        wider = [{"tp": row["tp"] * times}] if row["tp"] * times <= limits.node else []
        deeper = [{"grad_accum": row["grad_accum"] // times}] if row["grad_accum"] % times == 0 else []
        for change in [*wider, {"pp": row["pp"] * times}, *deeper]:
            if fitting := _fitting_row(cfg, layout_settings(cfg, {**row, **change}), more, peak_flops):
                found.append({**fitting, "world": more.world})
        if found:
            return min(found, key=lambda r: r["step_s"])
    return None


def nearest_fix(cfg: JobConfig, limits: Limits, peak_flops: float) -> dict | None:
    """For a config whose layout does not fit: the fewest changes of its recompute choice, zero stage and cpu
    offload (its tp, pp and batch kept) that fit, the fastest of those; None where none does."""
    found = []
    for recompute, zero, offload in itertools.product(RECOMPUTE, OPTIMIZERS, ("none", "cpu")):
        settings = {"model.recompute": recompute, "optim.zero_stage": zero, "optim.offload": offload}
        if overrides(cfg, settings) and (fitting := _fitting_row(cfg, settings, limits, peak_flops)):
            found.append(fitting)
    return min(found, key=lambda r: (len(r["overrides"]), r["step_s"]), default=None)


def _fitting_row(cfg: JobConfig, settings: dict, limits: Limits, peak_flops: float) -> dict | None:
    """The row of `cfg` changed by `settings` at `limits.world`, where that layout is valid there and fits;
    None otherwise."""
    c = with_settings(cfg, settings)
    try:
        dims = check_run(c, limits.world, check_paths=False)
    except ConfigError:
        return None
    plan = estimate(c, dims)
    return _row(c, dims, plan, True, peak_flops, overrides(cfg, settings)) if limits.fits(plan) else None


def dp_traffic_bytes(cfg: JobConfig, dims: ParallelDims, params: int, matrices: int = 0) -> float:
    """Bytes a rank sends over dp per step for `params` local elements by the optimizer's strategy (ring
    collectives: (dp-1)/dp of the buffer each). Stage 0: an fp32 all-reduce (reduce-scatter + all-gather).
    Stages 1-2: an fp32 reduce-scatter (stage 2: one per micro-batch) and an all-gather of the weights in
    their dtype. Stage 3's gathers and reduce-scatters are FSDP2's (features/fsdp). A rule that needs whole
    matrices (Muon) adds, where the state is sharded, an fp32 all-gather of the `matrices` elements'
    updates."""
    t, o, dp = cfg.train, cfg.optim, dims.dp * dims.cp
    if dp == 1:
        return 0.0
    ring = params * (dp - 1) / dp
    cls = optimizer_class(o)
    traffic = 0.0
    if o.zero_stage == 0:
        traffic = ring * 4 * 2
    elif not cls.shards_params:
        reduce_scatters = t.grad_accum if o.zero_stage == 2 else 1
        traffic = ring * (4 * reduce_scatters + precision_policy(cfg.train, cfg.optim).param_bytes)
    if rule_class(o).gathers_matrices and cls.shards_state:
        traffic += 4 * matrices * (dp - 1) / dp
    return traffic


def traffic(cfg: JobConfig, dims: ParallelDims) -> dict[str, float]:
    """Bytes a rank sends per step, by process-group role: dp (the optimizer's strategy, and what features
    add to it: FSDP2's gathers, float8's savings), cp, ep... (each feature's own)."""
    local = local_param_count(cfg)
    out = {"dp": dp_traffic_bytes(cfg, dims, local.trainable, local.trainable_matrices)}
    given = {"dims": dims, "local": local, "compute": compute_bytes(cfg), "block_policy": block_policy(cfg)}
    for _, sent in declared(cfg, "traffic", **given):
        for role, nbytes in sent().items():
            out[role] = out.get(role, 0.0) + nbytes
    return out


def step_time_estimate(cfg: JobConfig, dims: ParallelDims, peak_flops: float, mfu: float = 0.4,
                       links: Links | None = None, host_adam_elements_per_s: float = 1e9) -> float:  # fmt: skip
    """A simple model to rank layouts: compute at `mfu` of peak (x4/3 with full recompute), the pipeline
    bubble (pp-1)/(m v), tp communication over NVLink, dp traffic over InfiniBand (`traffic`) less what
    overlaps backward (overlap_grad_reduce: the last micro-batch's backward, 2/3 of its compute; stage 3
    prefetches, so up to all of the compute), offload's real cost: the owned gradients to the host and the
    updated weights back over PCIe (stage 3: the parameter shards for every all-gather and the gradient
    shards of every reduce-scatter) and AdamW on the host cores of each rank, and what each feature that is
    on adds (context and expert parallelism's exchanges)."""
    m, p, t, o, dp = cfg.model, cfg.parallel, cfg.train, cfg.optim, dims.dp
    links = links or Links(gpus_per_node=cfg.slurm.gpus_per_node or 8)
    tokens = t.micro_batch_size * t.grad_accum * m.seq_len  # per dp rank (all its cp ranks)
    compute = tokens * dp * get_spec(m.arch).flops_per_token(m) / (dims.world_size * peak_flops * mfu)
    policy = block_policy(cfg)
    if policy(0) == "full":
        compute *= 4 / 3
    bubble = compute * bubble_fraction(p, t.grad_accum)
    elt = 2 if t.precision != "fp32" else 4
    tp_bytes = 0 if p.tp == 1 else 4 * m.n_layers / p.pp * tokens / p.cp * m.d_model * elt * (p.tp - 1) / p.tp
    dp_time = traffic(cfg, dims)["dp"] / (links.ib_gbps * 1e9)
    if optimizer_class(o).shards_params:  # FSDP prefetches
        dp_time = max(0.0, dp_time - compute)
    elif o.overlap_grad_reduce:
        dp_time = max(0.0, dp_time - 2 / 3 * compute / t.grad_accum)
    offload = 0.0
    if o.offload != "none":
        owned = math.ceil(local_param_count(cfg).trainable / (dp * dims.cp))
        transfers = owned * (4 + elt) if o.zero_stage < 3 else owned * 4 * 3 * t.grad_accum
        offload = transfers / (links.pcie_gbps * 1e9) + owned / host_adam_elements_per_s
    if o.offload == "nvme":  # + the state read and written (stage 3: the moments; Muon's stages 1-2 read and write
        # the masters again, after the matrices' updates are orthogonalized), over the node's disk shared by the
        # ranks on the node
        node = min(dims.world_size, links.gpus_per_node)
        per_element = (12 + 4 * rule_class(o).gathers_matrices) if o.zero_stage < 3 else 8
        offload += owned * per_element * 2 / (links.nvme_gbps * 1e9 / node)
    given = {"dims": dims, "links": links, "block_policy": policy, "flops_per_s": peak_flops * mfu,
             "parts": activation_parts(cfg)}  # fmt: skip
    features = sum(seconds() for _, seconds in declared(cfg, "step_time", **given))
    return compute + bubble + tp_bytes / (links.nvlink_gbps * 1e9) + dp_time + offload + features


def plan_world(cfg: JobConfig) -> int:
    """The world the plan is for: the Slurm job's ranks on a GPU layout, else the local processes."""
    return cfg.slurm.nodes * cfg.slurm.tasks_per_node if cfg.slurm.gpus_per_node else cfg.parallel.nproc


def feature_lines(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    """What each of the run's features says of it (its `describe`): in `hpc-train plan`'s report and in a
    run's start-up lines."""
    given = {"dims": dims, "local": local_param_count(cfg), "block_policy": block_policy(cfg),
             "parts": activation_parts(cfg)}  # fmt: skip
    return [line for _, describe in declared(cfg, "describe", **given) for line in describe()]


def format_estimate(cfg: JobConfig, dims: ParallelDims, plan: MemoryEstimate, gpu_mem_bytes: float) -> str:
    p, dp = cfg.parallel, dims.dp
    rows = [
        ("parameters", plan.params), ("gradients", plan.grads), ("optimizer state", plan.optimizer),
        (f"activations ({plan.microbatches_in_flight} micro-batch(es) in flight)", plan.activations),
        ("communication buffers (the most at once)", plan.comm_buffers),
        ("loss backward (one chunk, transient)", plan.loss_backward),
        ("a block's backward (transient)", plan.block_backward),
        *([("weights' casts (autocast's, the step's)", plan.weight_casts)] if plan.weight_casts else []),
        ("total at the peak", plan.total),
    ]  # fmt: skip
    cp = f" cp={p.cp} ({p.cp_mode})" if p.cp > 1 else ""
    ep = f" ep={p.ep}" if p.ep > 1 else ""
    head = (f"layout tp={p.tp} pp={p.pp} (x{p.virtual_stages} virtual) dp={dp}{cp}{ep}, micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.model.seq_len}, recompute={cfg.model.recompute}, "
            f"zero={cfg.optim.zero_stage}, offload={cfg.optim.offload}, {cfg.train.precision}")  # fmt: skip
    lines = [head, *feature_lines(cfg, dims)]
    stage = f" (worst stage: {plan.stage} of {plan.stages}, pipeline ranks from 0)" if plan.stages > 1 else ""
    lines.append(f"per rank{stage}:")
    lines += [f"  {name:<44} {value / GiB:10.3f} GiB" for name, value in rows]
    if plan.host > plan.host_features:
        what = "optimizer state, parameters, gradients" if plan.params == 0 else "optimizer state, owned gradients"
        if plan.disk:
            what = "parameters, gradients, nvme buffers" if plan.params == 0 else "the nvme offload's buffers"
        lines.append(f"  {f'in host memory ({what})':<44} {(plan.host - plan.host_features) / GiB:10.3f} GiB")
    if plan.host_copy:
        lines.append(f"  {'in host memory (the state copy)':<44} {plan.host_copy / GiB:10.3f} GiB")
    if plan.disk:
        lines.append(f"  {'on the node disk (optimizer state)':<44} {plan.disk / GiB:10.3f} GiB")
    if plan.host_features:  # each feature's line above says what
        lines.append(f"  {'in host memory (the features above)':<44} {plan.host_features / GiB:10.3f} GiB")
    verdict = "fits" if plan.total <= gpu_mem_bytes else "DOES NOT FIT"
    lines.append(f"  {verdict} in {gpu_mem_bytes / GiB:g} GiB per GPU ({100 * plan.total / gpu_mem_bytes:.0f}%)")
    return "\n".join(lines)


def describe_layout(row: dict) -> str:
    """A `search` row's layout in a few words, as `format_estimate`'s head line names one."""
    pipeline = f" (x{row['vp']} {row['schedule']})" if row["pp"] > 1 else ""
    cp = f" cp={row['cp']} ({row['cp_mode']})" if row["cp"] > 1 else ""
    return (f"tp={row['tp']} pp={row['pp']}{pipeline} dp={row['dp']}{cp}, mbs {row['mbs']} x accum "
            f"{row['grad_accum']}, recompute={row['recompute']}, zero={row['zero']}, offload={row['offload']}, "
            f"{row['optim']}")  # fmt: skip


def shell_overrides(row: dict) -> str:
    """A row's overrides as a shell takes them (a `$VAR` left for the job's node to expand)."""
    return " ".join(shlex.quote(item) for item in row["overrides"]) or "(the config's own layout)"


def format_search(rows: list[dict], limit: int = 20) -> str:
    """The first `limit` rows that fit, ranked (#); a disk column where one of them offloads to nvme."""
    shown = [r for r in rows if r["fits"]][:limit]
    disk = any(r["disk_gib"] for r in shown)
    head = f"{'#':>4} {'~':>1} {'tp':>3} {'pp':>3} {'vp':>3} {'schedule':>16} {'dp':>4} {'cp':>8} {'mbs':>4} " \
           f"{'accum':>6} {'recompute':>10} {'zero':>5} {'offload':>8} {'optim':>10} {'GiB/rank':>9} " \
           f"{'host GiB':>9} {'disk GiB' if disk else '':>{9 * disk}}{' ' * disk}{'step s':>9}  overrides"  # fmt: skip
    lines = [head]
    for rank, r in enumerate(shown, 1):
        cp = f"{r['cp']} {r['cp_mode']}" if r["cp"] > 1 else "1"
        on_disk = f"{r['disk_gib']:>9.2f} " if disk else ""
        lines.append(f"{rank:>4} {'~' if r['tie'] else '':>1} {r['tp']:>3} {r['pp']:>3} {r['vp']:>3} "
                     f"{r['schedule']:>16} {r['dp']:>4} {cp:>8} {r['mbs']:>4} {r['grad_accum']:>6} "
                     f"{r['recompute']:>10} {r['zero']:>5} {r['offload']:>8} {r['optim']:>10} "
                     f"{r['total_gib']:>9.2f} {r['host_gib']:>9.2f} {on_disk}{r['step_s']:>9.4g}  "
                     f"{shell_overrides(r)}")  # fmt: skip
    return "\n".join(lines)


def format_report(report: dict, limit: int = 20) -> str:
    """`search_report` for a reader: what was searched and what fits, the config's own layout, the ties and the
    fastest layouts that fit (`format_search`) with a legend; or, where none fits, the nearest fix
    (`format_search_fix`)."""
    rows, fit, changed = report["rows"], report["fit"], report["fit_with_rule_change"]
    host = f" and {report['host_mem_gib']:g} GiB of host a node" if report["host_mem_gib"] else ""
    shown = f"; the {min(limit, fit)} fastest below (--json lists all)" if fit else ""
    lines = [f"{_ranks(report['world'])}, {report['gpu_mem_gib']:g} GiB per GPU{host}: {report['searched']} layouts "
             f"searched, {fit or 'none'} fit{shown}", _own_line(report)]  # fmt: skip
    if report["fix"]:
        return "\n".join([*lines, format_search_fix(report)])
    if not fit:  # the config's own layout fits, outside what was searched
        return "\n".join(lines)
    ties = [(rank, r) for rank, r in enumerate(rows, 1) if r["tie"]]
    rank, fewest = min(ties, key=lambda tie: (len(tie[1]["overrides"]), tie[0]))
    lines.append(f"{len(ties)} layout(s) tie with the fastest (~: within {report['tie_within']:.0%} of its "
                 f"estimate); of those, the fewest changes: #{rank}, {shell_overrides(fewest)}")  # fmt: skip
    if changed and not report["rule_change"]:
        lines.append(f"{changed} layout(s) that fit only with 8-bit or 4-bit AdamW moments are left out: they "
                     "change the update's numerics (--allow-rule-change lists them)")  # fmt: skip
    elif changed:
        lines.append(f"{changed} of the layouts that fit change the update rule (their overrides set optim.name)")
    lines.append(format_search(rows, limit))
    on_disk = any(r["disk_gib"] for r in [r for r in rows if r["fits"]][:limit])
    disk = " disk GiB: optimizer state a rank keeps on its node's own disk (optim.offload=nvme);" * on_disk
    legend = (f"legend: #: rank by estimated step time; ~: a tie, within {report['tie_within']:.0%} of the "
              "fastest's estimate, less than the estimate's error (choose among ties by memory or by fewer "
              "changes); GiB/rank: device memory of the rank that needs the most; host GiB: host memory a rank "
              f"(offloaded state, the state copy);{disk} step s: estimated seconds a step (compute at 40% MFU, "
              "the pipeline bubble, tp and dp traffic, offload); overrides: the key=value arguments that give the "
              "layout from this config")  # fmt: skip
    return "\n".join([*lines, *textwrap.wrap(legend, 118, subsequent_indent="  ")])


def _ranks(world: int) -> str:
    return f"{world} rank{'s' * (world != 1)}"


def _own_line(report: dict) -> str:
    """Where the config's own layout stands among those searched."""
    own, fit, world = report["own"], report["fit"], report["world"]
    if "error" in own:
        return f"the config's layout: not valid at {_ranks(world)}: {own['error'].splitlines()[0]}"
    head = f"the config's layout ({describe_layout(own)}):"
    if not own["fits"]:
        return f"{head} does not fit: {_needs(report, own)}"
    if not fit:
        searched = "no searched layout does"
        return f"{head} fits at {own['total_gib']:.4g} GiB a rank, est. {own['step_s']:.4g} s a step ({searched})"
    behind = own["step_s"] / report["rows"][0]["step_s"] - 1
    tie = ", a tie (~)" if own["tie"] else ""
    return (f"{head} #{own['rank']} of {fit} that fit, est. {own['step_s']:.4g} s a step ({behind:+.1%} on the "
            f"fastest{tie}), {own['total_gib']:.4g} GiB a rank")  # fmt: skip


def _needs(report: dict, row: dict) -> str:
    """What a row needs against the limits it was searched for (host memory only where one was given)."""
    gpu, host = report["gpu_mem_gib"], report["host_mem_gib"]
    needs = f"{row['total_gib']:.4g} GiB a rank ({row['total_gib'] / gpu:.0%} of {gpu:g} GiB)"
    if host:
        node_host = row["host_gib"] * min(report["world"], report["node"])
        needs += f", {node_host:.4g} GiB of host a node ({node_host / host:.0%} of {host:g} GiB)"
    return needs


def format_search_fix(report: dict) -> str:
    """Where no layout fits: the closest, by how much, and what would fit it (`search_fix`)."""
    fix, world = report["fix"], report["world"]
    if fix["closest"] is None:
        return f"nothing fits: no layout of {_ranks(world)} passes the config's checks"
    closest = fix["closest"]
    lines = [f"nothing fits: the closest layout needs {_needs(report, closest)}: {describe_layout(closest)}",
             f"  overrides: {shell_overrides(closest)}",
             "every recompute choice, zero stage and offload was tried; what would fit it:"]  # fmt: skip
    if fix["gpu_mem_gib"]:
        lines.append(f"  a GPU of {fix['gpu_mem_gib']} GiB: --gpu-mem {fix['gpu_mem_gib']}")
    if fix["host_mem_gib"]:
        lines.append(f"  {fix['host_mem_gib']} GiB of host memory a node: --host-mem {fix['host_mem_gib']}")
    if more := fix["more_ranks"]:
        lines.append(f"  more ranks: --world {more['world']}, where {shell_overrides(more)} needs "
                     f"{more['total_gib']:.4g} GiB a rank")  # fmt: skip
    if report["fit_with_rule_change"] and not report["rule_change"]:
        lines.append(f"  --allow-rule-change: {report['fit_with_rule_change']} layout(s) fit with 8-bit or 4-bit "
                     "AdamW moments (they change the update's numerics)")  # fmt: skip
    return "\n".join(lines)


def format_fix(fix: dict | None, total: int) -> str:
    """What `hpc-train plan` says under a layout that does not fit: the nearest fix (`nearest_fix`), a GPU that
    would hold it, and --search."""
    gpu = math.ceil(total / GiB)
    lines = [f"nearest fix: {shell_overrides(fix)} fits at {fix['total_gib']:.4g} GiB a rank (est. {fix['step_s']:.4g} "
             "s a step)" if fix else "no recompute choice, zero stage or cpu offload makes this layout fit",
             f"or a GPU of {gpu} GiB (--gpu-mem {gpu}); add --search to rank every layout that fits"]  # fmt: skip
    return "\n".join(lines)
