"""Data-parallel gradient reduction in buckets, each bucket's collective asynchronous, optionally
started from inside backward (Megatron's --overlap-grad-reduce)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A parameter hook calling `method` while its object lives. A hook is held by the parameter's C++
    side, where the garbage collector does not look: a bound method there would keep its optimizer, and
    through it the parameters, alive after the run (a cycle never freed)."""
    ref = weakref.WeakMethod(method)

    def hook(p: nn.Parameter) -> None:
        if (bound := ref()) is not None:
            bound(p)

    return hook


def bucketize(tensors: list[torch.Tensor], limit_bytes: int, element_bytes: int | None = None) -> list[list[int]]:
    """Indices of `tensors`, in order, grouped into buckets of one dtype and at most `limit_bytes` (a larger
    tensor gets a bucket of its own). Sizes count `element_bytes` per element when the buffer the bucket
    is reduced in has another dtype than the tensors (ZeRO's fp32 buckets)."""
    sizes = [t.numel() * (element_bytes or t.element_size()) for t in tensors]
    return _group(sizes, [t.dtype for t in tensors], limit_bytes)


def largest_bucket(sizes: list[int], limit_bytes: int) -> int:
    """Bytes of the largest bucket `bucketize` makes of tensors of these bytes and one dtype (the planner
    has sizes, not tensors)."""
    return max((sum(sizes[i] for i in bucket) for bucket in _group(sizes, [None] * len(sizes), limit_bytes)), default=0)


def _group(sizes: list[int], dtypes: list, limit_bytes: int) -> list[list[int]]:
    buckets: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if not buckets or size + nbytes > limit_bytes or dtypes[i] != dtypes[buckets[-1][0]]:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


class BucketedReduction:
    """Reduce gradients over dp bucket by bucket, each bucket's collective asynchronous. `launch(i)` starts
    bucket i's collective and returns the function that completes it. With `overlap` (Megatron's
    --overlap-grad-reduce) a bucket is launched from inside backward as soon as each of its parameters has
    received the gradient of the step's last micro-batch (a post-accumulate-grad hook counts arrivals), so
    its communication runs while backward goes on through earlier layers; `finish` launches whatever
    backward did not (and the buckets `deferred` names: their launch talks to another pipeline stage) and
    completes every bucket. With `every_micro_batch` (ZeRO-2) a bucket is launched as soon as each of its
    parameters has one more gradient, i.e. once per micro-batch, with or without `overlap`: the launch
    consumes (and frees) what the parameters hold, so a reduction may take any number of launches and no
    gradient is summed in the parameters' dtype. At most `max_in_flight` collectives are left outstanding
    (without `overlap`, none: each is completed as soon as it is launched), so the full-size buffers they
    reduce are freed as backward goes on."""

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        launch: Callable[[int], Callable[[], None]],
        overlap: bool,
        deferred: Callable[[list[nn.Parameter]], bool] = lambda bucket: False,
        every_micro_batch: bool = False,
        max_in_flight: int = 2,
        passes: Callable[[nn.Parameter], int] = lambda p: 1,
    ):
        self.buckets, self.launch, self.overlap = buckets, launch, overlap
        # backward passes that each give a parameter part of one micro-batch's gradient: two for a tied
        # embedding both ends of a V-shaped pipeline hold on its first rank (one process's autograd adds
        # both uses in one pass), one for any other
        self.passes = {id(p): passes(p) for bucket in buckets for p in bucket}
        self.every_micro_batch, self.max_in_flight = every_micro_batch, max_in_flight
        self.deferred = {i for i, bucket in enumerate(buckets) if deferred(bucket)}
        self.bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self.completions: list[tuple[int, Callable[[], None]]] = []  # (bucket, completion), in launch order
        self.hooked = False
        self._reset()

    def _reset(self) -> None:
        self.micro_batches = 0  # 0 until begin_step: no launch from backward
        self.arrivals: dict[int, int] = {}  # backward passes seen per parameter this step (`passes` per micro-batch)
        self.launches = [0] * len(self.buckets)  # launches of each bucket this step
        self.missing = [len(b) for b in self.buckets]  # parameters of each bucket short of its next launch

    def _threshold(self, i: int) -> int:
        """The arrivals every parameter of bucket i needs before its next launch."""
        return self.launches[i] + 1 if self.every_micro_batch else self.micro_batches

    def _start(self, i: int) -> None:
        while self.every_micro_batch and len(self.completions) >= self.max_in_flight:
            self.completions.pop(0)[1]()  # before the launch: at most max_in_flight buffers at once
        self.completions.append((i, self.launch(i)))
        if not self.overlap:  # launched from backward only to take the gradients: wait for it here
            self.completions.pop()[1]()
        self.launches[i] += 1
        if self.every_micro_batch:
            threshold = self._threshold(i)
            self.missing[i] = sum(self._micro_batches_of(p) < threshold for p in self.buckets[i])

    def begin_step(self, micro_batches: int) -> None:
        """Expect `micro_batches` backward passes through every parameter before the next `finish`."""
        if (self.overlap or self.every_micro_batch) and not self.hooked:  # registered late: parameters may be
            # swapped after construction
            for bucket in self.buckets:
                for p in bucket:
                    p.register_post_accumulate_grad_hook(weak_hook(self._arrived))
            self.hooked = True
        self.micro_batches = micro_batches

    def _micro_batches_of(self, p: nn.Parameter) -> int:
        """The micro-batches whose gradient `p` has whole this step."""
        return self.arrivals.get(id(p), 0) // self.passes[id(p)]

    def _arrived(self, p: nn.Parameter) -> None:
        self.arrivals[id(p)] = self.arrivals.get(id(p), 0) + 1
        if self.arrivals[id(p)] % self.passes[id(p)]:
            return
        count, i = self._micro_batches_of(p), self.bucket_of[id(p)]
        if self.micro_batches and count == self._threshold(i) and self.launches[i] < self.micro_batches:
            self.missing[i] -= 1
            if self.missing[i] == 0 and i not in self.deferred:
                self._start(i)

    def finish(self) -> None:
        """Complete what is in flight, then launch and complete, one bucket at a time, every bucket whose
        step's gradients have not all been launched."""
        for _, complete in self.completions:
            complete()
        self.completions = []
        for i, launches in enumerate(self.launches):
            if launches == 0 or (self.every_micro_batch and launches < self.micro_batches):
                self.launch(i)()
        self._reset()


def release(*buffers: torch.Tensor) -> None:
    """Free the memory of communication buffers now, where nothing reads them any more. A collective's work
    holds its tensors until gloo's worker thread lets go of it, a moment after the wait returned: on a busy
    host that can be after the next step began, so a step's buffers (a whole bucket of gathered weights at
    ZeRO-1) stayed alive between steps at random. Every view of them is empty afterwards."""
    for buffer in buffers:
        buffer.untyped_storage().resize_(0)


def flat_allreduce(grads: list[torch.Tensor], dp_group: dist.ProcessGroup, divisor: int = 0) -> Callable[[], None]:
    """Start averaging `grads` over dp in one flat buffer (sum, then divide by `divisor`, the group's size by
    default: gloo has no AVG); the returned function waits and copies the means back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, group=dp_group, async_op=True)

    def complete() -> None:
        work.wait()
        flat.div_(divisor or dist.get_world_size(dp_group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        release(flat)

    return complete
