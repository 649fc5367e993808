"""A copy of this rank's state in host memory, restored into a run of the same layout: train.spike_guard's
rollback without reading a checkpoint from disk, and the content of node-local checkpoints
(checkpoint/local.py).

It holds this rank's own tensors only, as they live in this layout (the model's local shards, the optimizer's
`local_states`: ZeRO's owned ranges), so taking and restoring it needs no communication and no resharding;
the small parts (sampler, loss scaler, metrics position, spike medians, RNG) are copies of their state
dicts. Host buffers are allocated by the first copy (pinned on a GPU) and reused while the shapes stay. As
bytes (`to_bytes`) it is tensors and plain values only: it loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hpc_train.checkpoint.safe_load import load_rank_file
from hpc_train.checkpoint.state import ModelState, OptimizerState, Stateful
from hpc_train.placement import like_param, local


@dataclass
class HostTensor:
    """A device tensor's values in host memory; `dtensor`: it was laid out like its parameter (a DTensor)."""

    values: torch.Tensor
    device: str
    dtensor: bool = False

    def fits(self, t: torch.Tensor) -> bool:
        return local(t).shape == self.values.shape and local(t).dtype == self.values.dtype

    def rebuild(self, param: torch.Tensor) -> torch.Tensor:
        values = self.values.to(self.device, copy=True)
        return like_param(param, values) if self.dtensor else values


def to_host(t: torch.Tensor) -> HostTensor:
    part = local(t).detach()
    values = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=part.is_cuda)
    values.copy_(part)
    return HostTensor(values, str(part.device), isinstance(t, DTensor))


def refreshed(held: list[HostTensor], tensors: list[torch.Tensor]) -> list[HostTensor]:
    """`tensors` copied into the host buffers `held` where each still fits, else into new ones."""
    if len(held) != len(tensors) or not all(h.fits(t) for h, t in zip(held, tensors, strict=True)):
        return [to_host(t) for t in tensors]
    for h, t in zip(held, tensors, strict=True):
        h.values.copy_(local(t).detach())
    return held


class MemoryCopy:
    """This rank's state at one step, in host memory."""

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
        for keys, p in zip(self.keys, self.optim.optimizer.params, strict=True):
            states.append({k: next(held).rebuild(p) for k in keys})
        self.optim.optimizer.load_param_states(states, self.step)
        for name, part in self.small.items():
            part.load_state_dict(copy.deepcopy(self.small_states[name]))

    def nbytes(self) -> int:
        """Host bytes the copy holds (its tensors)."""
        return sum(h.values.nbytes for h in self.weights + self.states)

    def to_bytes(self) -> memoryview:
        """The copy serialized (tensors and plain values only)."""
        out = io.BytesIO()
        held = {"weights": self.weights, "states": self.states}
        torch.save({"step": self.step, "keys": self.keys, "small": self.small_states,
                    **{k: [h.values for h in hs] for k, hs in held.items()},
                    **{f"{k}_where": [(h.device, h.dtensor) for h in hs] for k, hs in held.items()}}, out)  # fmt: skip
        return out.getbuffer()

    def load_bytes(self, data: memoryview) -> None:
        """A copy `to_bytes` wrote, read back safely (nothing unpickled runs code)."""
        saved = load_rank_file(io.BytesIO(data))
        self.step, self.keys, self.small_states = saved["step"], saved["keys"], saved["small"]
        self.weights, self.states = (
            [HostTensor(v, device, dtensor) for v, (device, dtensor) in zip(saved[k], saved[f"{k}_where"], strict=True)]
            for k in ("weights", "states")
        )
