"""Check 1, dense throughput: tools/bench_gpu.py's four rows (the plain PyTorch loop eager and compiled,
hpc_train eager and with train.compile=true) on the configs/gpt_1_3b.yaml shape, bf16, at the largest micro
batch the planner says fits every row (the plain loop's whole logits included). Tokens/s, MFU, peak
allocated and reserved memory, and each row against the compiled plain loop, the baseline to beat."""

from __future__ import annotations

import torch

from hpc_train.job import check_run, load_config
from hpc_train.launch.local import single_process_group
from hpc_train.planner import estimate
from tools.bench_gpu import CUDA, PLAIN_COMPILED, config_keys, measure_rows, random_batch, row_builders, row_figures
from tools.gpu_checks.common import Check, model_keys

MICRO_BATCHES = (64, 48, 32, 24, 16, 12, 8, 6, 4, 2, 1)
SMOKE_MODEL = ["model.n_layers=2", "model.d_model=64", "model.seq_len=32", "train.micro_batch_size=2"]
MEMORY_SHARE = 0.9  # of the GPU's memory a planned row may take (the allocator's fragmentation is not planned)


def planned_peak(keys: list[str]) -> int:
    cfg = load_config(None, keys)
    return estimate(cfg, check_run(cfg, 1, check_paths=False)).total


def largest_micro_batch(keys: list[str], memory: int) -> int:
    """The largest micro batch whose planned peak fits for hpc_train (its own layout) and for the plain loop
    (fp32 weights under autocast, as optim.zero_stage=0 with bf16 plans it, and the whole batch's logits)."""
    plain = ["optim.zero_stage=0", "model.loss_chunk_tokens=0"]
    for mbs in MICRO_BATCHES:
        batch = f"train.micro_batch_size={mbs}"
        if max(planned_peak([*keys, batch]), planned_peak([*keys, *plain, batch])) <= MEMORY_SHARE * memory:
            return mbs
    return 1


def dense_keys(check: Check, micro_batch: int | None) -> list[str]:
    """The config keys of the dense rows: the tiny model on the CPU (--smoke), else the gpt_1_3b shape on
    CUDA in bf16 with ZeRO-1 (as bench_gpu runs it) at `micro_batch` or the largest that fits."""
    if check.smoke:
        return config_keys("tiny", check.device, SMOKE_MODEL)
    keys = [*model_keys("gpt_1_3b"), *CUDA, "train.device=cuda", "logging.progress=none"]
    if micro_batch is None:
        micro_batch = largest_micro_batch(keys, torch.cuda.get_device_properties(check.device).total_memory)
    return [*keys, f"train.micro_batch_size={micro_batch}"]


def steps(check: Check) -> tuple[int, int]:
    """(warm-up, timed) steps: the first warm-up step compiles."""
    return (1, 1) if check.smoke else (2, 5)


def describe(figures: dict, cuda: bool) -> str:
    memory = (f", {figures['allocated_gb']:.1f} GB allocated, {figures['reserved_gb']:.1f} GB reserved" if cuda
              else ", memory: needs CUDA")  # fmt: skip
    return (f"{figures['tokens_s']:,.0f} tok/s, MFU {figures['mfu_6n']:.1%} (6N), {figures['mfu_attn']:.1%} "
            f"(with attention){memory}")  # fmt: skip


def run(check: Check) -> None:
    keys = dense_keys(check, check.options.micro_batch)
    cfg = load_config(None, keys)
    warmup, timed = steps(check)
    m = cfg.model
    check.setup(f"{m.n_layers} layers, d {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, micro batch "
                f"{cfg.train.micro_batch_size} x {m.seq_len}, {cfg.train.precision}, zero_stage "
                f"{cfg.optim.zero_stage}, {warmup} warm-up + {timed} timed steps")  # fmt: skip
    with single_process_group(device=check.device) as rank_env:
        builders = row_builders(keys, check.device, rank_env, fp8=False)
        rows = measure_rows(builders, random_batch(cfg, check.device), check.device, warmup, timed)
    figures = row_figures(rows, cfg, check.device)
    for row, r in rows.items():
        if row not in figures:
            error = r.get("error", "not measured")
            check.row(row, error, status=f"failed: {error}")
            check.fail(f"{row}: {error}")
            continue
        f = figures[row]
        versus = ""
        if f["x_tokens_s"] is not None and row != PLAIN_COMPILED:
            memory = f", {f['x_allocated']:.2f}x its memory" if f["x_allocated"] is not None else ""
            versus = f"{f['x_tokens_s']:.2f}x the tokens/s of {PLAIN_COMPILED}{memory}"
        check.row(row, describe(f, check.cuda), versus, **f)
    best, base = figures.get("hpc_train compile"), figures.get(PLAIN_COMPILED)
    measured = check.cuda and best is not None and base is not None
    check.target("hpc_train compile >= 1.0x the compiled plain loop's tokens/s",
                 f"{best['x_tokens_s']:.2f}x" if measured else "not measured", best["x_tokens_s"] >= 1.0 if measured
                 else None)  # fmt: skip
    check.target("hpc_train compile allocates no more than the compiled plain loop",
                 f"{best['x_allocated']:.2f}x" if measured else "not measured", best["x_allocated"] <= 1.0 if measured
                 else None)  # fmt: skip
