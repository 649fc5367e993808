"""Memory planner: bytes per rank for a layout before anything runs, and a search over layouts.

Parameters, gradients and optimizer state are counted exactly from the model built on the meta device.
Activations use formulas derived for hpc_train's own block from its saved-tensor trace (not Megatron's
constants: SwiGLU, RMSNorm, RoPE and fused SDPA save different tensors). Per layer, in units of
T x d elements (T = micro-batch tokens on the rank, d = model width, a heads, f the SwiGLU width):

  two RMSNorms    2 x (2 fp32 tensors + an fp32 rstd of T)   input and normalized output kept in fp32
  matmul inputs   2 (the normed input of attention and of the MLP, in the activation dtype)
  q, k, v         1 + 2 kv/a                                 after RoPE, kept by SDPA
  attention out   1 (shared with wo's input), plus SDPA's fp32 logsumexp of T x a
  SwiGLU          4 f/d (w1 and w3 outputs, silu output, their product: w2's input)

Fused SDPA never keeps the s x s attention matrix, so Korthikanti et al.'s 5as/h term does not exist
here, and `selective` recompute saves only the logsumexp. `full` keeps only each block's input. Under
tensor parallelism everything after the column-parallel matmuls is divided by tp; with sequence
parallelism the norm regions are too (the gathered matmul inputs are not). The pipeline schedule keeps
several micro-batches in flight on the first stage: pp with 1F1B, (v-1)pp + 2(pp-1) + 1 chunks with
interleaved 1F1B (torch's warmup; measured 2.00 and 2.50 micro-batches for pp=2, v=2). Under tp the
vocab-parallel embedding's gradient arrives full-size before it is cut to its shard (a DTensor
behaviour), which the gradient figure includes. Validated against exact CPU measurement in
tests/test_planner.py (13 layouts, each figure within 5%). On CUDA the caching allocator adds
fragmentation on top, which is not modelled.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass

import torch

from hpc_train.config import JobConfig, ModelConfig
from hpc_train.distributed.parallelize import weights_in_training_dtype
from hpc_train.distributed.pipeline import build_stage_model, stage_ids
from hpc_train.model.gpt import flops_per_token, padded_vocab_size

TP_SHARDED = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
              "tok_embeddings.weight", "output.weight")  # fmt: skip
GiB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes on one rank (the first pipeline stage: it holds the most micro-batches in flight)."""

    params: int
    grads: int
    optimizer: int
    activations_per_microbatch: int
    microbatches_in_flight: int
    activations: int
    comm_buffers: int
    host_optimizer: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def local_param_count(cfg: JobConfig, pp_rank: int = 0) -> int:
    """Exact parameter elements held by a rank of pipeline rank `pp_rank` (its tp shard)."""
    p = cfg.parallel
    return _param_count(tuple(asdict(cfg.model).items()), p.tp, p.pp, p.virtual_stages, pp_rank)


@functools.lru_cache(maxsize=256)
def _param_count(model: tuple, tp: int, pp: int, virtual_stages: int, pp_rank: int) -> int:
    """Counted on the meta device (nothing allocated); cached because --search asks for many layouts."""
    cfg = JobConfig(model=ModelConfig(**dict(model)))
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_stages = tp, pp, virtual_stages
    total = 0
    with torch.device("meta"):
        for stage in stage_ids(pp_rank, pp, virtual_stages):
            for name, param in build_stage_model(cfg, stage, pp * virtual_stages, tp).named_parameters():
                total += param.numel() // tp if name.endswith(TP_SHARDED) else param.numel()
    return total


