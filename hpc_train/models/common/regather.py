"""Projections of a sequence-parallel input that keep the input sharded (Megatron's): under sequence
parallelism the column-parallel projections read the all-gathered sequence, and autograd would keep that
gathered tensor (t times the rank's slice) for their weight gradients. While they run, saved-tensor hooks
keep this rank's slice in its place, and backward all-gathers it again, once for all of them. Nothing else
changes: no matmul runs twice, and the gathered values are the same to the bit. Hooks that are on already
(memory accounting, activation offload) still see every saved tensor, the slice in the gathered one's place."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hpc_train.observe.memory import storage_key_and_bytes

# the saved-tensor hooks on when a region starts, which its own hooks pass everything on to (a private torch
# function: where a release lacks it, nothing is regathered)
_outer_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def gathered_projections(module: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """`module`'s projections `names` (its submodules) of `x` after `module.sequence_gather` (an identity the
    tensor-parallel plan makes the all-gather of a sequence-sharded input). Where `regathers`, the gathered
    input is not kept for backward: it is gathered again there."""
    gathered = module.sequence_gather(x)
    project = functools.partial(_project, module, names, gathered)
    if not (regathers(module, names) and isinstance(x, DTensor) and isinstance(gathered, DTensor)):
        return project()
    slice_ = _SavedSlice(x, gathered, _outer_hooks(False))
    with torch.autograd.graph.saved_tensors_hooks(slice_.pack, slice_.unpack):
        return project()


def regathers(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the projections keep the slice: in training, where a projection's weight trains, and not
    inside torch.compile. Frozen weights keep no input, and under LoRA the adapters' inputs are kept as the
    planner counts them; saved-tensor hooks are not traced by torch.compile."""
    return (
        getattr(module, "regather", False)
        and _outer_hooks is not None
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and any(getattr(module, name).weight.requires_grad for name in names)
    )


def keep_gathered_inputs(block: nn.Module) -> None:
    """Turn the regathering off inside `block`: a block recomputed whole keeps nothing inside it, and one whose
    saved tensors go to host memory sends the gathered input with them."""
    for module in block.modules():
        if hasattr(module, "regather"):
            module.regather = False


def _project(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(module, name)(x) for name in names)


class _SavedSlice:
    """One region's hooks: a saved tensor on the gathered input's memory (a view of it, as a matmul saves) is
    packed as this rank's slice and the view's layout; everything else goes to the hooks that were on. In
    backward the first unpack gathers the slice again, and the others take the same gathered tensor, which
    goes when the last of them does."""

    def __init__(self, x: DTensor, gathered: DTensor, outer: tuple | None):
        self.key = storage_key_and_bytes(gathered)[0]
        self.local_shape = gathered.to_local().shape
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)
        self.slice = self._pass(x)
        self.whole: torch.Tensor | None = None

    def _pass(self, t: torch.Tensor) -> Any:
        return t if self.outer_pack is None else self.outer_pack(t)

    def pack(self, t: torch.Tensor) -> Any:
        if not isinstance(t, DTensor) or storage_key_and_bytes(t)[0] != self.key:
            return ("as is", self._pass(t))
        local = t.to_local()
        view = (local.shape, local.stride(), local.storage_offset())
        return ("slice", view, (t.device_mesh, t.placements, t.shape, t.stride()))

    def unpack(self, packed: tuple) -> torch.Tensor:
        if packed[0] == "as is":
            return packed[1] if self.outer_unpack is None else self.outer_unpack(packed[1])
        _, (shape, stride, offset), (mesh, placements, global_shape, global_stride) = packed
        local = self._whole().as_strided(shape, stride, offset)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=global_shape, stride=global_stride)

    def _whole(self) -> torch.Tensor:
        if self.whole is None:
            x = self.slice if self.outer_unpack is None else self.outer_unpack(self.slice)
            with torch.no_grad():
                whole = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
            assert whole.shape == self.local_shape and whole.storage_offset() == 0, "regathered another layout"
            self.whole = whole
        return self.whole
