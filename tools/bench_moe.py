"""The routed experts' forward + backward with one grouped GEMM per projection (`torch._grouped_mm`) against
the per-expert loop, on CPU (models/common/moe.py runs the grouped GEMM there, and on CUDA in bf16), for a few MoE
shapes: tokens (after top-k: assignments), experts, model width, expert width. Tokens are spread over the experts as a
router would (a skewed draw, some experts nearly empty). Prints a table, or JSON with --json.

Then (unless --no-ep) the training step of an MoE model at two processes (dp2) with expert parallelism
(parallel.ep=2: each rank holds half the experts, tokens exchanged by all-to-all) against ep1 (every rank holds
every expert), same global batch: the median step time after the warm-up steps and their ratio, and the
bytes rank 0 sent per step by all-to-all against the planner's ep traffic (`planner.traffic`). With
--composed, the same for four ranks in bf16: tp2 x ep2 with sequence parallelism, with float8 too, and
compiled too, against tp2 x ep2 eager.

    python tools/bench_moe.py                   # CPU, fp32, every thread
    python tools/bench_moe.py --threads 1 --dtype bf16
    python tools/bench_moe.py --composed --ep-steps 6 --ep-warmup 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train.bootstrap import RankEnv
from hpc_train.job import JobConfig, check_run, load_config
from hpc_train.launch.local import launch_sequence
from hpc_train.models.common.moe import grouped_mm_runs, grouped_swiglu, looped_swiglu
from hpc_train.planner import traffic
from hpc_train.train.loop import run_training

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


EP_MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.seq_len=128", "model.moe.num_experts=8",
            "model.moe.top_k=2", "model.moe.expert_ffn_hidden=256", "model.moe.num_shared_experts=1",
            "train.micro_batch_size=8", "train.eval_interval=0", "logging.progress=none",
            "train.save_final_model=false"]  # fmt: skip


def counted_training(rank_env: RankEnv, cfg: JobConfig) -> None:
    """run_training, writing the bytes this rank sent to the others per step by all_to_all_single (expert
    parallelism's only user here) to run_dir/ep_bytes_<rank>."""
    sent, all_to_all = [0], dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        own = input_split_sizes[rank] if input_split_sizes else input.shape[0] // size
        sent[0] += (input.shape[0] - own) * (input[0].numel() * input.element_size() if input.shape[0] else 0)
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = counted
    try:
        run_training(rank_env, cfg)
    finally:
        dist.all_to_all_single = all_to_all
    (Path(cfg.run_dir) / f"ep_bytes_{rank_env.rank}").write_text(str(sent[0] / cfg.train.steps))


def bench_layouts(title: str, world: int, layouts: dict[str, list[str]], steps: int, warmup: int,
                  overrides: list[str]) -> None:  # fmt: skip
    """Each layout's training step in the same `world` worker processes, against the first: the median step
    time after the warm-up steps, the bytes rank 0 sent per step by all-to-all against the planner's ep
    traffic, and (compiled) the graphs compiled after the first step by the last."""
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = {name: load_config(None, [*EP_MODEL, f"train.steps={steps}", f"run_dir={Path(tmp) / name}",
                                         f"parallel.nproc={world}", *extra, *overrides])
                for name, extra in layouts.items()}  # fmt: skip
        launch_sequence(counted_training, world, [(cfg,) for cfg in cfgs.values()])
        times, sent, recompiles = {}, {}, {}
        for name, cfg in cfgs.items():
            records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
            times[name] = statistics.median(r["step_time_s"] for r in records[warmup:])
            sent[name] = float((Path(cfg.run_dir) / "ep_bytes_0").read_text())
            recompiles[name] = records[-1].get("recompiles", "-")
    print(f"\n{title}, {steps} steps")
    first = next(iter(layouts))
    print(f"{'layout':<26} {'step ms':>9} {'vs ' + first:>12} {'all-to-all MiB/step, rank 0: measured / planned':>50} "
          f"{'recompiles':>11}")  # fmt: skip
    for name, cfg in cfgs.items():
        planned = traffic(cfg, check_run(cfg, world, check_paths=False)).get("ep", 0.0)
        figure = f"{sent[name] / 2**20:.2f} / {planned / 2**20:.2f}"
        print(f"{name:<26} {times[name] * 1e3:>9.1f} {times[name] / times[first]:>12.2f} {figure:>50} "
              f"{recompiles[name]!s:>11}")  # fmt: skip


# the composed layout of four ranks (tp2 x ep2 at dp2) in bf16: sequence parallelism (each tp rank routing its
# own tokens), float8 projections and compiled blocks against tp2 x ep2 eager
COMPOSED = {
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2"],
    "tp2_sp_ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    "tp2_sp_ep2_fp8": ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", "train.fp8=tensorwise"],
    "tp2_sp_ep2_fp8_compile": [
        "parallel.tp=2",
        "parallel.ep=2",
        "parallel.sequence_parallel=true",
        "train.fp8=tensorwise",
        "train.compile=true",
    ],  # fmt: skip
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-ep", action="store_true", help="skip the ep2 vs ep1 training steps")
    parser.add_argument("--composed", action="store_true", help="also the composed 4-rank layouts (COMPOSED)")
    parser.add_argument("--ep-steps", type=int, default=10)
    parser.add_argument("--ep-warmup", type=int, default=3)
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
    print_table(rows, args)
    if not args.no_ep:
        title = "MoE training step at dp2 (8 experts, top 2, d 256, 4 layers, global batch 16 x 128)"
        precision = [f"train.precision={'bf16' if args.dtype == 'bf16' else 'fp32'}"]
        bench_layouts(title, 2, {"ep1": [], "ep2": ["parallel.ep=2"]}, args.ep_steps, args.ep_warmup, precision)
    if args.composed:
        title = "MoE training step, 4 ranks (tp2 x ep2 at dp2), bf16, the same model and global batch"
        bench_layouts(title, 4, COMPOSED, args.ep_steps, args.ep_warmup, ["train.precision=bf16"])


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"routed experts, forward + backward, {args.dtype} on {args.device}, {torch.get_num_threads()} threads")
    print(f"{'tokens':>7} {'experts':>7} {'d':>5} {'h':>5} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13}")
    for r in rows:
        grouped = f"{r['grouped_ms']:.2f}" if r["grouped_ms"] else "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['assignments']:>7} {r['experts']:>7} {r['d_model']:>5} {r['expert_hidden']:>5} {grouped:>11} "
              f"{r['loop_ms']:>9.2f} {speedup:>13}")  # fmt: skip


if __name__ == "__main__":
    main()
