"""Step time and tokens/s of each (pp, dp, cp, tp) layout against the single-process run, same model and
global batch, in one run. Each layout trains for --steps steps; the median step time after --warmup
steps is reported, with the overhead ratio layout / single process. Context-parallel layouts also report
the bytes a rank sent over cp per step (counted at the primitives: all_to_all_single and the ring's
batched isends) against the planner's cp traffic (`planner.traffic`).

--long: long sequences with packed documents (data.document_mask, data.reset_position_ids; the embedded
corpus's documents are standard-library files), the tiny model, one sample per step: seq 8192 at cp=1
against seq 32768 at cp=4 (ring and Ulysses). Per rank: tokens/s, the step's peak of live tensor bytes
(logging.measure_peak_step) beside the planner's total, saved activations, and the bytes sent over cp
beside the planner's cp traffic; and the largest resident set size over ranks.

--schedules: pp4 with 8 micro-batches (8 layers) under each pipeline schedule: step time against 1F1B, the
time each rank waits on its receives, and the planner's bubble fraction.

On CPU the layouts share the machine's cores (the single process gets all of them, each of N ranks
1/N), so the ratio measures what parallelism costs here: communication, pipeline bubble, per-rank
overheads. On a GPU machine pass train.device=cuda to measure NCCL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from hpc_train.bootstrap import RankEnv
from hpc_train.distributed.pipeline import bubble_fraction
from hpc_train.job import JobConfig, check_run, load_config
from hpc_train.launch.local import launch_local
from hpc_train.planner import stage_estimate, traffic
from hpc_train.train.loop import run_training

SP = "parallel.sequence_parallel=true"
# name -> (world size, overrides); the global batch is micro_batch_size x grad_accum x dp = 16 everywhere
LAYOUTS = {
    "single": (1, ["train.micro_batch_size=16"]),
    "dp2": (2, ["train.micro_batch_size=8"]),
    "tp2": (2, ["parallel.tp=2", SP, "train.micro_batch_size=16"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=4"]),
    "pp2_interleaved": (
        2,
        [
            "parallel.pp=2",
            "parallel.virtual_stages=2",
            "parallel.schedule=interleaved_1f1b",
            "train.micro_batch_size=4",
            "train.grad_accum=4",
        ],
    ),  # fmt: skip
    "tp2_dp2": (4, ["parallel.tp=2", SP, "train.micro_batch_size=8"]),
    "pp2_tp2": (4, ["parallel.pp=2", "parallel.tp=2", SP, "train.micro_batch_size=4", "train.grad_accum=4"]),
    "pp2_dp2": (4, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=2"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", SP, "train.micro_batch_size=4", "train.grad_accum=2"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch_size=16"]),
    "cp2_ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses", "train.micro_batch_size=16"]),
    "cp4_ring": (4, ["parallel.cp=4", "parallel.cp_mode=ring", "train.micro_batch_size=16"]),
    "cp4_ulysses": (4, ["parallel.cp=4", "parallel.cp_mode=ulysses", "train.micro_batch_size=16"]),
}
TINY = ["model.n_layers=2", "model.n_heads=4", "model.d_model=64"]
LONG = {  # name -> (world size, overrides): one sample per step, packed documents
    "seq8k_cp1": (1, ["model.seq_len=8192"]),
    "seq32k_cp4_ring": (4, ["model.seq_len=32768", "parallel.cp=4", "parallel.cp_mode=ring"]),
    "seq32k_cp4_ulysses": (4, ["model.seq_len=32768", "parallel.cp=4", "parallel.cp_mode=ulysses"]),
}
DOCUMENTS = ["data.document_mask=true", "data.reset_position_ids=true"]
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.seq_len=128"]


def counted_training(rank_env: RankEnv, cfg: JobConfig) -> None:
    """run_training, counting the bytes this rank sends through context parallelism's primitives (the
    only users of all_to_all_single and batch_isend_irecv in these layouts); written to run_dir/cp_bytes_<rank>."""
    sent = [0]
    all_to_all, batched = dist.all_to_all_single, dist.batch_isend_irecv

    def counted_all_to_all(output, input, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        sent[0] += input.numel() * input.element_size() * (size - 1) // size  # the part for the others
        return all_to_all(output, input, *args, group=group, **kwargs)

    def counted_batch(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batched(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counted_all_to_all, counted_batch
    try:
        run_training(rank_env, cfg)
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all, batched
    (Path(cfg.run_dir) / f"cp_bytes_{rank_env.rank}").write_text(str(sent[0] / cfg.train.steps))


SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")


def waited_training(rank_env: RankEnv, cfg: JobConfig) -> None:
    """run_training, timing every wait of the pipeline schedule on its point-to-point work (torch's schedules
    all wait through `schedules._wait_batch_p2p`): the time this rank idles on its neighbours; the mean per
    step written to run_dir/waited_<rank>."""
    from torch.distributed.pipelining import schedules

    waited, wait = [0.0], schedules._wait_batch_p2p

    def timed_wait(work):
        start = time.perf_counter()
        wait(work)
        waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait
    try:
        run_training(rank_env, cfg)
    finally:
        schedules._wait_batch_p2p = wait
    (Path(cfg.run_dir) / f"waited_{rank_env.rank}").write_text(str(waited[0] / cfg.train.steps))


def bench_schedules(steps: int, warmup: int, overrides: list[str]) -> None:
    """pp4 with 8 micro-batches under each schedule: step time against 1F1B, each rank's time waiting on its
    receives (mean per step, over every step) and the planner's bubble fraction."""
    print(f"{'schedule':<18} {'step ms':>8} {'vs 1f1b':>8} {'waited ms/step per rank':>32} {'waited share':>13} "
          f"{'planned bubble':>15}")  # fmt: skip
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in SCHEDULES:
            run = Path(tmp) / name
            virtual = 1 if name == "1f1b" else 2
            cfg = load_config(None, [*MODEL, "model.n_layers=8", f"train.steps={steps}", "train.eval_interval=0",
                                     "logging.progress=none", "train.save_final_model=false", f"run_dir={run}",
                                     "parallel.nproc=4", "parallel.pp=4", f"parallel.schedule={name}",
                                     f"parallel.virtual_stages={virtual}", "train.micro_batch_size=2",
                                     "train.grad_accum=8", *overrides])  # fmt: skip
            launch_local(waited_training, 4, cfg)
            times = [json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()]
            step = statistics.median(times[warmup:])
            base = base or step
            waited = [float((run / f"waited_{r}").read_text()) for r in range(4)]
            share = max(waited) / statistics.mean(times)
            print(f"{name:<18} {step * 1e3:>8.1f} {step / base:>8.2f} "
                  f"{' '.join(f'{w * 1e3:.0f}' for w in waited):>32} {share:>13.2f} "
                  f"{bubble_fraction(cfg.parallel, cfg.train.grad_accum):>15.3f}")  # fmt: skip


