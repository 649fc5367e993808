"""ZeRO-1 on CPU with 2 processes (gloo): step time and optimizer-state bytes per rank of hpc_train's
ZeRO-1, DeepSpeed's ZeRO stage 1 and plain data parallelism with AdamW (hpc_train zero_stage 0). Same
model (hpc_train's llama decoder), same batch, one run; hpc_train's two also with the dp reduction overlapped with
backward (optim.overlap_grad_reduce). The variants alternate round by round, and each figure is the
median over rounds. DeepSpeed is optional (`pip install deepspeed`); it compiles its ops on first
use, so it is built and warmed up before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from hpc_train.builder import build_run
from hpc_train.config import load_config
from hpc_train.launch.bootstrap import distributed
from hpc_train.launch.local import launch_local
from hpc_train.models import get_spec
from hpc_train.models.decoder import count_params
from hpc_train.train.step import train_step

MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.seq_len=128"]


def hpc_train_variant(cfg, rank_env, zero_stage: int, overlap: bool = False):
    cfg = replace(cfg, optim=replace(cfg.optim, zero_stage=zero_stage, overlap_grad_reduce=overlap))
    run = build_run(cfg, rank_env, torch.device("cpu"), with_data=False)
    timings: dict[str, float] = {}  # seconds per phase, summed over every step
    step = lambda batch: train_step(run.model, run.optimizer, [batch], cfg.optim.lr, cfg.optim.grad_clip, run.scaler,
                                    timings=timings)  # fmt: skip
    return step, run.optimizer.state_bytes, timings


def deepspeed_variant(cfg, rank_env):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {
        "RANK": rank_env.rank,
        "WORLD_SIZE": rank_env.world_size,
        "LOCAL_RANK": rank_env.local_rank,
        "MASTER_ADDR": rank_env.master_addr,
        "MASTER_PORT": rank_env.master_port,
    }.items():
        os.environ[key] = str(value)  # DeepSpeed reads its launcher's variables even with a process group  # fmt: skip
    import deepspeed

    spec = get_spec(cfg.model.arch)
    model = spec.build_stage(cfg.model)
    spec.init_weights(model, cfg.train.seed)
    o = cfg.optim
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": int(o.bucket_mb * 2**20 / 4)},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,
            },
        },  # fmt: skip
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    def state_bytes():
        master = sum(t.nbytes for t in getattr(optimizer, "single_partition_of_fp32_groups", []))
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        moments = sum(
            t.nbytes for s in inner.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step"
        )
        return master + moments

    return step, state_bytes, None


def worker(rank_env, cfg, rounds: int, steps: int, with_deepspeed: bool):
    with distributed(rank_env, torch.device("cpu"), "gloo", 600):
        gen = torch.Generator().manual_seed(rank_env.rank)
        shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
        batch = (torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen))
        variants = {
            "hpc_train ZeRO-1": hpc_train_variant(cfg, rank_env, 1),
            "ZeRO-1 + overlap": hpc_train_variant(cfg, rank_env, 1, overlap=True),
            "plain DP + AdamW": hpc_train_variant(cfg, rank_env, 0),
            "plain DP + overlap": hpc_train_variant(cfg, rank_env, 0, overlap=True),
        }
        if with_deepspeed:
            variants["DeepSpeed ZeRO-1"] = deepspeed_variant(cfg, rank_env)
        for step, *_ in variants.values():  # warm-up (and DeepSpeed's op build)
            for _ in range(3):
                step(batch)
        times = {name: [] for name in variants}
        for r in range(rounds):
            for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    variants[name][0](batch)
                times[name].append((time.perf_counter() - start) / steps)
        if rank_env.rank == 0:
            n_params = count_params(get_spec(cfg.model.arch).build_stage(cfg.model))
            base = statistics.median(times["plain DP + AdamW"])
            print(f"GPT {n_params / 1e6:.2f}M params, batch {shape[0]} x {shape[1]} per rank, 2 ranks (gloo), "
                  f"{rounds} rounds x {steps} steps; optimizer state = fp32 master + moments per rank")  # fmt: skip
            print("exposed reduce = the dp gradient reduction left to wait for after backward, per step")
            header = f"{'variant':<20} {'step ms':>9} {'vs plain':>9} {'exposed reduce ms':>18}"
            print(f"{header} {'opt state MB/rank':>18} {'vs plain':>9}")
            plain_bytes = variants["plain DP + AdamW"][1]()
            for name, (_, state_bytes, timings) in variants.items():
                t, b = statistics.median(times[name]), state_bytes()
                calls = (rounds * steps + 3) if timings else 1
                exposed = f"{timings['grad_reduce'] / calls * 1e3:.1f}" if timings else "-"
                row = f"{name:<20} {t * 1e3:>9.1f} {t / base:>9.2f} {exposed:>18}"
                print(f"{row} {b / 2**20:>18.2f} {b / plain_bytes:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    cfg = load_config(None, [*MODEL, "train.micro_batch_size=8", "parallel.nproc=2", *args.overrides])
    with_deepspeed = not args.no_deepspeed
    if with_deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("deepspeed is not installed (pip install deepspeed): comparing hpc_train's variants only")
            with_deepspeed = False
    launch_local(worker, 2, cfg, args.rounds, args.steps, with_deepspeed)


if __name__ == "__main__":
    main()
