"""Optimizers over the data-parallel group: plain data parallelism (zero_stage 0) and ZeRO-1, Megatron's
distributed optimizer (zero_stage 1).

ZeRO-1: local gradients (each already in its parameter's tensor-parallel placement) are copied into
contiguous fp32 buckets; each bucket is reduce-scattered over dp so rank r receives the averaged
gradients of its contiguous 1/dp slice. Rank r keeps fp32 master weights and AdamW moments for that
slice only (12 bytes per owned element, nothing more), updates it with torch's AdamW (the same
arithmetic as zero_stage 0), casts it to the parameters' dtype and all-gathers each bucket back into
the model. With `offload="cpu"` the master weights and moments live in host memory and the update runs
there (ZeRO-Offload). Stage 2 would keep only the owned slice of the gradient buckets after the
reduce-scatter; the bucket layout here is the seam for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import (
    BucketedReduction,
    GradGroups,
    bucketize,
    fix_grad_placements,
    flat_allreduce,
    is_tp_sharded,
    local,
)
from hpc_train.train.optim import adamw

# torch >= 2.13 names these *_single for gloo; older releases only have the *_tensor names
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class DataParallelOptimizer:
    """zero_stage 0: every dp rank averages the full gradients (all-reduce) and runs the same AdamW."""

    def __init__(self, params: list[nn.Parameter], cfg: OptimConfig, dp_group: dist.ProcessGroup):
        self.params, self.dp_group = params, dp_group
        self.optimizer = adamw(params, cfg, params[0].device)
        buckets = [[params[i] for i in b] for b in bucketize([local(p) for p in params], int(cfg.bucket_mb * 2**20))]
        self.reduction = BucketedReduction(buckets, self._launch, cfg.overlap_grad_reduce)

    def _launch(self, bucket: int) -> Callable[[], None]:
        params = self.reduction.buckets[bucket]
        fix_grad_placements(params)
        grads = [local(p.grad) for p in params if p.grad is not None]
        if dist.get_world_size(self.dp_group) == 1 or not grads:
            return lambda: None
        return flat_allreduce(grads, self.dp_group)

    def begin_step(self, micro_batches: int) -> None:
        self.reduction.begin_step(micro_batches)

    def reduce_gradients(self) -> None:
        """Average every gradient over dp (each in its parameter's tp placement first)."""
        self.reduction.finish()

    def grad_groups(self) -> GradGroups:
        grads = [(p.grad, local(p.grad)) for p in self.params if p.grad is not None]
        return GradGroups(
            tp_sharded=[g for d, g in grads if is_tp_sharded(d)],
            tp_replicated=[g for d, g in grads if not is_tp_sharded(d)],
            dp_sharded=False,
        )

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of the AdamW moments this rank holds (its tp shards)."""
        return moment_bytes(self.optimizer)

    def grad_buffer_bytes(self) -> int:
        return 0  # reduces the parameters' own gradients in place

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per parameter, in the parameter's own shape and placement: exp_avg, exp_avg_sq."""
        return [{k: self.optimizer.state[p][k] for k in MOMENTS} for p in self.params]

    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        for p, state in zip(self.params, states, strict=True):
            moments = {k: state[k].to(p.dtype).clone() for k in MOMENTS}
            self.optimizer.state[p] = {"step": adam_step_tensor(step, self.optimizer, p), **moments}


MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = (*MOMENTS, "master")  # what a checkpoint keeps per parameter (master only with ZeRO-1)


def moment_bytes(optimizer: torch.optim.AdamW) -> int:
    return sum(local(t).nbytes for s in optimizer.state.values() for k, t in s.items() if k in MOMENTS)


def adam_step_tensor(step: int, optimizer: torch.optim.AdamW, p: torch.Tensor) -> torch.Tensor:
    """AdamW's per-parameter step counter as torch keeps it (on the device when fused)."""
    fused = optimizer.param_groups[0].get("fused")
    return torch.tensor(float(step), dtype=torch.float32, device=local(p).device if fused else "cpu")


def _flat_slice(t: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    return local(t).reshape(-1)[offset : offset + numel].float()


def like_param(p: nn.Parameter, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (this rank's part) as a tensor laid out like `p`: a DTensor when `p` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local_tensor, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local_tensor


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's local elements start in the bucket
    numel: int  # padded to a multiple of dp
    grad: torch.Tensor  # fp32, the whole bucket (this rank's local gradients, then reduce-scattered)
    grad_shard: torch.Tensor  # fp32, this rank's 1/dp slice after the reduce-scatter
    runs: list[_Run] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.grad_shard.numel()


@dataclass
class _Run:
    """A stretch of the owned slice lying inside one parameter: one fp32 master view for AdamW."""

    shard_start: int  # offset in the bucket's owned slice
    numel: int
    param: nn.Parameter  # the model parameter it lies in
    param_offset: int  # where it starts in that parameter's flattened local tensor
    master: nn.Parameter  # view into the master buffer
    decay: bool
    tp_sharded: bool


class ZeroOptimizer:
    """zero_stage 1: optimizer state sharded over the data-parallel group (see the module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: OptimConfig,
        dp_group: dist.ProcessGroup,
    ):
        self.params, self.dp_group = params, dp_group
        self.dp, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.device = local(params[0]).device
        self.state_device = torch.device("cpu") if cfg.offload == "cpu" else self.device
        self.buckets = self._make_buckets(params, int(cfg.bucket_mb * 2**20))
        self.reduction = BucketedReduction([b.params for b in self.buckets], self._launch, cfg.overlap_grad_reduce)
        self.master = self._make_runs()
        decay = [r.master for b in self.buckets for r in b.runs if r.decay]
        no_decay = [r.master for b in self.buckets for r in b.runs if not r.decay]
        self.optimizer = adamw(decay + no_decay, cfg, self.state_device, decay_params=set(map(id, decay)))

    def _make_buckets(self, params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        buckets = []
        for indices in bucketize([local(p) for p in params], bucket_bytes, element_bytes=4):
            group = [params[i] for i in indices]
            offsets = [0]
            for p in group:
                offsets.append(offsets[-1] + local(p).numel())
            numel = math.ceil(offsets[-1] / self.dp) * self.dp
            grad = torch.zeros(numel, dtype=torch.float32, device=self.device)
            shard = torch.zeros(numel // self.dp, dtype=torch.float32, device=self.device)
            buckets.append(_Bucket(group, offsets[:-1], numel, grad, shard))
        return buckets

    def _make_runs(self) -> torch.Tensor:
        """Cut the owned slice of every bucket at parameter boundaries; return the fp32 master weights
        (one buffer, filled from the parameters), each run's master a view into it."""
        spans = []  # (bucket, parameter, its start in the bucket, owned begin, owned end)
        for bucket in self.buckets:
            lo, hi = self.dp_rank * bucket.shard_numel, (self.dp_rank + 1) * bucket.shard_numel
            for p, start in zip(bucket.params, bucket.offsets, strict=True):
                begin, end = max(lo, start), min(hi, start + local(p).numel())
                if begin < end:
                    spans.append((bucket, p, start, begin, end))
        owned = sum(end - begin for *_, begin, end in spans)
        master = torch.empty(owned, dtype=torch.float32, device=self.state_device)
        offset = 0
        for bucket, p, start, begin, end in spans:
            view = master[offset : offset + end - begin]
            view.copy_(local(p).detach().reshape(-1)[begin - start : end - start])
            lo = self.dp_rank * bucket.shard_numel
            run_master = nn.Parameter(view)  # shares the master buffer's storage
            bucket.runs.append(_Run(begin - lo, end - begin, p, begin - start, run_master, p.ndim >= 2,
                                    is_tp_sharded(p)))  # fmt: skip
            offset += end - begin
        return master

    def _launch(self, index: int) -> Callable[[], None]:
        """Copy a bucket's local gradients into its fp32 buffer and start the reduce-scatter: mean over dp."""
        bucket = self.buckets[index]
        fix_grad_placements(bucket.params)
        for p, start in zip(bucket.params, bucket.offsets, strict=True):
            target = bucket.grad[start : start + local(p).numel()]
            target.copy_(local(p.grad).reshape(-1)) if p.grad is not None else target.zero_()
            p.grad = None  # the fp32 bucket holds it now (Megatron's main-grad buffer): free the copy
        work = _reduce_scatter(bucket.grad_shard, bucket.grad, group=self.dp_group, async_op=True)

        def complete() -> None:
            work.wait()
            bucket.grad_shard.div_(self.dp)

        return complete

    def begin_step(self, micro_batches: int) -> None:
        self.reduction.begin_step(micro_batches)

    def reduce_gradients(self) -> None:
        self.reduction.finish()

    def _owned_grads(self, bucket: _Bucket) -> list[torch.Tensor]:
        return [bucket.grad_shard[r.shard_start : r.shard_start + r.numel] for r in bucket.runs]

    def grad_groups(self) -> GradGroups:
        runs = [(r, g) for b in self.buckets for r, g in zip(b.runs, self._owned_grads(b), strict=True)]
        return GradGroups(
            tp_sharded=[g for r, g in runs if r.tp_sharded],
            tp_replicated=[g for r, g in runs if not r.tp_sharded],
            dp_sharded=True,
        )

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Update the owned slice (fp32 master + moments), then all-gather every bucket into the params."""
        for bucket in self.buckets:
            for run, grad in zip(bucket.runs, self._owned_grads(bucket), strict=True):
                run.master.grad = grad.to(self.state_device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for bucket in self.buckets:
            full = self._gather_bucket(bucket, [r.master for r in bucket.runs], local(bucket.params[0]).dtype)
            for p, start in zip(bucket.params, bucket.offsets, strict=True):
                tensor = local(p)
                tensor.copy_(full[start : start + tensor.numel()].view_as(tensor))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for bucket in self.buckets:
            for run in bucket.runs:
                run.master.grad = None

    def grad_buffer_bytes(self) -> int:
        """The fp32 reduction buckets and this rank's reduce-scattered slices."""
        return sum(b.grad.nbytes + b.grad_shard.nbytes for b in self.buckets)

    def _gather_bucket(
        self, bucket: _Bucket, owned: list[torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """All-gather the dp ranks' owned slices of one quantity into the whole bucket, in `dtype`."""
        shard = torch.zeros(bucket.shard_numel, dtype=dtype, device=self.device)
        for run, values in zip(bucket.runs, owned, strict=True):
            shard[run.shard_start : run.shard_start + run.numel].copy_(values)
        full = torch.empty(bucket.numel, dtype=dtype, device=self.device)
        _all_gather(full, shard, group=self.dp_group)
        return full

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per parameter, in the parameter's own shape and placement: exp_avg, exp_avg_sq and the fp32
        master weights, gathered over dp (checkpoints store them per parameter so they can be resharded;
        this holds the whole local optimizer state once, for the save)."""
        states: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in self.params}
        for bucket in self.buckets:
            owned = {
                "master": [r.master.detach() for r in bucket.runs],
                **{k: [self.optimizer.state[r.master][k] for r in bucket.runs] for k in MOMENTS},
            }
            for key, values in owned.items():
                full = self._gather_bucket(bucket, values)
                for p, start in zip(bucket.params, bucket.offsets, strict=True):
                    shape = local(p).shape
                    states[id(p)][key] = like_param(p, full[start : start + shape.numel()].view(shape).clone())
        return [states[id(p)] for p in self.params]

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Take each rank's owned slices of per-parameter states (missing master: the weights themselves)."""
        by_param = {id(p): s for p, s in zip(self.params, states, strict=True)}
        for bucket in self.buckets:
            for run in bucket.runs:
                state, offset = by_param[id(run.param)], run.param_offset
                run.master.copy_(_flat_slice(state.get("master", run.param), offset, run.numel))
                self.optimizer.state[run.master] = {
                    "step": adam_step_tensor(step, self.optimizer, run.master),
                    **{k: _flat_slice(state[k], offset, run.numel).to(self.state_device).clone() for k in MOMENTS},
                }

    def state_bytes(self) -> int:
        """Exact bytes of optimizer state on this rank: fp32 master weights + the two AdamW moments."""
        return self.master.nbytes + moment_bytes(self.optimizer)


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig, dp_group: dist.ProcessGroup):
    if cfg.zero_stage == 1:
        return ZeroOptimizer(params, cfg, dp_group)
    return DataParallelOptimizer(params, cfg, dp_group)
