"""Expert parallelism's optimizer: a data-parallel strategy (any of zero stages 0-2) run as two instances,
one over the non-expert parameters reduced (or sharded) over dp x cp, one over the routed experts' shards
reduced (or sharded) over edp, the dp ranks holding the same experts (distributed/mesh.py). Both divide by
dp x cp: an expert's gradient already sums its ep group's tokens (they were dispatched to it), so the mean
is the single-process one, as every other parameter's. Gradient norms count each expert shard once."""

from __future__ import annotations

import torch

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import GradGroups, is_ep_sharded
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.protocol import Optimizer


class ExpertParallelOptimizer:
    """`cls` over the non-expert parameters (dp x cp) and over the expert shards (edp), as one Optimizer."""

    def __init__(self, cls: type[Optimizer], model: ParallelModel, cfg: OptimConfig):
        for key in ("master_weights", "shards_state", "shards_params", "takes_grads_in_backward",
                    "grads_before_backward"):  # fmt: skip
            setattr(self, key, getattr(cls, key))
        params = model.trainable_parameters
        experts = [p for p in params if is_ep_sharded(p)]
        dense = [p for p in params if not is_ep_sharded(p)]
        split = [(part, role) for part, role in ((dense, "dp_cp"), (experts, "edp")) if part]
        self.parts = [cls(model, cfg, part, role) for part, role in split]
        self.of_experts = [role == "edp" for _, role in split]
        self.params = [p for part in self.parts for p in part.params]
        self.offloaded = self.parts[0].offloaded
        self.state_keys = self.parts[0].state_keys

    def begin_step(self, micro_batches: int) -> None:
        for part in self.parts:
            part.begin_step(micro_batches)

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def grad_groups(self) -> GradGroups:
        groups = [part.grad_groups() for part in self.parts]
        dense = [g for g, experts in zip(groups, self.of_experts, strict=True) if not experts]
        out = dense[0] if dense else GradGroups([], [], groups[0].dp_sharded)
        if self.of_experts[-1]:  # replicated over tp, so none is tp-sharded; none is a tied copy
            out.ep_sharded = groups[-1].all
        return out

    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        for part in self.parts:
            part.step(lr, skip)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_bytes(self) -> int:
        return sum(part.state_bytes() for part in self.parts)

    def grad_buffer_bytes(self) -> int:
        return sum(part.grad_buffer_bytes() for part in self.parts)

    def host_buffer_bytes(self) -> int:
        return sum(part.host_buffer_bytes() for part in self.parts)

    def disk_bytes(self) -> int:
        return sum(part.disk_bytes() for part in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        return [state for part in self.parts for state in part.param_states()]

    def owned_ranges(self) -> list[tuple[int, int] | None]:
        return [owned for part in self.parts for owned in part.owned_ranges()]

    def local_states(self) -> list[dict[str, torch.Tensor]]:
        return [state for part in self.parts for state in part.local_states()]

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        return [targets for part in self.parts for targets in part.load_targets()]

    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        start = 0
        for part in self.parts:
            part.load_param_states(states[start : start + len(part.params)], step)
            start += len(part.params)
