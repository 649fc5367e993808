"""Loading a flat range of a stored tensor, and nothing else of it.

ZeRO-1/2 keep the optimizer state of one contiguous range of each parameter's flattened (tp-local)
elements. Loading the parameter's whole state on every rank and cutting the range out afterwards costs
every rank the whole model's state in memory at once, dp times what it keeps. A flat range of a row-major
tensor is a few boxes (a partial row, whole rows, a partial row; recursively in more dimensions), and
DCP's planner reads boxes wherever the checkpoint's chunks lie, so a checkpoint written at another dp,
tp or ZeRO stage still reshards; each box is read into its own stretch of one flat buffer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, where its elements start in the range)


def flat_boxes(shape: Sequence[int], start: int, count: int) -> list[Box]:
    """The boxes that make up elements [start, start + count) of a row-major tensor of `shape`, in order."""
    if count == 0:
        return []
    if len(shape) == 1:
        return [((start,), (count,), 0)]
    row, rest, end = math.prod(shape[1:]), tuple(shape[1:]), start + count
    boxes, at = [], start

    def part_of_row(first: int, n: int) -> None:  # within row at // row
        for offsets, sizes, where in flat_boxes(rest, first, n):
            boxes.append(((at // row, *offsets), (1, *sizes), where + at - start))

    if at % row:
        n = min(end, (at // row + 1) * row) - at
        part_of_row(at % row, n)
        at += n
    if whole := (end - at) // row:
        boxes.append(((at // row, *(0 for _ in rest)), (whole, *rest), at - start))
        at += whole * row
    if at < end:
        part_of_row(0, end - at)
    return boxes


@dataclass
class FlatSlice:
    """Where a load puts a flat range of a stored tensor: `values`, and the `boxes` of the stored tensor it
    is made of (each with where it starts in `values`). Elements with no box stay as `values` has them."""

    values: torch.Tensor
    boxes: list[tuple[ChunkStorageMetadata, int]]


def flat_slice(shape: Sequence[int], start: int, count: int, origin: Sequence[int], rows: int | None,
               values: torch.Tensor | None = None) -> FlatSlice:  # fmt: skip
    """Elements [start, start + count) of a tensor of `shape` whose element 0 is at `origin` in the stored
    tensor (a tp shard's offsets), in fp32, into `values` (given, or new). `rows`: the stored tensor's rows,
    when the tensor has more (vocabulary padding, never stored): those elements are zero, as padding starts."""
    if values is None:
        values = torch.zeros(count) if rows is not None else torch.empty(count)
    elif rows is not None:
        values.zero_()
    boxes = []
    for offsets, sizes, where in flat_boxes(shape, start, count):
        placed = [o + shift for o, shift in zip(offsets, origin, strict=True)]
        kept = sizes[0] if rows is None else min(sizes[0], rows - placed[0])  # a box's first rows: its elements'
        if kept > 0:  # ... first stretch, row-major
            chunk = ChunkStorageMetadata(offsets=torch.Size(placed), sizes=torch.Size((kept, *sizes[1:])))
            boxes.append((chunk, where))
    return FlatSlice(values, boxes)


class SliceLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with `slices` (key -> FlatSlice) read besides the state dict's tensors."""

    def __init__(self, slices: dict[str, FlatSlice]):
        super().__init__()
        self.slices = slices

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        reads = [item for key, part in self.slices.items()
                 for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                              [chunk for chunk, _ in part.boxes])]  # fmt: skip
        return dataclasses.replace(plan, items=[*plan.items, *reads])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        part = self.slices.get(index.fqn)
        if part is None:
            return super().lookup_tensor(index)
        chunk, where = part.boxes[index.index]
        return part.values[where : where + math.prod(chunk.sizes)].view(chunk.sizes)
