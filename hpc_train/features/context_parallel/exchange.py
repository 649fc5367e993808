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
flash-attention backward of each block, as FlashAttention's ring variants do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_train.models.common.all_to_all import all_to_all
from hpc_train.models.common.decoder import repeat_kv

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of contiguous sequence shards, through head shards (all-to-all)."""
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:  # too few kv heads to split: share them out repeated
        k, v = repeat_kv(k, v, q.shape[1])
    q, k, v = (_seq_to_heads(t, group) for t in (q, k, v))
    k, v = repeat_kv(k, v, q.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _heads_to_seq(out, group)


# ---------------------------------------------------------------------------------------------------- ring


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """One block's attention output and log-sum-exp (fp32), by the device's flash kernel."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                             scale=scale)  # fmt: skip
    return out, lse[..., : q.shape[2]].float()


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> Triple:
    """One block's dq, dk, dv given the merged output and log-sum-exp (so each block's share is exact)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


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


def _ring_step_parts(step: int, source: int, rank: int) -> str:
    """What of a step's key-value block (from `source`) the local queries see under the zig-zag split:
    'causal' (its own), 'first_keys' (a lower rank's: its first chunk precedes both of ours), 'last_queries'
    (a higher rank's: both its chunks precede our second)."""
    if step == 0:
        return "causal"
    return "first_keys" if source < rank else "last_queries"


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ring = _Ring(group)
        heads, half = q.shape[1], q.shape[2] // 2
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        block = [k, v]
        for step in range(ring.size):
            pending = ring.shift(block) if step < ring.size - 1 else None
            bk, bv = repeat_kv(*block, heads)
            part = _ring_step_parts(step, (ring.rank - step) % ring.size, ring.rank)
            if part == "causal":
                out, lse = _merge(out, lse, *_block_forward(q, bk, bv, True, scale))
            elif part == "first_keys":
                out, lse = _merge(out, lse, *_block_forward(q, bk[:, :, :half], bv[:, :, :half], False, scale))
            else:
                block_out = _block_forward(q[:, :, half:], bk, bv, False, scale)
                tail, tail_lse = _merge(out[:, :, half:], lse[:, :, half:], *block_out)
                out, lse = torch.cat([out[:, :, :half], tail], dim=2), torch.cat([lse[:, :, :half], tail_lse], dim=2)
            if pending is not None:
                block, requests = pending
                for request in requests:
                    request.wait()
        out = out.to(q.dtype)
        ctx.group, ctx.scale = group, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, heads = _Ring(ctx.group), ctx.scale, q.shape[1]
        half = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = [k, v]
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for step in range(ring.size):
            pending = ring.shift(block) if step < ring.size - 1 else None
            bk, bv = repeat_kv(*block, heads)
            part = _ring_step_parts(step, (ring.rank - step) % ring.size, ring.rank)
            gk = torch.zeros(bk.shape, dtype=torch.float32, device=k.device)
            gv = torch.zeros_like(gk)
            if part == "causal":
                a, b, c = _block_backward(dout, q, bk, bv, out, lse, True, scale)
                dq += a
                gk += b
                gv += c
            elif part == "first_keys":
                a, b, c = _block_backward(dout, q, bk[:, :, :half].contiguous(), bv[:, :, :half].contiguous(), out,
                                          lse, False, scale)  # fmt: skip
                dq += a
                gk[:, :, :half] += b
                gv[:, :, :half] += c
            else:
                rows = slice(half, None)
                tail = [t[:, :, rows].contiguous() for t in (dout, q, out, lse)]
                a, b, c = _block_backward(tail[0], tail[1], bk, bv, tail[2], tail[3], False, scale)
                dq[:, :, rows] += a
                gk += b
                gv += c
            if gk.shape[1] != k.shape[1]:  # grouped-query: each kv head's gradient sums over its q group
                gk = gk.unflatten(1, (k.shape[1], -1)).sum(2)
                gv = gv.unflatten(1, (k.shape[1], -1)).sum(2)
            dk += gk
            dv += gv
            # the block's gradient travels with it, and one hop further home after the last step
            (dk, dv), grad_requests = ring.shift([dk, dv])
            for request in grad_requests:
                request.wait()
            if pending is not None:
                block, requests = pending
                for request in requests:
                    request.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of zig-zag sequence shards, key-value blocks passed around the cp ring."""
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group)
