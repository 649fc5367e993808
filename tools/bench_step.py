"""Step time of hpc_train's single-process training step against a plain hand-written PyTorch loop
(nanoGPT style: forward, backward, clip, AdamW step, autocast for bf16/fp16), same model, same batch, in
one process. hpc_train's side is built by `builder.build_run`, as a training run builds it.

The two alternate round by round so that drift in machine speed hits both; the ratio of medians is
printed (target <= 1.05).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.job import load_config
from hpc_train.launch.local import single_process_group
from hpc_train.models.common.decoder import count_params
from hpc_train.optim.rules import target
from hpc_train.optim.rules.adamw import AdamW
from hpc_train.optim.schedule import lr_at
from hpc_train.train.step import StepOptions, train_step


def plain_step(model, optimizer, tokens, targets, grad_clip, autocast_dtype):
    with torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
        loss = model(tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    args = parser.parse_args()
    cfg = load_config(
        None,
        [
            "model.n_layers=4",
            "model.d_model=256",
            "model.n_heads=8",
            "model.seq_len=256",
            "train.micro_batch_size=8",
            *args.overrides,
        ],
    )
    with single_process_group() as rank_env:
        compare(cfg, build_run(cfg, rank_env, torch.device("cpu"), with_data=False), args.rounds, args.steps)


def compare(cfg, run, rounds: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    targets = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    plain = run.model.spec.build_stage(cfg.model)
    run.model.spec.init_weights(plain, cfg.train.seed)
    plain_opt = AdamW([target(n, p) for n, p in plain.named_parameters()], cfg.optim).optimizer

    def run_ours(step: int) -> None:
        lr = lr_at(step, cfg.optim, cfg.train.steps)
        train_step(run.model, run.optimizer, [Batch(tokens, targets)], lr, StepOptions(cfg.optim.grad_clip, run.scaler))

    def run_plain(step: int) -> None:
        plain_step(plain, plain_opt, tokens, targets, cfg.optim.grad_clip, run.policy.autocast_dtype)

    times = {"hpc_train": [], "plain": []}
    for fn in (run_ours, run_plain):  # warm-up
        fn(0)
    for r in range(rounds):
        for name, fn in (("hpc_train", run_ours), ("plain", run_plain))[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            for s in range(steps):
                fn(s)
            times[name].append((time.perf_counter() - start) / steps)
    ours_ms, plain_ms = (statistics.median(times[k]) * 1e3 for k in ("hpc_train", "plain"))
    tokens_per_step = shape[0] * shape[1]
    print(
        f"model {count_params(plain) / 1e6:.2f}M params, batch {shape[0]} x {shape[1]}, "
        f"{torch.get_num_threads()} threads, {rounds} rounds x {steps} steps"
    )
    print(f"hpc_train step: {ours_ms:8.2f} ms  ({tokens_per_step / ours_ms * 1e3:,.0f} tok/s)")
    print(f"plain loop:     {plain_ms:8.2f} ms  ({tokens_per_step / plain_ms * 1e3:,.0f} tok/s)")
    print(f"ratio hpc_train / plain: {ours_ms / plain_ms:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
