"""Exact memory accounting by category on any device: parameters, gradients, optimizer state, and the
activations autograd saves for backward (counted through `saved_tensors_hooks`: each storage once,
parameters excluded; a recomputed region contributes only what its checkpoint keeps)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(identity of the memory behind `t`, its bytes): DTensors and collective-result wrappers are
    unwrapped to the local tensor, a traceable subclass counts the tensors it holds; a wrapper with no
    reachable storage counts as its own size."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    inner = getattr(t, "elem", None)  # e.g. AsyncCollectiveTensor
    if isinstance(inner, torch.Tensor):
        t = inner
    if hasattr(t, "__tensor_flatten__"):  # a traceable subclass (e.g. torchao's NF4): the tensors it holds
        names, _ = t.__tensor_flatten__()
        return id(t), sum(storage_key_and_bytes(getattr(t, name))[1] for name in names)
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return id(t), t.numel() * t.element_size()


def tensor_bytes(tensors) -> int:
    """Bytes of the memory behind `tensors`, each storage once (FSDP's gradients are views of one buffer)."""
    return sum(dict(storage_key_and_bytes(t) for t in tensors if t is not None).values())


class SavedActivations:
    """Context manager counting the bytes saved for backward inside it: `bytes` in all, and `peak_bytes`,
    the most alive at once. A storage is alive from its first save until backward has used it for the
    last time; once freed its address can be reused by a later micro-batch, which then counts anew."""

    def __init__(self, params: list[torch.Tensor]):
        self.param_storages = {storage_key_and_bytes(p)[0] for p in params}
        self.bytes = 0
        self.live: dict[int, list[int]] = {}  # storage -> [saves not yet used by backward, bytes]
        self.live_bytes = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key_and_bytes(t)
        # a parameter or a view of one (also FSDP's gathered parameters, whose memory is freed and reused)
        if key in self.param_storages or isinstance(t._base if t._base is not None else t, torch.nn.Parameter):
            return t
        entry = self.live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.bytes += nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        key, _ = storage_key_and_bytes(t)
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.live_bytes -= entry[1]
                del self.live[key]
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
