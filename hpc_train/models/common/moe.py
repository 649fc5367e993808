"""Mixture of experts for the decoder skeleton's feed-forward (`model.moe`): a router picks `top_k` of
`num_experts` SwiGLU experts per token, optional shared experts see every token (DeepSeek), and the experts
run as one grouped GEMM (`torch._grouped_mm`) over the tokens sorted by expert (each expert's group padded
to the kernel's alignment), or a loop over experts.

Load balancing: a Switch/GShard auxiliary loss (`aux_loss_coef`), whose gradient is injected in backward at
the layer's output (Megatron's approach), so it needs no path through the model's loss or the pipeline; and
DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the scores for the selection only,
moved after each optimizer step towards the mean load (`update_expert_bias`). Dropless unless
`capacity_factor` caps each expert's tokens; the dropped assignments are counted.

Expert parallelism (`parallel.ep`, features/moe/expert_parallel.py) leaves each rank of an ep group
1/ep of the routed experts (a DTensor shard) and sets the layer's `ep_group`: the router still runs on the
rank's own tokens, whose rows go to the ranks holding their experts and come back with two all-to-alls of
uneven splits (`dispatch_to_experts`), so routing, statistics and results are those of one rank with every expert.
Under sequence and context parallelism a rank routes only its own slice of the sequence; the router and
experts read their weights through `local_summed` (their gradients are partial sums over tp), and the aux
loss sums the load counts over the layer's `token_group`.

Each MoE layer accumulates its step's statistics (tokens per expert, aux loss, dropped assignments) over the
training forwards of a step (not evaluation, not a recompute in backward); `step_stats` collects them."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.models.common.all_to_all import all_to_all
from hpc_train.placement import local_summed

STATS = ("load_max_mean", "aux_loss", "dropped")  # per layer and step, in the metrics record


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    return cfg.moe.num_experts > 0 and layer_id >= cfg.moe.first_dense_layers


def expert_hidden(cfg: ModelConfig, dense_hidden: int) -> int:
    return cfg.moe.expert_ffn_hidden or dense_hidden


def validate_moe(cfg: ModelConfig) -> None:
    """model.moe's own rules, one error naming every problem and its fix."""
    m, problems = cfg.moe, []
    if m.num_experts < 0:
        problems.append(f"model.moe.num_experts={m.num_experts} must be >= 0 (0 = a dense model)")
    if m.num_experts > 0:
        if not 1 <= m.top_k <= m.num_experts:
            problems.append(f"model.moe.top_k={m.top_k} must be in 1..model.moe.num_experts={m.num_experts}")
        if m.score_func not in ("softmax", "sigmoid"):
            problems.append(f"model.moe.score_func={m.score_func!r} is not one of softmax, sigmoid")
        if m.top_k == 1 and m.norm_topk_prob and not m.aux_loss_coef:
            problems.append("model.moe.norm_topk_prob=true with top_k=1 makes every gate 1: the language-model "
                            "loss gives the router no gradient and, with aux_loss_coef=0, nothing trains it; "
                            "leave norm_topk_prob unset (top_k=1: the raw gate) or set aux_loss_coef > 0")  # fmt: skip
        if m.first_dense_layers < 0 or m.first_dense_layers >= cfg.n_layers:
            problems.append(f"model.moe.first_dense_layers={m.first_dense_layers} must be in 0..model.n_layers-1="
                            f"{cfg.n_layers - 1} (at least one MoE layer)")  # fmt: skip
    if m.num_shared_experts < 0:
        problems.append(f"model.moe.num_shared_experts={m.num_shared_experts} must be >= 0")
    for key in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
        value = getattr(m, key)
        if not math.isfinite(value) or value < 0:
            problems.append(f"model.moe.{key}={value} must be a finite number >= 0")
    if m.expert_ffn_hidden is not None and m.expert_ffn_hidden <= 0:
        problems.append(f"model.moe.expert_ffn_hidden={m.expert_ffn_hidden} must be > 0 (or left out)")
    if m.num_experts > 0 and m.capacity_factor > 0 and m.capacity_factor * m.top_k < 1 / m.num_experts:
        problems.append(f"model.moe.capacity_factor={m.capacity_factor} leaves no expert any token; use >= 1")
    if problems:
        raise ConfigError("\n".join(problems))


