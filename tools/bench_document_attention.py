"""One attention core's forward and backward over packed documents: the explicit (batch, 1, S, S) mask
(SDPA, the tests' reference) against the path causal_attention takes (query tiles on CPU, FlexAttention on
CUDA). Prints each one's peak of live tensor bytes during the pass (observe/memory.py's StepPeak: CPU
allocations replayed from the profiler, CUDA's allocator peak), its time, and the largest output and
gradient difference between them.

Documents: lengths drawn from an exponential distribution of the given mean (the shape of a web corpus's
document lengths), packed one after another into each sample.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hpc_train.models.common.decoder import causal_attention
from hpc_train.models.common.document_attention import document_mask
from hpc_train.observe.memory import StepPeak


def packed_documents(batch: int, seq: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seq) document ids: exponential lengths of mean `mean`, at least one token each."""
    lengths = torch.empty(batch, seq).exponential_(1 / mean, generator=gen).long() + 1
    return torch.stack([torch.repeat_interleave(torch.arange(seq), row)[:seq] for row in lengths])


def explicit(q, k, v, documents):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents))


def causal(q, k, v, documents):
    """The floor: causal attention over the whole sample, no documents (flash kernel, nothing S x S)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def measure(core, inputs: list[torch.Tensor], documents, dout, device) -> tuple[float, int, list[torch.Tensor]]:
    """(seconds, peak bytes, [output, dq, dk, dv]) of one forward and backward."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    if device.type == "cuda":
        torch.cuda.synchronize()
    with StepPeak(device) as peak:
        start = time.perf_counter()
        out = core(*leaves, documents)
        out.backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, peak.peak_bytes, [out.detach(), *(t.grad for t in leaves)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--mean-document", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    documents = packed_documents(args.batch, args.seq, args.mean_document, gen).to(device)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    inputs = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3)]
    dout = torch.randn(shape, generator=gen).to(device, dtype)
    inputs_mib = sum(t.numel() * t.element_size() for t in [*inputs, dout]) / 2**20
    count = int(documents[0, -1]) + 1
    print(
        f"seq {args.seq}, batch {args.batch}, {args.heads} heads x {args.head_dim}, {args.dtype} on {device}; "
        f"{count} documents in row 0 (mean length {args.seq / count:.0f}); q, k, v, dout: {inputs_mib:.0f} MiB"
    )
    results = {}
    for name, core in (("explicit mask", explicit), ("causal_attention", causal_attention), ("no documents", causal)):
        seconds, peak, tensors = measure(core, inputs, documents, dout, device)
        results[name] = tensors
        print(f"{name:<18} peak {peak / 2**20:>9.1f} MiB   {seconds:>7.2f} s")
    worst = max((a - b).abs().max().item() for a, b in zip(results["explicit mask"], results["causal_attention"],
                                                            strict=True))  # fmt: skip
    print(f"largest difference of output and gradients: {worst:.2e}")


if __name__ == "__main__":
    main()
