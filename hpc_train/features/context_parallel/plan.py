"""What context parallelism adds to the planner: its exchanges' bytes per step and buffers while an attention
runs, and their time (the ring's hops overlap the attention blocks they feed; Ulysses' all-to-alls do not)."""

from __future__ import annotations

from collections.abc import Callable

from hpc_train.config import ModelConfig, ParallelConfig, TrainConfig
from hpc_train.features.context_parallel.options import ContextParallelOptions
from hpc_train.features.feature import Links, Memory, forward_passes


def attention_elements(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> tuple[int, int]:
    """Elements of one micro-batch's q (or attention output) and of its k (or v) on a rank: its shard of the
    sequence, its tp rank's heads."""
    head_dim, kv_heads = model.d_model // model.n_heads, model.n_kv_heads or model.n_heads
    tokens = train.micro_batch_size * model.seq_len // parallel.cp
    return tokens * model.n_heads // parallel.tp * head_dim, tokens * kv_heads // parallel.tp * head_dim


def traffic(*, model: ModelConfig, parallel: ContextParallelOptions, train: TrainConfig,
            block_policy: Callable[[int], str]) -> dict[str, float]:  # fmt: skip
    """Bytes a rank sends over cp per step, for every block and micro-batch (a recomputed attention
    exchanges its forward again). Ring: the k and v blocks cp - 1 hops forward and again backward, and
    their fp32 gradients cp hops. Ulysses: q, k, v and the output through an all-to-all each way, (cp-1)/cp
    of each (k and v repeated to the q heads when their heads do not split over cp)."""
    cp = parallel.cp
    e = 2 if train.precision != "fp32" else 4
    q, kv = attention_elements(model, parallel, train)
    per_stage = model.n_layers // (parallel.pp * parallel.virtual_stages)
    layers = range(model.n_layers)
    passes = forward_passes(block_policy, layers, per_stage, ("selective", "full")) + model.n_layers  # + backward
    if parallel.cp_mode == "ring":
        sent = 2 * kv * e * (cp - 1) * passes + 2 * kv * 4 * cp * model.n_layers
    else:
        kv_heads = (model.n_kv_heads or model.n_heads) // parallel.tp
        kv = kv if kv_heads % cp == 0 else q
        sent = (2 * q + 2 * kv) * e * (cp - 1) / cp * passes
    return {"cp": sent / parallel.pp * train.grad_accum}


def memory(*, model: ModelConfig, parallel: ContextParallelOptions, train: TrainConfig) -> Memory:
    """Bytes alive while one attention runs (backward, the larger): the ring's received k, v block beside its
    fp32 gradients, sent and received, and the fp32 q gradient; Ulysses' send and receive copies of q, k, v."""
    e = 4 if train.precision == "fp32" else 2
    q, kv = attention_elements(model, parallel, train)
    if parallel.cp_mode == "ring":
        return Memory(block=2 * kv * e + 4 * 2 * kv * 4 + 4 * q)
    return Memory(block=2 * (q + 2 * kv) * e)


def step_time(*, model: ModelConfig, parallel: ContextParallelOptions, train: TrainConfig, dims, links: Links,
              block_policy: Callable[[int], str], flops_per_s: float) -> float:  # fmt: skip
    """cp within a node (beside tp) over NVLink, else InfiniBand; the ring's transfers overlap the attention
    blocks it computes (6 x seq x d flops per token and layer, causal, forward and backward), Ulysses' not.
    `flops_per_s`: what one rank computes per second in the model."""
    sent = traffic(model=model, parallel=parallel, train=train, block_policy=block_policy)["cp"]
    seconds = sent / links.within_node(parallel.tp * parallel.cp)
    if parallel.cp_mode == "ring":
        tokens = train.micro_batch_size * train.grad_accum * model.seq_len  # per dp rank (all its cp ranks)
        attention = 6 * model.seq_len * model.d_model * model.n_layers * tokens * dims.dp
        seconds = max(0.0, seconds - attention / (dims.world_size * flops_per_s))
    return seconds