def bench_long(steps: int, overrides: list[str]) -> None:
    """The long-sequence rows: seq 8k at cp=1 against seq 32k at cp=4, with packed documents."""
    print(f"{'layout':<20} {'ranks':>5} {'step s':>7} {'tokens/s/rank':>13} {'step peak MiB, measured / planned':>34} "
          f"{'activations MiB':>16} {'cp MiB/step sent, measured / planned':>37} {'max RSS MiB':>12}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, extra) in LONG.items():
            cfg = load_config(None, [*TINY, *DOCUMENTS, f"train.steps={steps}", "train.eval_interval=0",
                                     "train.micro_batch_size=1", "logging.progress=none",
                                     "train.save_final_model=false", "logging.measure_peak_step=2",
                                     f"run_dir={Path(tmp) / name}", f"parallel.nproc={world}", *extra,
                                     *overrides])  # fmt: skip
            launch_local(counted_training if cfg.parallel.cp > 1 else run_training, world, cfg)
            records = [json.loads(line) for line in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
            memory = records[1]["memory_bytes"]
            step_s = statistics.median(r["step_time_s"] for r in records[1:])
            tokens_per_rank = cfg.model.seq_len / cfg.parallel.cp / step_s
            layout = check_run(cfg, world, check_paths=False)
            planned_peak = stage_estimate(cfg, layout).total
            sent = "-"
            if cfg.parallel.cp > 1:
                measured = float((Path(tmp) / name / "cp_bytes_0").read_text())
                sent = f"{measured / 2**20:.1f} / {traffic(cfg, layout)['cp'] / 2**20:.1f}"
            peak = f"{memory['step_peak'] / 2**20:.1f} / {planned_peak / 2**20:.1f}"
            print(f"{name:<20} {world:>5} {step_s:>7.2f} {tokens_per_rank:>13,.0f} {peak:>34} "
                  f"{memory['activations_peak'] / 2**20:>16.1f} {sent:>37} "
                  f"{max(r['memory_gb'] for r in records) * 1e9 / 2**20:>12.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[], help="extra key=value for every layout")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset")
    parser.add_argument("--long", action="store_true", help="the long-sequence memory run instead (cp=1 vs cp=4)")
    parser.add_argument("--schedules", action="store_true", help="pp4, 8 micro-batches, under each schedule instead")
    args = parser.parse_args()
    if args.long:
        bench_long(args.steps, args.overrides)
        return
    if args.schedules:
        bench_schedules(args.steps, args.warmup, args.overrides)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            world, extra = LAYOUTS[name]
            cfg = load_config(None, [*MODEL, f"train.steps={args.steps}", "train.eval_interval=0",
                                     "logging.progress=none", "train.save_final_model=false",
                                     f"run_dir={Path(tmp) / name}", f"parallel.nproc={world}", *extra,
                                     *args.overrides])  # fmt: skip
            launch_local(counted_training if cfg.parallel.cp > 1 else run_training, world, cfg)
            lines = (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()
            times = [json.loads(line)["step_time_s"] for line in lines][args.warmup :]
            cp_bytes = ""
            if cfg.parallel.cp > 1:  # rank 0's (every cp rank sends the same)
                measured = float((Path(tmp) / name / "cp_bytes_0").read_text())
                planned = traffic(cfg, check_run(cfg, world, check_paths=False))["cp"]
                cp_bytes = f"{measured / 2**20:.2f} / {planned / 2**20:.2f}"
            rows.append((name, world, statistics.median(times), cp_bytes))
    tokens = 16 * 128
    base = next((t for n, _, t, _ in rows if n == "single"), rows[0][2])
    print(f"{'layout':<16} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'vs single':>10} "
          f"{'cp MiB/step sent, measured / planned':>38}")  # fmt: skip
    for name, world, step_time, cp_bytes in rows:
        print(f"{name:<16} {world:>5} {step_time * 1e3:>9.1f} {tokens / step_time:>10,.0f} {step_time / base:>10.2f} "
              f"{cp_bytes:>38}")  # fmt: skip


if __name__ == "__main__":
    main()
