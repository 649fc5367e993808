"""Check 3, the ring's attention kernels: context parallelism's per-block path (on CUDA the efficient-attention
forward and backward, each block merged into the running output by its log-sum-exp) against SDPA over the
whole sequence, in bf16 and fp32, for cp 2 and 4 simulated on one device.

Causal, and causal with packed documents: the library's own ring (`_RingAttention`'s forward and backward,
zig-zag shards, each block's document mask as an attention bias and blocks that no query sees skipped) runs
for each simulated rank in a thread of its own, the ring's exchange (`_Ring`) replaced by one between the
threads (`SimulatedRing`): every block, merge and gradient hop is the library's code. Times are the
simulated ranks' work one after another on one device (so cp x a rank's time), forward plus backward.

Without context parallelism, packed documents take `causal_attention`'s own path (FlexAttention on CUDA,
query tiles on the CPU): against the same reference, with its peak memory beside the explicit mask's."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from hpc_train.data.batch import SequenceShard
from hpc_train.features.context_parallel import exchange as context_attention
from hpc_train.features.context_parallel.exchange import _RingAttention
from hpc_train.models.common.decoder import causal_attention, repeat_kv
from hpc_train.models.common.document_attention import document_mask
from tools.gpu_checks.common import Check, best_seconds, relative_error

WAIT_S = 120


class SimulatedGroup:
    """A simulated cp rank: its place in the ring and the mailbox the ranks share."""

    def __init__(self, rank: int, size: int, mailbox: Mailbox):
        self.rank, self.size, self.mailbox = rank, size, mailbox


class Mailbox:
    """What each simulated rank has sent its successor, by the sender's count of shifts: every rank makes
    the same sequence of shifts, so a rank's n-th shift receives its predecessor's n-th."""

    def __init__(self, size: int):
        self.ready = threading.Condition()
        self.inbox: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(size)]
        self.shifts = [0] * size


class Arrival:
    """The receive of one shift: waits for the predecessor's tensors and copies them in (the copy follows the
    sender's kernels on the device's stream, as a received buffer would)."""

    def __init__(self, mailbox: Mailbox, rank: int, index: int, buffers: list[torch.Tensor]):
        self.mailbox, self.rank, self.index, self.buffers = mailbox, rank, index, buffers

    def wait(self) -> None:
        box = self.mailbox
        with box.ready:
            if not box.ready.wait_for(lambda: self.index in box.inbox[self.rank], timeout=WAIT_S):
                raise TimeoutError(f"simulated rank {self.rank} got no block {self.index} from its predecessor")
            tensors = box.inbox[self.rank].pop(self.index)
        for buffer, tensor in zip(self.buffers, tensors, strict=True):
            buffer.copy_(tensor)


class SimulatedRing:
    """Stands in for context_attention._Ring: the same `size`, `rank` and `shift`, between threads."""

    def __init__(self, group: SimulatedGroup):
        self.group, self.size, self.rank = group, group.size, group.rank

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Arrival]]:
        box = self.group.mailbox
        received = [torch.empty_like(t) for t in tensors]
        with box.ready:
            index = box.shifts[self.rank]
            box.shifts[self.rank] += 1
            box.inbox[(self.rank + 1) % self.size][index] = list(tensors)
            box.ready.notify_all()
        return received, [Arrival(box, self.rank, index, received)]


@contextlib.contextmanager
def simulated_ring() -> Iterator[None]:
    original = context_attention._Ring
    context_attention._Ring = SimulatedRing
    try:
        yield
    finally:
        context_attention._Ring = original


class _Saved:
    """The autograd context `_RingAttention`'s forward and backward are called with directly (through
    autograd, every thread's backward would queue on the one device thread the engine keeps per GPU, and
    the simulated ranks, each waiting on the others, would deadlock)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def ring(q, k, v, dout, cp: int, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The library's ring over `cp` simulated ranks, with `documents` (each token's, (batch, seq)) or causal
    only: (out, dq, dk, dv) for the whole sequence, in order."""
    seq, box = q.shape[2], Mailbox(cp)
    at = [SequenceShard(cp, r, zigzag=True).positions(seq // cp, q.device) for r in range(cp)]
    results: list[tuple | None] = [None] * cp
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ctx, group = _Saved(), SimulatedGroup(r, cp, box)
            with torch.no_grad():
                shard = [t[:, :, at[r]].contiguous() for t in (q, k, v)]
                out = _RingAttention.forward(ctx, *shard, group, documents, None)
                results[r] = (out, *_RingAttention.backward(ctx, dout[:, :, at[r]].contiguous())[:3])
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller, in its thread
            errors.append(err)

    with simulated_ring():
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    whole = [torch.empty_like(t) for t in (q, q, k, v)]
    for r in range(cp):
        for full, part in zip(whole, results[r], strict=True):
            full[:, :, at[r]] = part
    return tuple(whole)


def explicit(q, k, v, documents=None) -> torch.Tensor:
    """SDPA over the whole sequence, causal or with the explicit (batch, 1, seq, seq) document mask."""
    k, v = repeat_kv(k, v, q.shape[1])
    mask = None if documents is None else document_mask(documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def whole(q, k, v, dout, documents=None, core=explicit) -> tuple[torch.Tensor, ...]:
    """`core` over the whole sequence: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, documents)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def peak_mib(fn, device: torch.device) -> float | None:
    """CUDA's allocator peak while `fn` runs, above what was allocated before (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def random_documents(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Each token's document: packed documents of random lengths (about seq/8 on average)."""
    starts = torch.rand(batch, seq, generator=gen) < 8 / seq
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def shape(check: Check) -> tuple[int, int, int, int, int]:
    """(batch, q heads, kv heads, sequence, head dim): on CUDA a long sequence of the 1.3B model's heads
    with grouped-query k, v (4 kv heads); tiny on the CPU."""
    return (1, 4, 2, 64, 16) if check.smoke else (1, 16, 4, 16384, 128)


