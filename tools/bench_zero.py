"""ZeRO stages 1-3 on CPU (gloo), hpc_train against DeepSpeed's same stage: step time and per-rank
model-state memory, dp2 and dp4. Same model (hpc_train's decoder, llama family), same batch and AdamW, fp32;
hpc_train's stage 2 reduce-scatters during backward (optim.overlap_grad_reduce) as DeepSpeed's does; one
process group per (world, stage) holding both engines. Their steps alternate round by round and each time is
the median over rounds. Memory is what each engine keeps alive between steps on a rank (parameters,
gradient buffers, optimizer state), found by scanning every live tensor before and after the engine is
built and has stepped, each storage once; on CPU all of it is host memory. DeepSpeed is optional
(`pip install deepspeed`); it compiles its ops on first use, so both engines are warmed up before timing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.models import get_spec
from hpc_train.models.common.decoder import count_params
from hpc_train.observe.memory import storage_key_and_bytes
from hpc_train.train.step import StepOptions, train_step

MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.seq_len=128"]
WARMUP = 3


def live_storages() -> dict[int, int]:
    """Every storage a live tensor of this process holds: address -> bytes."""
    gc.collect()
    return dict(storage_key_and_bytes(t) for t in gc.get_objects() if isinstance(t, torch.Tensor))


def hpc_train_variant(cfg, rank_env, zero_stage: int):
    cfg = replace(cfg, optim=replace(cfg.optim, zero_stage=zero_stage, overlap_grad_reduce=zero_stage == 2))
    run = build_run(cfg, rank_env, torch.device("cpu"), with_data=False)
    return lambda batch: train_step(
        run.model, run.optimizer, [Batch(*batch)], cfg.optim.lr, StepOptions(cfg.optim.grad_clip)
    )


def deepspeed_variant(cfg, rank_env, zero_stage: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": rank_env.rank, "WORLD_SIZE": rank_env.world_size, "LOCAL_RANK": rank_env.local_rank,
                       "MASTER_ADDR": rank_env.master_addr, "MASTER_PORT": rank_env.master_port}.items():  # fmt: skip
        os.environ[key] = str(value)  # DeepSpeed reads its launcher's variables even with a process group
    import deepspeed

    spec = get_spec(cfg.model.arch)
    model = spec.build_stage(cfg.model)
    spec.init_weights(model, cfg.train.seed)
    o = cfg.optim
    adamw = {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay, "torch_adam": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": int(o.bucket_mb * 2**20 / 4)},
        "optimizer": {"type": "AdamW", "params": adamw},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    return step


def worker(rank_env, cfg, stage: int, rounds: int, steps: int, with_deepspeed: bool):
    with distributed(rank_env, torch.device("cpu"), "gloo", 600):
        gen = torch.Generator().manual_seed(rank_env.rank)
        shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
        batch = (torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen))
        makers = {"hpc_train": hpc_train_variant}
        if with_deepspeed:
            makers["DeepSpeed"] = deepspeed_variant
        steps_of, bytes_of = {}, {}
        for name, make in makers.items():  # built and warmed up one after the other: their memory apart
            before = live_storages()
            step = steps_of[name] = make(cfg, rank_env, stage)
            for _ in range(WARMUP):
                step(batch)
            bytes_of[name] = sum(b for key, b in live_storages().items() if key not in before)
        times = {name: [] for name in steps_of}
        for r in range(rounds):
            for name in list(steps_of)[:: 1 if r % 2 == 0 else -1]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    steps_of[name](batch)
                times[name].append((time.perf_counter() - start) / steps)
        gathered = [None] * rank_env.world_size  # every rank's figures: the largest is reported
        dist.all_gather_object(gathered, bytes_of)
        if rank_env.rank == 0:
            worst = {name: max(g[name] for g in gathered) for name in bytes_of}
            t = {name: statistics.median(v) for name, v in times.items()}
            cells = [f"{stage:>5} {rank_env.world_size:>3}"]
            for name in makers:
                cells.append(f"{t[name] * 1e3:>9.1f} {worst[name] / 2**20:>8.1f}")
            if with_deepspeed:
                ratio_t = t["hpc_train"] / t["DeepSpeed"]
                ratio_m = worst["hpc_train"] / worst["DeepSpeed"]
                cells.append(f"{ratio_t:>9.2f} {ratio_m:>9.2f}")
            print("  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    with_deepspeed = not args.no_deepspeed
    if with_deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("deepspeed is not installed (pip install deepspeed): hpc_train's figures only")
            with_deepspeed = False
    base = load_config(None, [*MODEL, "train.micro_batch_size=8", *args.overrides])
    n_params = count_params(get_spec(base.model.arch).build_stage(base.model))
    batch = f"{base.train.micro_batch_size} x {base.model.seq_len}"
    print(f"{base.model.arch} {n_params / 1e6:.2f}M params, fp32, batch {batch} per rank, {args.rounds} rounds x "
          f"{args.steps} steps; MB = model-state bytes per rank (largest rank)")  # fmt: skip
    head = f"{'stage':>5} {'dp':>3}  {'hpc ms':>9} {'hpc MB':>8}"
    if with_deepspeed:
        head += f"  {'DS ms':>9} {'DS MB':>8}  {'time x':>9} {'memory x':>9}"
    print(head)
    for world in args.worlds:
        for stage in args.stages:
            cfg = replace(base, parallel=replace(base.parallel, nproc=world))
            launch_local(worker, world, cfg, stage, args.rounds, args.steps, with_deepspeed)


if __name__ == "__main__":
    main()