def activation_bytes(cfg: JobConfig, pp_rank: int = 0) -> int:
    """Bytes saved for backward by one micro-batch on a rank of pipeline rank `pp_rank`."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, sp = p.tp, p.sequence_parallel and p.tp > 1
    e = 2 if weights_in_training_dtype(cfg) else 4  # activation element size
    tokens, d, a = t.micro_batch_size * m.seq_len, m.d_model, m.n_heads
    kv, f, head_dim = m.n_kv_heads or m.n_heads, m.ffn_size(), m.d_model // m.n_heads
    norm_tokens = tokens // tp if sp else tokens

    def norm() -> int:
        return 2 * norm_tokens * d * 4 + norm_tokens * 4

    layer = (
        2 * norm()
        + 2 * tokens * d * e
        + tokens * d * e * (1 + 2 * kv / a) // tp
        + tokens * d * e // tp
        + (0 if m.recompute == "selective" else tokens * a * 4 // tp)
        + 4 * tokens * f * e // tp
    )
    block_input = norm_tokens * d * e
    num_stages = p.pp * p.virtual_stages
    per_stage = m.n_layers // num_stages
    total = 0
    for stage in stage_ids(pp_rank, p.pp, p.virtual_stages):
        for i in range(per_stage):
            chosen = m.recompute != "none" and i % m.recompute_every == 0
            chosen = chosen and (m.recompute_first is None or i < m.recompute_first)
            total += block_input if chosen and m.recompute == "full" else int(layer)
        total += 2 * m.seq_len * head_dim * 4  # the RoPE tables, once per stage
        if stage == 0:
            total += tokens * 8  # token ids kept by the embedding
        if stage == num_stages - 1:
            vocab = padded_vocab_size(m, tp)
            total += norm() + tokens * d * e + tokens * vocab // tp * 4 + tokens * 8  # head + fp32 log-softmax
    return total


def in_flight(cfg: JobConfig) -> int:
    """Micro-batch chunks the first pipeline stage holds at its peak."""
    p, micro = cfg.parallel, cfg.train.grad_accum
    if p.pp == 1:
        return 1
    if p.virtual_stages == 1:
        return min(p.pp, micro)
    chunks = (p.virtual_stages - 1) * p.pp + 2 * (p.pp - 1) + 1
    return min(chunks, micro * p.virtual_stages) / p.virtual_stages  # activation_bytes sums all local chunks


def estimate(cfg: JobConfig, dp: int) -> MemoryEstimate:
    o = cfg.optim
    n = local_param_count(cfg)
    param_bytes = n * (2 if weights_in_training_dtype(cfg) else 4)
    if o.zero_stage == 1:
        shard = math.ceil(n / dp)
        grads = 4 * n + 4 * shard  # fp32 buckets and the reduced slice
        if not o.overlap_grad_reduce:  # at the end of backward the parameters' own grads are still there;
            grads += param_bytes  # with overlap each bucket has taken (and freed) them during backward
        optimizer = 12 * shard
    else:
        grads, optimizer = 4 * n, 8 * n
    if cfg.parallel.tp > 1 and not o.overlap_grad_reduce:  # the vocab-parallel embedding's gradient arrives
        # full-size (DTensor) and is cut to its shard at the reduction (with overlap, already inside backward)
        vocab_rows = padded_vocab_size(cfg.model, cfg.parallel.tp)
        grads += vocab_rows * cfg.model.d_model * 4 * (cfg.parallel.tp - 1) // cfg.parallel.tp
    host = optimizer if o.offload == "cpu" else 0
    per_micro = activation_bytes(cfg)
    flight = in_flight(cfg)
    activations = int(per_micro * flight)
    comm = int(2 * o.bucket_mb * 2**20)  # a flat bucket being reduced and its gathered copy
    if o.overlap_grad_reduce and o.zero_stage == 0:  # every bucket's flat copy stays in flight to the step's end
        comm = max(comm, 4 * n)
    device_optimizer = optimizer - host
    total = param_bytes + grads + device_optimizer + activations + comm
    return MemoryEstimate(param_bytes, grads, device_optimizer, per_micro, math.ceil(flight), activations, comm,
                          host, total)  # fmt: skip


def search(cfg: JobConfig, world: int, gpu_mem_bytes: float, peak_flops: float) -> list[dict]:
    """Every layout of `world` ranks (tp within a node of slurm.gpus_per_node or 8, pp, virtual stages,
    micro-batch size at a fixed global batch, recompute, zero stage, offload) that passes validation,
    with its memory and estimated step time; those that fit first, fastest first."""
    from copy import deepcopy

    from hpc_train.config import ConfigError, validate

    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum * (world // (cfg.parallel.tp * cfg.parallel.pp))
    node = cfg.slurm.gpus_per_node or 8
    choices = itertools.product(
        [x for x in (1, 2, 4, 8) if x <= node],  # tp
        (1, 2, 4, 8, 16),  # pp
        (1, 2),  # virtual stages
        (1, 2, 4, 8),  # micro-batch size
        ("none", "selective", "full"),  # recompute
        ((0, "none"), (1, "none"), (1, "cpu")),  # zero stage, offload
    )
    rows = []
    for tp, pp, vp, mbs, recompute, (zero, offload) in choices:
        if world % (tp * pp) or (vp > 1 and pp == 1) or global_batch % (mbs * (world // (tp * pp))):
            continue
        dp = world // (tp * pp)
        c = deepcopy(cfg)
        c.parallel.tp, c.parallel.pp, c.parallel.dp, c.parallel.virtual_stages = tp, pp, None, vp
        c.parallel.schedule = "interleaved_1f1b" if vp > 1 else "1f1b"
        c.parallel.sequence_parallel = tp > 1
        c.train.micro_batch_size, c.train.grad_accum, c.train.global_batch_size = mbs, global_batch // (mbs * dp), None
        c.model.recompute, c.optim.zero_stage, c.optim.offload = recompute, zero, offload
        try:
            validate(c, world, check_paths=False)
        except ConfigError:
            continue
        plan = estimate(c, dp)
        rows.append({
            "tp": tp, "pp": pp, "vp": vp, "dp": dp, "mbs": mbs, "grad_accum": c.train.grad_accum,
            "recompute": recompute, "zero": zero, "offload": offload, "total_gib": plan.total / GiB,
            "fits": plan.total <= gpu_mem_bytes, "step_s": step_time_estimate(c, dp, peak_flops),
        })  # fmt: skip
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"], r["total_gib"]))


def step_time_estimate(cfg: JobConfig, dp: int, peak_flops: float, mfu: float = 0.4,
                       nvlink_gbps: float = 300.0, ib_gbps: float = 25.0) -> float:  # fmt: skip
    """A simple model to rank layouts: compute at `mfu` of peak (x4/3 with full recompute), the pipeline
    bubble (pp-1)/(m v), tp communication over NVLink and dp gradient reduction over InfiniBand (GB/s),
    less what overlap_grad_reduce hides behind backward."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * t.grad_accum * m.seq_len  # per dp rank
    world = p.tp * p.pp * dp
    compute = tokens * dp * flops_per_token(m) / (world * peak_flops * mfu)
    if m.recompute == "full":
        compute *= 4 / 3
    bubble = compute * (p.pp - 1) / (t.grad_accum * p.virtual_stages)
    elt = 2 if t.precision != "fp32" else 4
    tp_bytes = 0 if p.tp == 1 else 4 * m.n_layers / p.pp * tokens * m.d_model * elt * (p.tp - 1) / p.tp
    n = local_param_count(cfg)
    dp_time = (0 if dp == 1 else 2 * n * 4 * (dp - 1) / dp) / (ib_gbps * 1e9)
    if cfg.optim.overlap_grad_reduce:  # hidden behind the last micro-batch's backward (2/3 of its compute)
        dp_time = max(0.0, dp_time - 2 / 3 * compute / t.grad_accum)
    return compute + bubble + tp_bytes / (nvlink_gbps * 1e9) + dp_time


