"""A copy of this rank's state in host memory, restored into a run of the same layout: train.spike_guard's
rollback without reading a checkpoint from disk, and the content of node-local checkpoints
(checkpoint/local.py).

It holds this rank's own tensors only, as they live in this layout (the model's local shards, the optimizer's
`local_states`: ZeRO's owned ranges), so taking and restoring it needs no communication and no resharding;
the small parts (sampler, loss scaler, metrics position, spike medians, RNG) are copies of their state
dicts. The tensors lie in one host buffer, one after another (`ALIGN`ed), allocated by the first copy
(pinned on a GPU) and reused while the shapes stay. As a file (`pieces`) it is a header (what each tensor
is and where it lies; plain values, loaded with `torch.load(weights_only=True)`; zero-padded to ALIGN, so
the tensors lie aligned in a buffer the file is read into) and then that buffer as it is: written and sent
straight from the copy, never serialized.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hpc_train.checkpoint.safe_load import CheckpointError, load_rank_file
from hpc_train.checkpoint.state import ModelState, OptimizerState, Stateful
from hpc_train.placement import like_param, local

ALIGN = 64  # each tensor's offset in the buffer, and the buffer's in a file
HEADER_LENGTH = 8  # a file's first bytes: the header's length, then its payload's, little-endian


@dataclass
class HostTensor:
    """A device tensor's values in host memory; `dtensor`: it was laid out like its parameter (a DTensor)."""

    values: torch.Tensor
    device: str
    dtensor: bool = False

    def rebuild(self, param: torch.Tensor) -> torch.Tensor:
        values = self.values.to(self.device, copy=True)
        return like_param(param, values) if self.dtensor else values


def describe(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype, str, bool]]:
    """Each tensor's local shape, dtype, device and whether it is a DTensor: what the buffer's layout follows."""
    return [(tuple(local(t).shape), local(t).dtype, str(local(t).device), isinstance(t, DTensor)) for t in tensors]


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def views(buffer: torch.Tensor, layout: list[tuple]) -> list[HostTensor]:
    """The tensors of `layout` as views of `buffer`, one after another, each at a multiple of ALIGN."""
    held, at = [], 0
    for shape, dtype, device, dtensor in layout:
        nbytes = nbytes_of(shape, dtype)
        if at + nbytes > buffer.numel():
            raise CheckpointError(f"a state copy of {buffer.numel()} bytes is too short for its tensors")
        held.append(HostTensor(buffer[at : at + nbytes].view(dtype).view(shape), device, dtensor))
        at += aligned(nbytes)
    return held


def buffer_size(layout: list[tuple]) -> int:
    """The bytes `views` lays `layout` out in."""
    return sum(aligned(nbytes_of(shape, dtype)) for shape, dtype, *_ in layout)


