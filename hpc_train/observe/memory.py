"""Exact memory accounting by category on any device: parameters, gradients, optimizer state, and the
activations autograd saves for backward (counted through `saved_tensors_hooks`: each storage once,
parameters and autocast's casts of them excluded; a recomputed region contributes only what its checkpoint
keeps). And, when asked,
a step's peak of live tensor bytes as a whole (`StepPeak`), what the planner's total is checked against."""

from __future__ import annotations

import gc
import itertools

import torch
from torch._subclasses import FakeTensor
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


def is_parameter(t: torch.Tensor, key: int, parameter_storages: set[int]) -> bool:
    """Whether a tensor autograd saves is a parameter or a view of one (also FSDP's gathered parameters, whose
    memory is freed and reused): not an activation. `key`: its storage's (`storage_key_and_bytes`)."""
    return key in parameter_storages or isinstance(t._base if t._base is not None else t, torch.nn.Parameter)


_VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
          "ExpandBackward0"}  # fmt: skip


def is_weight_cast(t: torch.Tensor) -> bool:
    """Whether a saved tensor is autocast's cast of a linear layer's weight (or a view of it): autocast
    keeps one cast per weight while its context lasts (the whole step, every micro-batch), so it is not a
    micro-batch's activation. A bf16 or fp16 copy of a 2-D fp32 parameter; the routed experts' stacked
    weights are cast by their module at each forward, and the router's to fp32: those are activations."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or t.dtype not in (torch.bfloat16, torch.float16):
        return False
    weight = getattr(fn.next_functions[0][0], "variable", None)  # an AccumulateGrad's leaf
    return isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.dtype == torch.float32


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
        if is_parameter(t, key, self.param_storages) or is_weight_cast(t):
            return t
        entry = self.live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.bytes += nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        # detached: autograd holds what this returns, and the tensor itself would hold autograd's node through
        # its grad_fn, a cycle the garbage collector cannot see: a graph never run backward (the pipeline's
        # first-step shape inference) would be kept for good
        return t.detach()

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


def live_storage_bytes() -> dict[int, int]:
    """Address -> bytes of every tensor storage this process's Python objects hold (found through the
    garbage collector, each storage once). Between steps nothing else holds a tensor: no autograd graph
    is alive, and every module, optimizer and FSDP buffer is reachable from Python."""
    objects = gc.get_objects()
    # by type, not isinstance (which reads __class__, and some deprecated proxies warn when it is read);
    # the scan stays in C: a process holds a few hundred thousand objects and some hundred tensors.
    # compile's FakeTensors hold no memory
    types = list(map(type, objects))
    kinds = {kind for kind in set(types) if issubclass(kind, torch.Tensor) and not issubclass(kind, FakeTensor)}
    live = {}
    for tensor in itertools.compress(objects, map(kinds.__contains__, types)):
        if tensor.is_meta:
            continue
        try:  # a wrapper subclass (DTensor, NF4) has no storage of its own: its inner tensors are found too
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if address:
            live[address] = storage.nbytes()
    return live


class StepPeak:
    """Context manager measuring the most bytes of tensors alive at once inside it: a training step, when
    logging.measure_peak_step asks (it profiles, so never by default). CUDA: the caching allocator's peak
    since the entry. CPU: the storages alive at the entry (`live_storage_bytes`, less `preexisting`: what
    the process held before the run was built, such as what torch keeps of an earlier run in the same
    process), then every allocation and free inside, in order, as the profiler records them
    (profile_memory: each CPU block's address and size): `peak_bytes` is the highest running total.
    The profiler does not record a free made in another thread (gloo's worker frees the buffers of a
    collective it held last) nor the free of a block allocated before it started: such a block is taken
    as alive until its address is allocated again, or to the exit when it is gone by then, so
    `peak_bytes` is an upper bound; `peak_min_bytes`, the same replay with those blocks freed as soon as
    they were allocated, a lower bound (equal when every free was recorded)."""

    def __init__(self, device: torch.device, preexisting: frozenset[tuple[int, int]] = frozenset()):
        self.device, self.preexisting = device, preexisting
        self.start_bytes = self.peak_bytes = self.peak_min_bytes = 0

    def _live(self) -> dict[int, int]:
        return {address: n for address, n in live_storage_bytes().items() if (address, n) not in self.preexisting}

    def __enter__(self) -> StepPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return self
        self.start = self._live()
        self.start_bytes = sum(self.start.values())
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = self.peak_min_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        self.profiler.__exit__(*exc)
        events = sorted(_allocations(self.profiler.profiler.kineto_results.experimental_event_tree()),
                        key=lambda e: e.start_time_ns)  # fmt: skip
        end = self._live()
        self.peak_bytes, unrecorded = _replay(self.start, events, end)
        self.peak_min_bytes = _replay(self.start, events, end, unrecorded)[0]
        del self.start, self.profiler


def _allocations(events: list) -> list:
    """The CPU allocation and free events of a profiler event tree (each hangs under the operator that made
    it)."""
    found = []
    stack = list(events)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append(event)
    return found


def _replay(
    start: dict[int, int], events: list, end: dict[int, int], unrecorded: frozenset = frozenset()
) -> tuple[int, frozenset]:
    """(highest running total, the blocks whose free was not recorded) over the storages alive at the
    `start` and the allocation and free `events` in order; `end`: the storages alive after them (address
    -> bytes). A block is named by its allocation's index in `events`, or ("start", address). A free not
    recorded shows when the address is allocated again, or when the block is not alive at the `end`.
    Blocks in `unrecorded` count as freed as soon as they were allocated (or at the start)."""
    live = {address: (n, ("start", address)) for address, n in start.items() if ("start", address) not in unrecorded}
    running = peak = sum(n for n, _ in live.values())
    missed = set()
    for i, event in enumerate(events):
        address, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size < 0:  # a recorded free
            running -= live.pop(address, (0, None))[0]
            continue
        if address in live:  # allocated again: the block there was freed unrecorded
            freed, block = live.pop(address)
            running -= freed
            missed.add(block)
        if i not in unrecorded:
            live[address] = (size, i)
            running += size
            peak = max(peak, running)
    missed |= {block for address, (n, block) in live.items() if end.get(address) != n}
    return peak, frozenset(missed)
