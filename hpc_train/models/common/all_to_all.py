"""The one differentiable all-to-all, shared by expert parallelism (rows in uneven counts, moe.py) and
Ulysses context parallelism (equal shares, features/context_parallel/exchange.py). Its gradient is the
same exchange run backwards: every row's gradient goes home to the rank the row came from.

Ours, not torch.distributed.nn.functional.all_to_all_single (the same autograd rule): torch 2.13 deprecates
that one (a FutureWarning on every call) in favour of torch.distributed._functional_collectives, a private
module; tests/test_context_parallel.py shows both, and that the two agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup):
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows of `x` (dim 0) sent `input_splits[j]` to rank j of `group`, `output_splits[i]` received from rank i,
    in rank order; differentiable (gloo and NCCL alike)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)