def plan_world(cfg: JobConfig) -> int:
    """The world the plan is for: the Slurm job's ranks on a GPU layout, else the local processes."""
    return cfg.slurm.nodes * cfg.slurm.tasks_per_node if cfg.slurm.gpus_per_node else cfg.parallel.nproc


def format_estimate(cfg: JobConfig, dp: int, plan: MemoryEstimate, gpu_mem_bytes: float) -> str:
    p = cfg.parallel
    rows = [
        ("parameters", plan.params), ("gradients", plan.grads), ("optimizer state", plan.optimizer),
        (f"activations ({plan.microbatches_in_flight} micro-batch(es) in flight)", plan.activations),
        ("communication buffers", plan.comm_buffers), ("total", plan.total),
    ]  # fmt: skip
    head = (f"layout tp={p.tp} pp={p.pp} (x{p.virtual_stages} virtual) dp={dp}, micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.model.seq_len}, recompute={cfg.model.recompute}, "
            f"zero={cfg.optim.zero_stage}, offload={cfg.optim.offload}, {cfg.train.precision}")  # fmt: skip
    lines = [head, "per rank (first pipeline stage):"]
    lines += [f"  {name:<44} {value / GiB:10.3f} GiB" for name, value in rows]
    if plan.host_optimizer:
        lines.append(f"  {'optimizer state in host memory':<44} {plan.host_optimizer / GiB:10.3f} GiB")
    verdict = "fits" if plan.total <= gpu_mem_bytes else "DOES NOT FIT"
    lines.append(f"  {verdict} in {gpu_mem_bytes / GiB:.0f} GiB per GPU ({100 * plan.total / gpu_mem_bytes:.0f}%)")
    return "\n".join(lines)


def format_search(rows: list[dict], limit: int = 20) -> str:
    head = f"{'tp':>3} {'pp':>3} {'vp':>3} {'dp':>4} {'mbs':>4} {'accum':>6} {'recompute':>10} {'zero':>5} " \
           f"{'offload':>8} {'GiB/rank':>9} {'fits':>5} {'step s (est.)':>14}"  # fmt: skip
    lines = [head]
    for r in rows[:limit]:
        lines.append(f"{r['tp']:>3} {r['pp']:>3} {r['vp']:>3} {r['dp']:>4} {r['mbs']:>4} {r['grad_accum']:>6} "
                     f"{r['recompute']:>10} {r['zero']:>5} {r['offload']:>8} {r['total_gib']:>9.2f} "
                     f"{'yes' if r['fits'] else 'no':>5} {r['step_s']:>14.3f}")  # fmt: skip
    return "\n".join(lines)