class AuxLossGrad(torch.autograd.Function):
    """Returns `output` unchanged; in backward, `aux_loss` gets the gradient `scale` (the step's loss scale
    over its micro-batches, as the main loss has), so the load-balancing loss trains the router without being
    added to the model's loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_loss, scale = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype), None


GROUP_ALIGN_BYTES = 16  # each expert's rows padded to a multiple of 16 bytes' worth (bf16: 8 rows, fp32: 4)


def group_align(element_bytes: int) -> int:
    """Rows per alignment unit of the grouped GEMM's token groups for this element size."""
    return max(1, GROUP_ALIGN_BYTES // element_bytes)


def padded_length(rows: int, experts: int, align: int) -> int:
    """The padded layout's rows: each group can need align - 1 more, and the whole is a multiple of align
    (the last group aligned too). Fixed by the shapes alone (the planner counts it too)."""
    return -(-(rows + experts * (align - 1)) // align) * align


def grouped_mm_runs(x: torch.Tensor, *widths: int) -> bool:
    """Whether `torch._grouped_mm` takes these operands here: present, every row stride a multiple of 16
    bytes, and on CUDA in bf16 on compute capability 9.0 or newer (where its kernel was measured, on an
    H200; the token groups are padded for it by `grouped_swiglu`). On the CPU any float dtype; elsewhere
    the loop runs."""
    if not hasattr(torch, "_grouped_mm") or any(w * x.element_size() % 16 for w in widths):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def padded_groups(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of `rows` rows (sorted by expert, `counts` each) goes when every expert's group starts at a
    multiple of `align` rows (the grouped GEMM kernel's alignment, its weight gradient's too), and the
    groups' end offsets. The padded length is fixed by the shapes alone (rows + experts x (align - 1), up to
    a multiple of align), so nothing is read from the device; the last group takes the slack, so every row
    belongs to a group and the padding rows, zeros, give zeros. Returns (destination row of each row, int32
    offsets, length)."""
    experts = counts.numel()
    length = padded_length(rows, experts, align)
    padded = (counts + align - 1) // align * align
    padded[-1] += length - padded.sum()
    starts, padded_starts = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
    expert_of = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts, output_size=rows)
    destination = padded_starts[expert_of] + torch.arange(rows, device=counts.device) - starts[expert_of]
    return destination, torch.cumsum(padded, 0, dtype=torch.int32), length


class MoveRows(torch.autograd.Function):
    """Rows to and from the padded layout, keeping only `destination` for backward: with `length`, row i of
    `x` goes to row destination[i] of a zero buffer of `length` rows; without, row i of the result is row
    destination[i] of `x`. Each one's backward is the other's move (the indices are unique), where torch's
    index_copy would keep `x` as well and an indexing gather accumulates its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, destination: torch.Tensor, length: int | None = None) -> torch.Tensor:
        ctx.save_for_backward(destination)
        ctx.rows, ctx.pads = x.shape[0], length is not None
        if length is None:
            return x.index_select(0, destination)
        return x.new_zeros(length, x.shape[-1]).index_copy_(0, destination, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (destination,) = ctx.saved_tensors
        if ctx.pads:
            return grad.index_select(0, destination), None, None
        return grad.new_zeros(ctx.rows, grad.shape[-1]).index_copy_(0, destination, grad), None, None


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
    """SwiGLU of each expert on its rows of `x` (sorted by expert, `counts` rows each), one grouped GEMM a
    projection, over the rows laid out in groups padded to the kernel's alignment (`padded_groups`): the
    same code on CUDA and on the CPU, with no read of the counts to the host. w1, w3: (experts, d, h);
    w2: (experts, h, d)."""
    align = group_align(x.element_size())
    destination, offsets, length = padded_groups(counts, x.shape[0], align)
    padded = MoveRows.apply(x, destination, length)
    hidden = F.silu(torch._grouped_mm(padded, w1, offs=offsets)) * torch._grouped_mm(padded, w3, offs=offsets)
    return MoveRows.apply(torch._grouped_mm(hidden, w2, offs=offsets), destination)


def looped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
    """The same as `grouped_swiglu`, one expert at a time (the fallback; reads the counts to the host)."""
    parts = x.split(counts.tolist())
    # unbind once: indexing w[e] per expert would make each backward write a whole zero-filled w gradient
    w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    outs = [(F.silu(part @ w1s[e]) * (part @ w3s[e])) @ w2s[e] for e, part in enumerate(parts)]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def dispatch_to_experts(experts: Experts, rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup):
    """Expert parallelism: `rows` (sorted by global expert, `counts` rows each) sent to the ep ranks holding
    their experts (rank j holds the j-th 1/ep of them), run there grouped by expert, and the results sent
    back in the rows' order. The counts are exchanged first (equal splits), so every rank knows its splits:
    read to the host once (both directions' split sizes at once), the only read of an MoE layer."""
    ep, device = dist.get_world_size(group), rows.device.type
    if torch.is_autocast_enabled(device):  # sent in the compute dtype
        rows = rows.to(torch.get_autocast_dtype(device))
    held = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # (source rank, held expert): rows sent here
    received = received.view(ep, held)
    # the split sizes, the one read from the device: the all-to-alls take them as host integers
    send, recv = torch.stack([counts.view(ep, held).sum(1), received.sum(1)]).tolist()
    arrived = all_to_all(rows, recv, send, group)  # by source rank, then expert: regrouped by expert
    expert_of = (
        torch.arange(held, device=rows.device).repeat(ep).repeat_interleave(received.flatten(), output_size=sum(recv))
    )
    order = torch.argsort(expert_of, stable=True)
    out = experts(arrived[order], received.sum(0))
    return all_to_all(out[torch.argsort(order)], send, recv, group)


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked weights (what a grouped GEMM takes)."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, grouped: bool = True):
        super().__init__()
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # down (residual projection)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, d) sorted by expert, `counts` rows per expert."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x, weights = x.to(dtype), [local_summed(w).to(dtype) for w in (self.w1, self.w3, self.w2)]
        if self.grouped and grouped_mm_runs(x, x.shape[-1], self.w1.shape[-1]):
            return grouped_swiglu(x, counts, *weights)
        return looped_swiglu(x, counts, *weights)


def normalizes_gates(cfg: ModelConfig) -> bool:
    """model.moe.norm_topk_prob resolved: given, or renormalized gates exactly when top_k > 1."""
    m = cfg.moe
    return m.top_k > 1 if m.norm_topk_prob is None else m.norm_topk_prob


class Router(nn.Module):
    """Token -> top_k experts and their gates, in fp32: the chosen scores, renormalized to sum to 1 where
    `normalize`. `expert_bias` (a buffer, checkpointed) shifts the selection only, never the gates
    (DeepSeek-V3)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, score_func: str, normalize: bool = True):
        super().__init__()
        self.top_k, self.score_func, self.normalize = top_k, score_func, normalize
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, d) -> scores (tokens, experts), chosen experts and their gates (tokens, top_k)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), local_summed(self.gate.weight).float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        gates = scores.gather(1, chosen)
        return scores, chosen, gates / gates.sum(-1, keepdim=True) if self.normalize else gates


def combine(routed: torch.Tensor, order: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Each token's gate-weighted sum of its experts' outputs, in fp32. `routed` holds the kept assignments
    in `order` (sorted by expert); they go back to token order by one gather, whose backward keeps only the
    index (a dropped assignment reads a zero row), then a multiply and a sum per token. Scattering the
    weighted rows with index_add_ instead keeps a second fp32 copy of them for backward."""
    tokens, top_k = gates.shape
    slot = torch.empty(tokens * top_k, dtype=torch.long, device=routed.device)
    if order.numel() < slot.numel():  # capacity drops: the missing assignments read an appended zero row
        slot.fill_(order.numel())
        routed = torch.cat([routed, routed.new_zeros(1, routed.shape[-1])])
    slot[order] = torch.arange(order.numel(), device=routed.device)
    rows = routed[slot].view(tokens, top_k, -1)
    return (rows.float() * gates.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """The feed-forward of an MoE block: router, routed experts, optional shared experts (a SwiGLU `shared`
    of num_shared_experts x the expert width). Accumulates the step's statistics while training."""

    def __init__(self, cfg: ModelConfig, shared_mlp: type[nn.Module], dense_hidden: int):
        super().__init__()
        m = cfg.moe
        hidden = expert_hidden(cfg, dense_hidden)
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.aux_loss_coef, self.capacity_factor = m.aux_loss_coef, m.capacity_factor
        self.router = Router(cfg.d_model, m.num_experts, m.top_k, m.score_func, normalizes_gates(cfg))
        self.experts = Experts(m.num_experts, cfg.d_model, hidden, m.grouped_mm)
        self.shared = shared_mlp(cfg.d_model, hidden * m.num_shared_experts, False) if m.num_shared_experts else None
        self.aux_grad_scale: float | torch.Tensor = 1.0  # the main loss's scale per micro-batch (set each step)
        self.stats: torch.Tensor | None = None  # (tokens per expert..., aux loss, dropped), summed over the step
        self.unrecorded_forwards = 0  # training forwards left out of the statistics (a pipeline's shape inference)
        self.ep_group: dist.ProcessGroup | None = None  # expert parallelism: the ranks the experts are split over
        # context and sequence parallelism: the ranks that hold the rest of this rank's samples' tokens
        self.token_group: dist.ProcessGroup | None = None

    def capacity(self, tokens: int) -> int | None:
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        tokens = x.shape[0]
        scores, chosen, gates = self.router(x)
        experts = chosen.flatten()
        order = torch.argsort(experts, stable=True)  # assignments grouped by expert, in token order within
        # tokens per expert (bincount on CUDA reads its input's maximum back to size its output)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, experts, torch.ones_like(experts)
        )
        kept_counts, dropped = counts, counts.new_zeros(())
        capacity = self.capacity(tokens)
        if capacity is not None:  # an expert's assignments past its capacity (the later tokens) are dropped
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[experts[order]]
            keep = position < capacity
            order, kept_counts = order[keep], counts.clamp(max=capacity)
            dropped = (~keep).sum()
        token_of = order // self.top_k
        routed = self.routed_experts(x[token_of], kept_counts)
        out = combine(routed, order, gates).to(x.dtype).view_as(hidden)
        if self.shared is not None:  # on the (batch, sequence, d) input: tp's sequence-parallel layout
            out = out + self.shared(hidden)
        aux = self.aux_loss(scores, counts, tokens)
        if aux is not None and torch.is_grad_enabled():
            scale = torch.as_tensor(self.aux_grad_scale, device=x.device, dtype=torch.float32)
            out = AuxLossGrad.apply(out, aux, scale)
        self.record(counts, aux, dropped)
        return out

    def aux_loss(self, scores: torch.Tensor, counts: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """Switch/GShard's balance loss of the micro-batch, coef x experts x sum_i f_i P_i: f_i the fraction of
        assignments to expert i, P_i its mean score (scores normalized per token): 1 x coef when perfectly
        balanced. With the samples' tokens split over `token_group`, f_i is the whole micro-batch's (the
        counts summed over it) and P_i this rank's part of the mean: the ranks' losses sum to the micro-batch's
        (Megatron's sequence-partition group)."""
        if not self.aux_loss_coef:
            return None
        if self.token_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.token_group)
            tokens *= dist.get_world_size(self.token_group)
        fraction = counts.float() / (tokens * self.top_k)
        probs = (scores / scores.sum(-1, keepdim=True)).sum(0) / tokens
        return self.aux_loss_coef * self.num_experts * (fraction * probs).sum()

    @torch.compiler.disable
    def routed_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The routed experts on `rows` (sorted by expert, `counts` each), here or, under expert parallelism,
        where they are held. Eager inside a compiled block: the grouped GEMM's traced form takes bf16 only,
        and expert parallelism's split sizes are host integers that would change the shapes every step."""
        if self.ep_group is None:
            return self.experts(rows, counts)
        return dispatch_to_experts(self.experts, rows, counts, self.ep_group)

    def record(self, counts: torch.Tensor, aux: torch.Tensor | None, dropped: torch.Tensor) -> None:
        """Adds this forward to the step's statistics: only training forwards, not a recompute in backward
        (a compiled block's recompute runs no Python)."""
        if not (self.training and torch.is_grad_enabled()):
            return
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        if self.unrecorded_forwards:
            self.unrecorded_forwards -= 1
            return
        aux = aux.detach() if aux is not None else counts.new_zeros((), dtype=torch.float32)
        row = torch.cat([counts.float(), aux.float().reshape(1), dropped.float().reshape(1)])
        self.stats = row if self.stats is None else self.stats + row


def moe_layers(chunks: list[nn.Module]) -> Iterator[tuple[str, MoE]]:
    """(block name `layers.<i>`, its MoE) of every MoE block in these stages."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, MoE):
                yield name.removesuffix(".mlp"), module


def skip_shape_inference(chunks: list[nn.Module]) -> None:
    """A pipeline schedule's first training step, and its first after an evaluation, runs one extra forward per
    stage to infer its shapes (on the first stage's real micro-batch, on uninitialized tensors after it): left
    out of the statistics."""
    for _, moe in moe_layers(chunks):
        moe.unrecorded_forwards = 1


def set_aux_grad_scale(chunks: list[nn.Module], scale: float | torch.Tensor) -> None:
    for _, moe in moe_layers(chunks):
        moe.aux_grad_scale = scale


def take_stats(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Each MoE layer's statistics of the step (left on the device), which start again from zero."""
    out = {}
    for name, moe in moe_layers(chunks):
        if moe.stats is not None:
            out[name] = moe.stats
        moe.stats = None
    return out


def token_group(chunks: list[nn.Module]) -> dist.ProcessGroup | None:
    """The ranks that hold the rest of these layers' samples' tokens (context and sequence parallelism)."""
    return next((moe.token_group for _, moe in moe_layers(chunks)), None)


def update_expert_bias(moe: MoE, loads: torch.Tensor, rate: float, skipped: torch.Tensor | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free step: each expert's bias moves by `rate` towards the mean load
    (`loads`: the step's tokens per expert over the whole data-parallel batch); not when `skipped` (a step
    whose update was dropped, decided on the device)."""
    step = torch.sign(loads.mean() - loads) * rate
    if skipped is not None:
        step = torch.where(skipped, torch.zeros_like(step), step)
    with torch.no_grad():
        moe.router.expert_bias.add_(step)


def reset_expert_bias(model: nn.Module) -> None:
    """The routing biases start at zero (after a meta-device build's `to_empty`)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Router):
                module.expert_bias.zero_()


def moe_block_weights(cfg: ModelConfig, dense_hidden: int, active: bool) -> int:
    """Matmul weight elements of one MoE feed-forward: the router, the experts (only top_k when `active`,
    what one token multiplies), the shared experts."""
    m, d = cfg.moe, cfg.d_model
    hidden = expert_hidden(cfg, dense_hidden)
    experts = m.top_k if active else m.num_experts
    return d * m.num_experts + 3 * d * hidden * (experts + m.num_shared_experts)
