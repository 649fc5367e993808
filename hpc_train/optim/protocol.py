"""What the training step, the planner and checkpoints need from an optimizer."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import GradGroups
from hpc_train.distributed.parallelize import ParallelModel


class Optimizer(Protocol):
    master_weights: ClassVar[bool]  # keeps fp32 master weights, so the model may hold bf16/fp16 ones
    shards_state: ClassVar[bool]  # state split over dp (and so it can be offloaded to the host)
    shards_params: ClassVar[bool]  # parameters split over dp (the model is parallelized for it: FSDP2)
    takes_grads_in_backward: ClassVar[bool]  # a gradient leaves its parameter as backward produces it
    grads_before_backward: ClassVar[bool]  # gradient memory allocated at begin_step, before any backward
    state_keys: tuple[str, ...]  # what `param_states` may hold per parameter (its rule's state, ZeRO's master)
    offloaded: tuple[str, ...]  # memory categories ("params", "grads", "optimizer") it keeps in host memory
    params: list[nn.Parameter]  # the trainable parameters, in the order of `param_states`

    def __init__(self, model: ParallelModel, cfg: OptimConfig) -> None: ...

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int, int]:
        """On a rank holding `params` trainable elements: (gradient bytes, fp32 master-weight bytes, elements
        whose update-rule state it keeps)."""
        ...

    def begin_step(self, micro_batches: int) -> None:
        """Before forward/backward: how many backward passes make the gradients final."""

    def reduce_gradients(self) -> None:
        """After backward: gradients reduced over dp (whatever backward did not already start)."""

    def grad_groups(self) -> GradGroups:
        """The reduced gradient elements this rank holds, for overflow checks, norms and clipping."""
        ...

    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """Update the parameters (and whatever copy of them the optimizer keeps); a nonzero device flag
        `skip` leaves everything as it is, decided on the device (no host read)."""

    def zero_grad(self) -> None: ...

    def state_bytes(self) -> int:
        """Exact bytes of optimizer state on this rank."""
        ...

    def grad_buffer_bytes(self) -> int:
        """Bytes of gradient buffers the optimizer holds besides the parameters' own gradients."""
        ...

    def host_buffer_bytes(self) -> int:
        """Bytes it holds in host memory besides its `offloaded` categories (with optim.offload=cpu)."""
        ...

    def disk_bytes(self) -> int:
        """Bytes of state it keeps on the node's disk (optim.offload=nvme)."""
        ...

    def close(self) -> None:
        """At the run's end: what it holds outside the process let go (nvme's files)."""
        ...

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per trainable parameter, in the parameter's own shape and placement (checkpoints reshard it); with
        optim.offload=nvme, `FileRegion`s of its files, which a save writes from there."""
        ...

    def owned_ranges(self) -> list[tuple[int, int] | None]:
        """Per trainable parameter, the (offset, count) of its flattened local elements whose state this rank
        keeps ((0, 0): none), or None for all of them: what a checkpoint's load needs to read of it."""
        ...

    def local_states(self) -> list[dict[str, torch.Tensor]]:
        """Per trainable parameter, this rank's own state as `load_param_states` takes it back in the same
        layout (ZeRO-1 and -2: the owned range, flattened, with the fp32 master), without communication: what
        a copy of the state restored into the same run needs (train.spike_guard's in-memory copy). The
        tensors are the live ones: a caller copies them."""
        ...

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        """Per trainable parameter, by key, tensors a load may read its state into, laid out as
        `load_param_states` takes it (none: the load allocates them): optim.offload=nvme's files, mapped, so
        a resume's state goes into them with no copy in memory."""
        ...

    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """The inverse of `param_states` (an empty dict: no saved state for that parameter), except that a
        parameter with an owned range gets that range's elements only, flattened. The tensors are the
        caller's to give away: the optimizer may keep them as its state."""
