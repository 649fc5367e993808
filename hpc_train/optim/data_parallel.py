"""zero_stage 0: plain data parallelism. Every dp rank averages the full gradients (all-reduce, bucket by
bucket) and runs the same AdamW on its (tensor-parallel) parameters."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import GradGroups, is_tp_sharded, local
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.adamw import MOMENTS, adam_step_tensor, adamw, moment_bytes, set_lr
from hpc_train.optim.buckets import BucketedReduction, bucketize, flat_allreduce


class DataParallelOptimizer:
    master_weights = False  # the model's own fp32 weights are updated (autocast for bf16/fp16)
    shards_state = False
    shards_params = False
    takes_grads_in_backward = False
    grads_before_backward = False
    state_keys = MOMENTS

    def __init__(self, model: ParallelModel, cfg: OptimConfig):
        self.model, self.params = model, model.trainable_parameters
        self.dp_group = model.mesh.group("dp")
        self.optimizer = adamw(self.params, cfg, local(self.params[0]).device)
        limit = int(cfg.bucket_mb * 2**20)
        buckets = [[self.params[i] for i in b] for b in bucketize([local(p) for p in self.params], limit)]
        self.reduction = BucketedReduction(buckets, self._launch, cfg.overlap_grad_reduce, model.holds_tied_copy)

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int]:
        """(gradient, optimizer-state) bytes for `params` local elements: fp32 gradients and two moments."""
        return 4 * params, 8 * params

    def _launch(self, bucket: int) -> Callable[[], None]:
        params = self.reduction.buckets[bucket]
        self.model.finalize_grads(params)
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
        grads = [(local(p.grad), is_tp_sharded(p.grad), self.model.counted_in_norm(p))
                 for p in self.params if p.grad is not None]  # fmt: skip
        return GradGroups.of(grads, dp_sharded=self.shards_params)  # FSDP's are shards of the dp mean

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of the AdamW moments this rank holds (its tp shards)."""
        return moment_bytes(self.optimizer)

    def grad_buffer_bytes(self) -> int:
        return 0  # reduces the parameters' own gradients in place

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per trainable parameter, in the parameter's own shape and placement: exp_avg, exp_avg_sq (none
        before the parameter's first update)."""
        return [{k: t for k, t in self.optimizer.state.get(p, {}).items() if k in MOMENTS} for p in self.params]

    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Takes the loaded tensors as the moments themselves (they are the load's own: no copy)."""
        for p, state in zip(self.params, states, strict=True):
            if not all(k in state for k in MOMENTS):  # not saved (e.g. frozen then): fresh moments
                continue
            moments = {k: state[k].to(p.dtype) for k in MOMENTS}
            self.optimizer.state[p] = {"step": adam_step_tensor(step, self.optimizer, p), **moments}
