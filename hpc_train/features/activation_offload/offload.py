"""Activation offload's mechanism: the tensors a block saves for backward go through autograd's saved-tensor
hooks into host memory during its forward and come back for its backward, one block ahead.

Each offloaded block's forward runs inside `saved_tensors_hooks` (`OffloadedForward`): every tensor it saves
(not a parameter, nor one of the stage's buffers) is copied to host memory (pinned, on a side stream, on
CUDA; the copy keeps the device memory from reuse until it is done) and packed as a `HostCopy`. A block's
copies form a group; a forward pass of the stage makes a chain of groups. When the gradient of a block's
output arrives (its backward is next), that block's group and the one before it in the chain start coming
back to the device, so the previous block's tensors travel while this block's backward computes; a tensor
not back yet by the time backward needs it is fetched then. On the CPU, host and device are one memory: the
copies are made and read back the same way, so the tests run the code CUDA runs.

What went through the hooks is counted the way the planner counts saved tensors: each storage once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpc_train.observe.memory import is_parameter, is_weight_cast, storage_key_and_bytes


@dataclass
class HostCopy:
    """A saved tensor's copy in host memory, and, once fetched, its copy back on the device."""

    host: torch.Tensor
    device: torch.device
    dtensor: tuple[Any, Any, torch.Size, tuple[int, ...]] | None  # (mesh, placements, shape, stride) to rewrap
    back: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # CUDA: when `back` is complete on the offload stream


@dataclass
class Group:
    """The host copies of one block's forward, and the group of the block before it in the same pass. While
    the block's forward runs, the device tensors it offloaded stay referenced (`originals`): a storage freed
    and its address reused inside the same forward would otherwise be taken for one already counted."""

    copies: list[HostCopy] = field(default_factory=list)
    previous: Group | None = None
    fetched: bool = False
    originals: dict[int, torch.Tensor] = field(default_factory=dict)  # by storage, until the forward ends


class StageOffload:
    """One pipeline stage's offload: its chains of groups, and what went through its hooks (`taken`)."""

    def __init__(self, stage: nn.Module):
        self.stage = stage
        self.kept: set[int] | None = None  # storages of the stage's parameters and buffers (never offloaded)
        self.chain_end: Group | None = None  # the last group of the stage's current forward pass
        self.stream: torch.cuda.Stream | None = None
        self.bytes = self.tensors = self.prefetched = 0

    def new_pass(self, *_: Any) -> None:
        """A forward pass of the stage begins (a forward pre-hook): its first block has no group before it."""
        self.chain_end = None

    def open_group(self) -> Group:
        if self.kept is None:
            tensors = itertools.chain(self.stage.parameters(), self.stage.buffers())
            self.kept = {storage_key_and_bytes(t)[0] for t in tensors}
        group = Group(previous=self.chain_end)
        self.chain_end = group
        return group

    def pack(self, group: Group, t: torch.Tensor) -> torch.Tensor | HostCopy:
        key, nbytes = storage_key_and_bytes(t)
        local = t._local_tensor if isinstance(t, DTensor) else t
        # a weight (or autocast's cast of one, kept for the step anyway), a buffer, a subclass
        if is_parameter(t, key, self.kept) or is_weight_cast(t) or type(local) is not torch.Tensor:
            return t
        if key not in group.originals:
            group.originals[key] = t
            self.bytes += nbytes
        self.tensors += 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
        if local.is_cuda:
            stream = self._stream(local.device)
            stream.wait_stream(torch.cuda.current_stream(local.device))
            with torch.cuda.stream(stream):
                host.copy_(local, non_blocking=True)
            local.record_stream(stream)  # its memory is not reused before the copy is done
        else:
            host.copy_(local)
        copy = HostCopy(host, local.device, spec)
        group.copies.append(copy)
        return copy

    def unpack(self, packed: torch.Tensor | HostCopy) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.back is None:  # not prefetched (or not yet): fetched now
            self._fetch(packed)
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        if packed.dtensor is None:
            return packed.back
        mesh, placements, shape, stride = packed.dtensor
        return DTensor.from_local(packed.back, mesh, placements, run_check=False, shape=shape, stride=stride)

    def prefetch(self, group: Group | None) -> None:
        """Start bringing a group's tensors back to the device (once)."""
        if group is None or group.fetched:
            return
        group.fetched = True
        self.prefetched += 1
        for copy in group.copies:
            self._fetch(copy)

    def _fetch(self, copy: HostCopy) -> None:
        if copy.device.type != "cuda":
            copy.back = copy.host
            return
        stream = self._stream(copy.device)
        with torch.cuda.stream(stream):
            copy.back = copy.host.to(copy.device, non_blocking=True)
            copy.ready = torch.cuda.Event()
            copy.ready.record(stream)
        copy.back.record_stream(torch.cuda.current_stream(copy.device))

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def take(self) -> tuple[int, int, int]:
        """(bytes, tensors, groups prefetched) since the last call."""
        out = (self.bytes, self.tensors, self.prefetched)
        self.bytes = self.tensors = self.prefetched = 0
        return out


class OffloadedForward:
    """A block's forward with its saved tensors offloaded (in training; an evaluation saves nothing)."""

    def __init__(self, forward: Callable[..., torch.Tensor], offload: StageOffload):
        self.forward, self.offload = forward, offload

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        offload = self.offload
        group = offload.open_group()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: offload.pack(group, t), offload.unpack):
            out = self.forward(*args, **kwargs)
        group.originals.clear()  # what nothing else holds leaves the device now
        if out.requires_grad:  # its gradient arriving: this block's backward is next, then the one before it

            def bring_back(grad: torch.Tensor) -> None:
                offload.prefetch(group)
                offload.prefetch(group.previous)

            out.register_hook(bring_back)
        return out
