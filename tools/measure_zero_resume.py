"""Peak host memory of a dp4 ZeRO-1 resume on CPU, per rank. The 86M model (configs/gpt2_124m.yaml's GPT-2
small with a byte-level vocabulary; 85.3M parameters with positions for the 64 tokens a sample has here, in
fp32, so that the step on CPU is short) is trained one step by 4 processes and saved; 4 new
processes (as a restarted job) build the run and resume from it. Each rank reports its peak RSS
(getrusage's ru_maxrss) once the run is built and again after the resume: what the load adds on top.
A rank keeps the optimizer state of 1/4 of the elements; a load that builds each parameter's whole state
first needs all of it, on every rank. To compare two trees, run it with PYTHONPATH set to each. Measured
(2 loaded cores): the load added 1140 MiB per rank when it built every parameter's whole state, 268 MiB
reading the owned ranges only (the owned state is 244 MiB).

    python tools/measure_zero_resume.py
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import JobConfig, load_config
from hpc_train.launch.local import launch_local
from hpc_train.models.common.decoder import count_params
from hpc_train.train.step import train_step

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt2_124m.yaml"
OVERRIDES = ["model.vocab_size=256", "parallel.nproc=4", "optim.zero_stage=1", "train.micro_batch_size=1",
             "train.grad_accum=1", "train.device=cpu", "checkpoint.async_save=false", "model.seq_len=64",
             "train.precision=fp32"]  # fmt: skip


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def save_after_one_step(rank_env, cfg: JobConfig) -> None:
    """One training step (AdamW's moments exist), then a checkpoint of step 1."""
    device = torch.device("cpu")
    with distributed(rank_env, device, "gloo", 600):
        run = build_run(cfg, rank_env, device, with_data=False)
        run.report = run.checkpointer.report = lambda message: None
        tokens = torch.zeros(1, cfg.model.seq_len, dtype=torch.long)
        train_step(run.model, run.optimizer, [Batch(tokens, tokens)], 1e-4)
        run.checkpointer.save(1)
        if rank_env.rank == 0:
            print(f"saved: {sum(count_params(c) for c in run.model.chunks) / 1e6:.2f}M parameters", flush=True)


def resume(rank_env, cfg: JobConfig) -> None:
    """A new run resumes; every rank's peak RSS once built and after the load, printed by rank 0."""
    device = torch.device("cpu")
    with distributed(rank_env, device, "gloo", 600):
        run = build_run(cfg, rank_env, device, with_data=False)
        run.report = run.checkpointer.report = lambda message: None
        gc.collect()
        built = peak_rss_mib()
        start = time.perf_counter()
        resumed = run.checkpointer.resume()
        seconds = time.perf_counter() - start
        rows = [None] * rank_env.world_size
        dist.all_gather_object(rows, (built, peak_rss_mib(), seconds))
        if rank_env.rank == 0:
            assert resumed is not None and resumed.step == 1
            print("rank  peak RSS built (MiB)  after resume (MiB)  added by the load (MiB)  load (s)")
            for rank, (before, after, took) in enumerate(rows):
                print(f"{rank:>4} {before:>21.0f} {after:>19.0f} {after - before:>24.0f} {took:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=[], help="extra key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(CONFIG, [*OVERRIDES, f"run_dir={tmp}/run", *args.overrides])
        launch_local(save_after_one_step, 4, cfg)
        launch_local(resume, 4, cfg)


if __name__ == "__main__":
    main()
