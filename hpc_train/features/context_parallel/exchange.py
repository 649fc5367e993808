"""Causal attention over a sequence split across the context-parallel group, written with torch.distributed
primitives only (gloo runs the same code as NCCL; torch's experimental `context_parallel` has no CPU rule).

Ulysses (DeepSpeed): q, k, v go from sequence shards to head shards with one all-to-all each, every rank runs
ordinary causal attention over the whole sequence for its heads, and the output comes back with a fourth
all-to-all. Needs each tp rank's heads divisible by cp; grouped-query k, v travel unrepeated when their head
count divides too, else repeated first.

Ring: q stays; the key-value blocks travel around the cp ring (send to the next rank, receive from the
previous, with one step's transfer overlapping its compute), each block's attention is merged into the running
output by its log-sum-exp (online softmax). Sequences are split zig-zag (data/batch.py SequenceShard), so that
at every step each rank computes the same amount: its own block causally, a block from a lower rank against
its first half of keys, a block from a higher rank with its second half of queries. Backward goes around the
ring again with the blocks and their key-value gradients, from the saved output and log-sum-exp (the
flash-attention backward of each block, as FlashAttention's ring variants do); a block's gradient is sent on
after its step and waited for only after the next block's backward has computed.

Packed documents (data.document_mask): every rank has the whole sample's document ids. Ulysses attends
over the whole sequence by causal_attention's document path; the ring splits each block into query tiles
(models/common/document_attention.py), each with a bias from the documents and global positions of its
queries and keys, and skips a tile, or a whole block, that no query may see (its k, v still pass on).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hpc_train.data.batch import SequenceShard
from hpc_train.models.common.all_to_all import all_to_all
from hpc_train.models.common.decoder import causal_attention, repeat_kv
from hpc_train.models.common.document_attention import (
    TILE_ROWS,
    Tile,
    block_backward,
    block_forward,
    document_tiles,
)

# ---------------------------------------------------------------------------------------------- Ulysses


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, seq/cp, d) on each rank -> (batch, heads/cp, seq, d): rank r gets head group r of every
    rank's shard, in rank (= sequence) order. Differentiable: its gradient is `_heads_to_seq`'s exchange."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # (cp, b, h/cp, s, d): one head group per rank
    recv = all_to_all(send, [1] * cp, [1] * cp, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # (cp, b, h/cp, s/cp, d)
    recv = all_to_all(send, [1] * cp, [1] * cp, group)
    return recv.transpose(0, 1).reshape(b, cp * h, s // cp, d)


# Both cores run eagerly inside compiled blocks (train.compile): dynamo cannot trace their process-group
# calls, and stopping at the call gives one graph break per attention, not several inside it.
@torch.compiler.disable
def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of contiguous sequence shards, through head shards (all-to-all). `documents` (the
    whole sample's, (batch, seq)) mask the whole sequence each rank holds after the exchange."""
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:  # too few kv heads to split: share them out repeated
        k, v = repeat_kv(k, v, q.shape[1])
    q, k, v = (_seq_to_heads(t, group) for t in (q, k, v))
    return _heads_to_seq(causal_attention(q, k, v, documents), group)


# ---------------------------------------------------------------------------------------------------- ring


