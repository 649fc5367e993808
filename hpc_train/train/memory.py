"""Exact memory accounting by category on any device: parameters, gradients, optimizer state, and the
activations autograd saves for backward (counted through `saved_tensors_hooks`: each storage once,
parameters excluded; a recomputed region contributes only what its checkpoint keeps)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(identity of the memory behind `t`, its bytes): DTensors and collective-result wrappers are
    unwrapped to the local tensor; a wrapper with no reachable storage counts as its own size."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    inner = getattr(t, "elem", None)  # e.g. AsyncCollectiveTensor
    if isinstance(inner, torch.Tensor):
        t = inner
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return id(t), t.numel() * t.element_size()


def tensor_bytes(tensors) -> int:
    return sum(storage_key_and_bytes(t)[1] for t in tensors if t is not None)


class SavedActivations:
    """Context manager counting the bytes saved for backward inside it."""

    def __init__(self, params: list[torch.Tensor]):
        self.param_storages = {storage_key_and_bytes(p)[0] for p in params}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key_and_bytes(t)
        if key not in self.param_storages and key not in self.seen:
            self.seen.add(key)
            self.bytes += nbytes
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