def run(check: Check) -> None:
    b, h, kv, seq, d = shape(check)
    device, repeats = check.device, 1 if check.smoke else 3
    kernel = "efficient attention" if check.cuda else "CPU flash attention (the CPU's path; CUDA's: efficient)"
    check.setup(f"batch {b}, {h} q heads / {kv} kv heads, seq {seq}, head dim {d}; per-block {kernel}; "
                f"time: forward + backward of every simulated rank, the best of {repeats}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(b, n, seq, d, generator=gen) for n in (h, kv, kv, h)]  # q, k, v, dout
    documents = random_documents(b, seq, gen).to(device)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        q, k, v, dout = (t.to(device, dtype) for t in base)
        for docs in (None, documents):
            mask = "causal" if docs is None else "causal + documents"
            reference = whole(*(t.float() for t in (q, k, v, dout)), docs)  # fp32: what both are held to
            own = whole(q, k, v, dout, docs)
            own_error = max(relative_error(a, w) for a, w in zip(own, reference, strict=True))
            t_whole = best_seconds(lambda docs=docs, q=q, k=k, v=v, dout=dout: whole(q, k, v, dout, docs), device,
                                   repeats)  # fmt: skip
            if docs is not None:
                document_path(check, name, (q, k, v, dout), docs, reference, own_error, t_whole, repeats)
            for cp in (2, 4):
                fn = lambda q=q, k=k, v=v, dout=dout, cp=cp, docs=docs: ring(q, k, v, dout, cp, docs)
                got = fn()
                errors = [relative_error(a, w) for a, w in zip(got, reference, strict=True)]
                t_ring = best_seconds(fn, device, repeats)
                allowed = 2 * own_error + 1e-3 if dtype == torch.bfloat16 else 2e-4
                ok = max(errors) <= allowed
                row = f"cp{cp} {mask} {name}"
                check.row(row, f"{t_ring * 1e3:.2f} ms, error out {errors[0]:.1e}, grads {max(errors[1:]):.1e}",
                          f"{t_ring / t_whole:.2f}x SDPA whole ({t_whole * 1e3:.2f} ms, error {own_error:.1e})",
                          "ok" if ok else "failed: parity", ring_s=t_ring, whole_s=t_whole, errors=errors,
                          whole_error=own_error, allowed=allowed)  # fmt: skip
                if not ok:
                    check.fail(f"{row}: error {max(errors):.1e} > {allowed:.1e} against fp32 SDPA over the sequence")


def document_path(check: Check, name: str, inputs, documents, reference, own_error: float, t_whole: float,
                  repeats: int) -> None:  # fmt: skip
    """The row of `causal_attention`'s document path at cp 1 (FlexAttention on CUDA, tiles on the CPU)."""
    device = check.device
    fn = lambda: whole(*inputs, documents, core=causal_attention)
    errors = [relative_error(a, w) for a, w in zip(fn(), reference, strict=True)]
    t_path = best_seconds(fn, device, repeats)
    memory = ""
    if (path_mib := peak_mib(fn, device)) is not None:
        mask_mib = peak_mib(lambda: whole(*inputs, documents), device)
        memory = f", peak {path_mib:.0f} MiB vs the explicit mask's {mask_mib:.0f} MiB"
    allowed = 2 * own_error + 1e-3 if inputs[0].dtype == torch.bfloat16 else 2e-4
    ok = max(errors) <= allowed
    kernel = "FlexAttention" if check.cuda else "query tiles"
    row = f"cp1 documents ({kernel}) {name}"
    check.row(row, f"{t_path * 1e3:.2f} ms, error out {errors[0]:.1e}, grads {max(errors[1:]):.1e}{memory}",
              f"{t_path / t_whole:.2f}x SDPA with the explicit mask ({t_whole * 1e3:.2f} ms)",
              "ok" if ok else "failed: parity", path_s=t_path, whole_s=t_whole, errors=errors,
              allowed=allowed)  # fmt: skip
    if not ok:
        check.fail(f"{row}: error {max(errors):.1e} > {allowed:.1e} against fp32 SDPA with the explicit mask")
