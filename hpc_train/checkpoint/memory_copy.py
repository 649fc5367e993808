"""A copy of the run's state in host memory, taken at each checkpoint save and restored into the same run:
train.spike_guard's rollback without reading the checkpoint back from disk.

It holds this rank's own tensors only, as they live in this layout (the model's local shards, the optimizer's
`local_states`: ZeRO's owned ranges), so taking and restoring it needs no communication and no resharding;
the small parts (sampler, loss scaler, metrics position, spike medians, RNG) are copies of their state
dicts. Host buffers are allocated by the first copy (pinned on a GPU) and reused while the shapes stay.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hpc_train.checkpoint.state import ModelState, OptimizerState, Stateful
from hpc_train.placement import local


@dataclass
class HostTensor:
    """A device tensor's values in host memory, and how to rebuild it (a DTensor's mesh and placements)."""

    values: torch.Tensor
    device: torch.device
    layout: tuple | None = None  # a DTensor's (mesh, placements, shape, stride)

    def fits(self, t: torch.Tensor) -> bool:
        return local(t).shape == self.values.shape and local(t).dtype == self.values.dtype

    def rebuild(self) -> torch.Tensor:
        values = self.values.to(self.device, copy=True)
        if self.layout is None:
            return values
        mesh, placements, shape, stride = self.layout
        return DTensor.from_local(values, mesh, placements, run_check=False, shape=shape, stride=stride)


def to_host(t: torch.Tensor) -> HostTensor:
    part = local(t).detach()
    values = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=part.is_cuda)
    values.copy_(part)
    layout = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
    return HostTensor(values, part.device, layout)


def refreshed(held: list[HostTensor], tensors: list[torch.Tensor]) -> list[HostTensor]:
    """`tensors` copied into the host buffers `held` where each still fits, else into new ones."""
    if len(held) != len(tensors) or not all(h.fits(t) for h, t in zip(held, tensors, strict=True)):
        return [to_host(t) for t in tensors]
    for h, t in zip(held, tensors, strict=True):
        h.values.copy_(local(t).detach())
    return held


class MemoryCopy:
    """The newest saved state of this rank, in host memory."""

    def __init__(self, model: ModelState, optim: OptimizerState, small: dict[str, Stateful]):
        self.model, self.optim, self.small = model, optim, small
        self.step: int | None = None  # the step copied; None: nothing yet
        self.weights: list[HostTensor] = []
        self.keys: list[list[str]] = []  # the optimizer's keys per parameter, and their tensors in that order
        self.states: list[HostTensor] = []
        self.small_states: dict[str, Any] = {}

    def take(self, step: int) -> None:
        """Copy the state as it is now, at the save of `step` (before the next update changes it)."""
        self.weights = refreshed(self.weights, [t for _, t in self.model.live_tensors()])
        states = self.optim.optimizer.local_states()
        self.keys = [list(s) for s in states]
        self.states = refreshed(self.states, [t for s in states for t in s.values()])
        self.small_states = {name: copy.deepcopy(part.state_dict()) for name, part in self.small.items()}
        self.step = step

    def restore(self) -> None:
        """Put the copied state back: the weights in place, the optimizer's through `load_param_states` (as a
        same-layout resume gives it), then the small parts."""
        with torch.no_grad():
            for h, (_, t) in zip(self.weights, self.model.live_tensors(), strict=True):
                local(t).copy_(h.values)
        held, states = iter(self.states), []
        for keys in self.keys:
            states.append({k: next(held).rebuild() for k in keys})
        self.optim.optimizer.load_param_states(states, self.step)
        for name, part in self.small.items():
            part.load_state_dict(copy.deepcopy(self.small_states[name]))

    def nbytes(self) -> int:
        """Host bytes the copy holds (its tensors)."""
        return sum(h.values.nbytes for h in self.weights + self.states)