class _Ring:
    """The cp group as a ring: send to the next rank while receiving from the previous one."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Start sending `tensors` on and receiving the previous rank's; returns (buffers, requests)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops)


def _merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial attentions over disjoint keys as one (fp32 running output)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(
        -1
    )
    return out, new_lse


def _ring_tiles(
    ring: _Ring, step: int, local: int, documents: torch.Tensor | None, dtype, tile_rows: int = TILE_ROWS
) -> Iterator[Tile]:
    """What of step `step`'s key-value block this rank's `local` queries see under the zig-zag split: all of
    their own, causally; all of a lower rank's first chunk (it precedes both of ours); all of a higher
    rank's block from our second chunk (both its chunks precede it). With packed documents, that part in
    query tiles (models/common/document_attention.py) by the global positions and documents of its queries
    and keys, each tile's bias alive only while the tile computes (built again in backward); no tile where
    no query sees a key, so a block no query sees is not computed."""
    half, source = local // 2, (ring.rank - step) % ring.size
    if step == 0:
        rows, keys, causal = slice(0, local), slice(0, local), True
    elif source < ring.rank:
        rows, keys, causal = slice(0, local), slice(0, half), False
    else:
        rows, keys, causal = slice(half, local), slice(0, local), False
    if documents is None:
        yield Tile(rows, keys, None, causal)
        return
    at = lambda rank: SequenceShard(ring.size, rank, zigzag=True).positions(local, documents.device)
    for tile in document_tiles(documents, at(ring.rank)[rows], at(source)[keys], dtype, tile_rows):
        # (not causal: the tile's bias holds the causal rule too)
        yield tile._replace(rows=_offset(tile.rows, rows.start), keys=_offset(tile.keys, keys.start))


def _offset(part: slice, start: int) -> slice:
    return slice(part.start + start, part.stop + start)


def _mark(timeline: list | None, event: str, step: int) -> None:
    """Record when a ring event happens, as (event, step, seconds): what tests read the overlap from."""
    if timeline is not None:
        timeline.append((event, step, time.perf_counter()))


def _arrive(pending: tuple[list[torch.Tensor], list], timeline: list | None, event: str, step: int):
    """The tensors of a shift, once its transfers are done."""
    received, requests = pending
    for request in requests:
        request.wait()
    _mark(timeline, f"{event} end", step)
    return received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, documents: torch.Tensor | None, timeline: list | None,
                tile_rows: int = TILE_ROWS):  # fmt: skip
        ring = _Ring(group)
        scale = q.shape[-1] ** -0.5
        # in the memory layout SDPA returns, (batch, seq, heads, head_dim): the output projection reads the
        # result as a view, so the output saved here is the tensor it keeps too, not a second copy
        batch, heads, seq, head_dim = q.shape
        out = torch.zeros(batch, seq, heads, head_dim, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(ring.size):
            _mark(timeline, "kv start", step)
            pending = ring.shift(kv) if step < ring.size - 1 else None  # the next block, while this one computes
            _mark(timeline, "forward start", step)
            block_k, block_v = repeat_kv(*kv, heads)
            for tile in _ring_tiles(ring, step, q.shape[2], documents, q.dtype, tile_rows):
                rows, keys = tile.rows, tile.keys
                part = block_forward(q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys], tile.causal, scale,
                                     tile.bias)  # fmt: skip
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *part)
            _mark(timeline, "forward end", step)
            if pending is not None:
                kv = _arrive(pending, timeline, "kv", step)
        out = out.to(q.dtype)
        ctx.group, ctx.scale, ctx.documents, ctx.timeline, ctx.tile_rows = group, scale, documents, timeline, tile_rows
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, heads, timeline = _Ring(ctx.group), ctx.scale, q.shape[1], ctx.timeline
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        # the gradient of the block this rank holds: zero for its own, then what the previous rank summed of
        # the one it passed on, sent along after the previous step (in flight while this step computes)
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        grads = None
        for step in range(ring.size):
            _mark(timeline, "kv start", step)
            pending = ring.shift(kv) if step < ring.size - 1 else None
            _mark(timeline, "backward start", step)
            block_k, block_v = repeat_kv(*kv, heads)
            block_grads = None
            for tile in _ring_tiles(ring, step, q.shape[2], ctx.documents, q.dtype, ctx.tile_rows):
                rows = [t[:, :, tile.rows].contiguous() for t in (dout, q, out, lse)]
                keys = [t[:, :, tile.keys].contiguous() for t in (block_k, block_v)]
                a, b, c = block_backward(rows[0], rows[1], *keys, rows[2], rows[3], tile.causal, scale, tile.bias)
                dq[:, :, tile.rows] += a
                if block_grads is None:
                    block_grads = [torch.zeros(block_k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
                block_grads[0][:, :, tile.keys] += b
                block_grads[1][:, :, tile.keys] += c
            if block_grads is not None and block_k.shape[1] != k.shape[1]:  # grouped-query: sum over the q group
                block_grads = [g.unflatten(1, (k.shape[1], -1)).sum(2) for g in block_grads]
            _mark(timeline, "backward end", step)
            if grads is not None:
                dkv = _arrive(grads, timeline, "grads", step - 1)
            if block_grads is not None:
                dkv = [d.add_(g) for d, g in zip(dkv, block_grads, strict=True)]
            # the block's gradient travels with it, and one hop further home after the last step
            _mark(timeline, "grads start", step)
            grads = ring.shift(dkv)
            if pending is not None:
                kv = _arrive(pending, timeline, "kv", step)
        dk, dv = _arrive(grads, timeline, "grads", ring.size - 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@torch.compiler.disable  # (as ulysses_attention)
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    documents: torch.Tensor | None = None,
    timeline: list | None = None,
    tile_rows: int = TILE_ROWS,
) -> torch.Tensor:
    """Causal attention of zig-zag sequence shards, key-value blocks passed around the cp ring; `documents`
    (the whole sample's, (batch, seq)) mask each block by the global positions of its queries and keys.
    `timeline`: a list the exchange appends its events to (when each transfer starts and arrives, when
    each block computes). `tile_rows`: query rows per tile of a block with documents."""
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, documents, timeline,
                                tile_rows)  # fmt: skip
