"""The routed experts' forward + backward with one grouped GEMM per projection (`torch._grouped_mm`) against
the per-expert loop, on CPU (models/common/moe.py runs the grouped GEMM only there so far), for a few MoE
shapes: tokens (after top-k: assignments), experts, model width, expert width. Tokens are spread over the experts as a
router would (a skewed draw, some experts nearly empty). Prints a table, or JSON with --json.

    python tools/bench_moe.py                   # CPU, fp32, every thread
    python tools/bench_moe.py --threads 1 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hpc_train.models.common.moe import grouped_mm_runs, grouped_swiglu, looped_swiglu

SHAPES = [  # (assignments, experts, d_model, expert hidden)
    (2048, 8, 256, 512),
    (4096, 32, 256, 256),
    (8192, 64, 512, 256),
]


def counts_for(assignments: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """A router's uneven split: expert loads drawn from a Dirichlet-like skew, summing to `assignments`."""
    weights = torch.rand(experts, generator=gen) ** 2 + 0.05
    counts = (weights / weights.sum() * assignments).floor().long()
    counts[0] += assignments - counts.sum()
    return counts


def time_fn(fn, x, counts, weights, repeats: int) -> float:
    """Median seconds of forward + backward."""
    times = []
    for i in range(repeats + 1):
        xs = x.detach().requires_grad_()
        for w in weights:
            w.grad = None
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(xs, counts, *weights).float().square().mean().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    device, gen, rows = torch.device(args.device), torch.Generator().manual_seed(0), []
    for assignments, experts, d, h in SHAPES:
        counts = counts_for(assignments, experts, gen).to(device)
        x = torch.randn(assignments, d, generator=gen).to(device, dtype)
        weights = [
            (torch.randn(shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
            for shape in ((experts, d, h), (experts, d, h), (experts, h, d))
        ]
        if not grouped_mm_runs(x, d, h):
            print(f"torch._grouped_mm does not run here for {args.dtype} on {device}; only the loop is timed")
        grouped = time_fn(grouped_swiglu, x, counts, weights, args.repeats) if grouped_mm_runs(x, d, h) else None
        loop = time_fn(looped_swiglu, x, counts, weights, args.repeats)
        rows.append({"assignments": assignments, "experts": experts, "d_model": d, "expert_hidden": h,
                     "grouped_ms": grouped and grouped * 1e3, "loop_ms": loop * 1e3,
                     "speedup": grouped and loop / grouped})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"routed experts, forward + backward, {args.dtype} on {device}, {torch.get_num_threads()} threads")
    print(f"{'tokens':>7} {'experts':>7} {'d':>5} {'h':>5} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13}")
    for r in rows:
        grouped = f"{r['grouped_ms']:.2f}" if r["grouped_ms"] else "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['assignments']:>7} {r['experts']:>7} {r['d_model']:>5} {r['expert_hidden']:>5} {grouped:>11} "
              f"{r['loop_ms']:>9.2f} {speedup:>13}")  # fmt: skip


if __name__ == "__main__":
    main()