class MemoryCopy:
    """This rank's state at one step, in host memory."""

    def __init__(self, model: ModelState, optim: OptimizerState, small: dict[str, Stateful]):
        self.model, self.optim, self.small = model, optim, small
        self.step: int | None = None  # the step copied; None: nothing yet
        self.buffer = torch.empty(0, dtype=torch.uint8)  # every tensor's bytes
        self.layout: list[tuple] = []  # `describe` of the tensors in the buffer: the weights', then the states'
        self.own_buffer = False  # the buffer is the copy's own, for the next take to copy into
        self.weights: list[HostTensor] = []
        self.keys: list[list[str]] = []  # the optimizer's keys per parameter, and their tensors in that order
        self.states: list[HostTensor] = []
        self.small_states: dict[str, Any] = {}

    def take(self, step: int) -> None:
        """Copy the state as it is now, at the save of `step` (before the next update changes it)."""
        self.take_small(step)
        self.take_tensors()

    def take_small(self, step: int) -> None:
        """The small parts as they are now, at the save of `step`: the next step changes them at once (the
        sampler as it reads, the RNG as it draws), its forward and backward no tensor of `take_tensors`."""
        self.small_states = {name: copy.deepcopy(part.state_dict()) for name, part in self.small.items()}
        self.step = step

    def take_tensors(self, place: Callable[[int, memoryview], torch.Tensor] | None = None) -> None:
        """The weights and the optimizer state as they are now: on a thread while the next step's forward and
        backward run, done before its update changes them. `place`: where they go instead of a buffer of the
        copy's own, given their bytes and the copy's header (`head`): a file's mapped pages (memory
        checkpoints), which the copy holds until the next take (which then allocates its own)."""
        weights = [t for _, t in self.model.live_tensors()]
        states = self.optim.optimizer.local_states()
        tensors = weights + [t for s in states for t in s.values()]
        layout = describe(tensors)
        self.keys = [list(s) for s in states]
        if place is not None:
            self.buffer = place(buffer_size(layout), self.head(layout, len(weights)))
            self._place(layout, len(weights), own=False)
        elif layout != self.layout or not self.own_buffer:  # the first copy, or the shapes changed: a new buffer
            self.buffer = self.host_buffer(buffer_size(layout))
            self._place(layout, len(weights), own=True)
        for h, t in zip(self.weights + self.states, tensors, strict=True):
            h.values.copy_(local(t).detach())

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory as the copy keeps it: pinned where the state is on a GPU (copies to and from
        it are fast and asynchronous), not zero-filled."""
        pinned = any(local(t).is_cuda for _, t in self.model.live_tensors())
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _place(self, layout: list[tuple], n_weights: int, own: bool) -> None:
        """The tensors of `layout` as views of the buffer; `own`: a buffer the next take may copy into."""
        held = views(self.buffer, layout)
        self.layout, self.weights, self.states, self.own_buffer = layout, held[:n_weights], held[n_weights:], own

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
        return self.buffer.numel()

    def pieces(self) -> list[memoryview]:
        """The copy as a file: its header (length first) and its buffer, as the buffer lies in memory."""
        return [self.head(self.layout, len(self.weights)), memoryview(self.buffer.numpy()).cast("B")]

    def head(self, layout: list[tuple], n_weights: int) -> memoryview:
        """A file's header for this copy with its tensors laid out as `layout`: its length, its payload's (plain
        values: the step, the optimizer's keys, the small parts, the layout), the payload, zero-padded so that
        the buffer after it starts ALIGNed."""
        header = io.BytesIO()
        torch.save({"step": self.step, "keys": self.keys, "small": self.small_states, "layout": layout,
                    "weights": n_weights}, header)  # fmt: skip
        payload = header.getvalue()
        head = bytearray(aligned(2 * HEADER_LENGTH + len(payload)))
        head[:HEADER_LENGTH] = (len(head) - HEADER_LENGTH).to_bytes(HEADER_LENGTH, "little")
        head[HEADER_LENGTH : 2 * HEADER_LENGTH] = len(payload).to_bytes(HEADER_LENGTH, "little")
        head[2 * HEADER_LENGTH : 2 * HEADER_LENGTH + len(payload)] = payload
        return memoryview(head)

    def load_bytes(self, data: memoryview, reusable: bool = False) -> None:
        """A copy `pieces` wrote, read back safely (nothing unpickled runs code); its tensors are views of
        `data` (writable). `reusable`: `data` lies in a `host_buffer`, which the next `take` of the same
        layout copies into (no new allocation); otherwise that take allocates its own."""
        head, body = split_pieces(data)
        payload = int.from_bytes(head[HEADER_LENGTH : 2 * HEADER_LENGTH], "little")
        saved = load_rank_file(io.BytesIO(head[2 * HEADER_LENGTH : 2 * HEADER_LENGTH + payload]))
        if len(body) != (expected := buffer_size(saved["layout"])):
            raise CheckpointError(f"a state copy holds {len(body)} bytes of tensors, its header describes {expected}")
        self.buffer = torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)
        self._place([tuple(entry) for entry in saved["layout"]], saved["weights"], own=reusable)
        self.step, self.keys, self.small_states = saved["step"], saved["keys"], saved["small"]


def split_pieces(data: memoryview) -> list[memoryview]:
    """A state copy's file (as `MemoryCopy.pieces` wrote it) cut into its header (length first) and buffer."""
    if len(data) < HEADER_LENGTH or (end := HEADER_LENGTH + int.from_bytes(data[:HEADER_LENGTH], "little")) > len(data):
        raise CheckpointError("a state copy's file is shorter than its header says")
    return [data[:end], data[end:]]
