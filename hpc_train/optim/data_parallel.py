"""zero_stage 0: plain data parallelism. Every dp rank averages the full gradients (all-reduce, bucket by
bucket) and runs the same update rule on its (tensor-parallel) parameters; a rule that needs whole
matrices gets them gathered over tp."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import GradGroups, is_tp_sharded
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.buckets import BucketedReduction, bucketize, flat_allreduce
from hpc_train.optim.rules import Target, UpdateRule, rule_class, target
from hpc_train.optim.rules.protocol import MatrixFn
from hpc_train.placement import distribute_like, gathered, like_param, local


def on_whole(fn: MatrixFn, piece: torch.Tensor) -> torch.Tensor:
    """`fn` of the whole matrix that `piece` (laid out like its parameter: a DTensor shard, or whole) is part
    of: gathered whole on the mesh's device (a host-held shard, under FSDP2's offload, too), and this rank's
    part of the result cut out again locally, where `piece` is. A stack of matrices (the routed experts')
    split only along the stack (expert parallelism, FSDP2's dim-0 shards) holds whole matrices: `fn` runs
    on this rank's own, and nothing is gathered."""
    if (
        piece.ndim == 3
        and isinstance(piece, DTensor)
        and all(placement.is_replicate() or placement.is_shard(dim=0) for placement in piece.placements)
    ):
        own = local(piece)  # on the mesh's device for `fn` (FSDP2's offload holds it in host memory)
        return like_param(piece, fn(own.to(piece.device_mesh.device_type)).to(own.device))
    return distribute_like(fn(gathered(piece)), piece)


def whole_dtensors(fn: MatrixFn, targets: list[Target], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """`WholeMatrices` for pieces laid out like their parameters (DTensor shards over tp, and over dp under
    FSDP)."""
    return [on_whole(fn, piece) for piece in pieces]


def build_rule(model: ParallelModel, params: list[torch.nn.Parameter], cfg: OptimConfig) -> UpdateRule:
    """The configured rule over `params`, updated in place (their own shards)."""
    names = model.parameter_names()
    return rule_class(cfg)([target(names[id(p)], p) for p in params], cfg, whole_dtensors)


class DataParallelOptimizer:
    master_weights = False  # the model's own fp32 weights are updated (autocast for bf16/fp16)
    shards_state = False
    shards_params = False
    takes_grads_in_backward = False
    grads_before_backward = False
    offloaded: tuple[str, ...] = ()  # nothing in host memory

    def __init__(self, model: ParallelModel, cfg: OptimConfig, params: list | None = None, role: str = "dp_cp"):
        """Over `params` (every trainable parameter by default), reduced over the mesh's `role`: every rank
        with these parameters, dp x cp (edp for routed experts: optim/experts.py), always divided by dp x cp
        (an expert's gradient holds the tokens of its whole ep group already)."""
        self.model = model
        self.params = model.trainable_parameters if params is None else params
        self.dp_group = model.mesh.group(role)
        self.divisor = model.mesh.size("dp_cp")
        self.rule = build_rule(model, self.params, cfg)
        limit = int(cfg.bucket_mb * 2**20)
        buckets = [[self.params[i] for i in b] for b in bucketize([local(p) for p in self.params], limit)]
        self.reduction = BucketedReduction(buckets, self._launch, cfg.overlap_grad_reduce, model.holds_tied_copy,
                                           passes=model.backward_passes)  # fmt: skip

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int, int]:
        """For `params` local elements: fp32 gradients, no master weights, the rule's state for all of them."""
        return 4 * params, 0, params

    def _launch(self, bucket: int) -> Callable[[], None]:
        params = self.reduction.buckets[bucket]
        self.model.finalize_grads(params)
        grads = [local(p.grad) for p in params if p.grad is not None]
        if dist.get_world_size(self.dp_group) == 1 or not grads:
            if grads and self.divisor > 1:  # routed experts of an ep group as wide as dp
                torch._foreach_div_(grads, self.divisor)
            return lambda: None
        return flat_allreduce(grads, self.dp_group, self.divisor)

    def begin_step(self, micro_batches: int) -> None:
        self.reduction.begin_step(micro_batches)

    def reduce_gradients(self) -> None:
        """Average every gradient over dp (each in its parameter's tp placement first)."""
        self.reduction.finish()

    def grad_groups(self) -> GradGroups:
        grads = [(local(p.grad), is_tp_sharded(p.grad), self.model.counted_in_norm(p))
                 for p in self.params if p.grad is not None]  # fmt: skip
        return GradGroups.of(grads, dp_sharded=self.shards_params)  # FSDP's are shards of the dp mean

    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        self.rule.step(lr, skip)

    def zero_grad(self) -> None:
        self.rule.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of the rule's state this rank holds (its tp shards)."""
        return self.rule.state_bytes()

    def grad_buffer_bytes(self) -> int:
        return 0  # reduces the parameters' own gradients in place

    def host_buffer_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    @property
    def state_keys(self) -> tuple[str, ...]:
        return self.rule.state_keys

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per trainable parameter, in the parameter's own shape and placement: the rule's state (none
        before the parameter's first update)."""
        return [self.rule.state(p) for p in self.params]

    def local_states(self) -> list[dict[str, torch.Tensor]]:
        return self.param_states()  # each parameter's state is this rank's already (its tp and FSDP shards)

    def owned_ranges(self) -> list[tuple[int, int] | None]:
        return [None] * len(self.params)  # every local element's (ZeRO-3: its dp shard is the parameter's own)

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        return [{} for _ in self.params]

    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Takes the loaded tensors as the rule's state itself (they are the load's own: no copy)."""
        for p, state in zip(self.params, states, strict=True):
            self.rule.load_state(p, {k: t.to(p.dtype) for k, t in state.items()}, step)
