"""Data-parallel gradient reduction in buckets, each bucket's collective asynchronous, optionally
started from inside backward (Megatron's --overlap-grad-reduce)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def bucketize(tensors: list[torch.Tensor], limit_bytes: int, element_bytes: int | None = None) -> list[list[int]]:
    """Indices of `tensors`, in order, grouped into buckets of one dtype and at most `limit_bytes` (a larger
    tensor gets a bucket of its own). Sizes count `element_bytes` per element when the buffer the bucket
    is reduced in has another dtype than the tensors (ZeRO's fp32 buckets)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * (element_bytes or t.element_size())
        if not buckets or size + nbytes > limit_bytes or t.dtype != tensors[buckets[-1][0]].dtype:
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
    completes every bucket."""

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        launch: Callable[[int], Callable[[], None]],
        overlap: bool,
        deferred: Callable[[list[nn.Parameter]], bool] = lambda bucket: False,
    ):
        self.buckets, self.launch, self.overlap = buckets, launch, overlap
        self.deferred = {i for i, bucket in enumerate(buckets) if deferred(bucket)}
        self.bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self.completions: dict[int, Callable[[], None]] = {}
        self.hooked = False
        self._reset()

    def _reset(self) -> None:
        self.micro_batches = 0  # 0 until begin_step: no launch from backward
        self.arrivals: dict[int, int] = {}  # backward passes seen per parameter this step
        self.missing = [len(b) for b in self.buckets]  # parameters of each bucket not final yet

    def begin_step(self, micro_batches: int) -> None:
        """Expect `micro_batches` backward passes through every parameter before the next `finish`."""
        if self.overlap and not self.hooked:  # registered late: parameters may be swapped after construction
            for bucket in self.buckets:
                for p in bucket:
                    p.register_post_accumulate_grad_hook(self._arrived)
            self.hooked = True
        self.micro_batches = micro_batches

    def _arrived(self, p: nn.Parameter) -> None:
        count = self.arrivals[id(p)] = self.arrivals.get(id(p), 0) + 1
        if count == self.micro_batches:
            i = self.bucket_of[id(p)]
            self.missing[i] -= 1
            if self.missing[i] == 0 and i not in self.deferred:
                self.completions[i] = self.launch(i)

    def finish(self) -> None:
        for i in range(len(self.buckets)):  # one bucket at a time for those backward did not launch
            (self.completions.pop(i, None) or self.launch(i))()
        self._reset()


def flat_allreduce(grads: list[torch.Tensor], dp_group: dist.ProcessGroup) -> Callable[[], None]:
    """Start averaging `grads` over dp in one flat buffer (sum, then divide: gloo has no AVG); the returned
    function waits and copies the means back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, group=dp_group, async_op=True)

    def complete() -> None:
        work.wait()
        flat.div_(dist.get_world_size(dp_group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    return complete
