"""Throughput and memory of one model and batch on whatever device is present, in one process: a plain
PyTorch loop (the same nn.Module with its loss in one piece, fused AdamW, autocast, clipping) eager and
with `torch.compile(model)`, then hpc_train's training step (built by `builder.build_run`, as a run builds
it) eager and with train.compile=true. Prints tokens/s, MFU (6N, and with attention FLOPs), peak allocated
and reserved memory (CUDA) and each row's throughput and memory against plain + compile.

    python tools/bench_gpu.py                      # CUDA: the gpt_1_3b shape, bf16, ZeRO-1; CPU: tiny
    python tools/bench_gpu.py --model 100m         # a ~100M model (CPU: fp32)
    python tools/bench_gpu.py --model tiny train.micro_batch_size=4   # any key=value on top

With float8 (train.fp8; on by default where the GPU has float8 tensor cores, compute capability 8.9+; `--fp8
on` runs them on the CPU too), three more rows: the plain loop + compile with torchao's float8 linears in the
same block projections, and hpc_train compiled with train.fp8=tensorwise and =rowwise. MFU stays against the
bf16 peak in every row (the speed-up reads directly); the last column is against the fp8 peak
(logging.mfu_peak=fp8's figure).

megatron-core is not run here (it needs Transformer Engine or its local spec wired to this data): its
figure on one H100 is in issue 13's table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable

import torch

from hpc_train.builder import build_run
from hpc_train.data.batch import Batch
from hpc_train.features.float8.linears import capability_problem, fp8_projections
from hpc_train.job import JobConfig, load_config
from hpc_train.launch.local import single_process_group
from hpc_train.models import get_spec
from hpc_train.observe.metrics import device_peak_flops
from hpc_train.optim.rules import target
from hpc_train.optim.rules.adamw import AdamW
from hpc_train.train.step import StepOptions, train_step

MODELS = {  # name -> model and batch keys
    "tiny": ["model.n_layers=4", "model.n_heads=4", "model.d_model=128", "model.seq_len=128",
             "train.micro_batch_size=8"],
    "100m": ["model.n_layers=12", "model.n_heads=12", "model.d_model=768", "model.seq_len=512",
             "model.vocab_size=50257", "train.micro_batch_size=2"],
    "1.3b": ["model.n_layers=24", "model.n_heads=16", "model.d_model=2048", "model.seq_len=2048",
             "model.vocab_size=50257", "train.micro_batch_size=8"],
}  # fmt: skip
CUDA = ["train.precision=bf16", "optim.zero_stage=1"]


def plain_loop(
    cfg: JobConfig, device: torch.device, compiled: bool, fp8: str = "off"
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A step of the hand-written loop: fp32 weights, autocast, whole-batch loss, clip, fused AdamW; with
    `fp8`, torchao's float8 linears in the block projections (the ones train.fp8 converts)."""
    model_cfg = type(cfg.model)(**{**vars(cfg.model), "loss_chunk_tokens": 0})
    spec = get_spec(cfg.model.arch)
    model = spec.build_stage(model_cfg).to(device)
    spec.init_weights(model, cfg.train.seed)
    if fp8 != "off":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = set(fp8_projections(model, cfg.train.fp8_min_dim))
        convert_to_float8_training(model, module_filter_fn=lambda _, name: name in chosen,
                                   config=Float8LinearConfig.from_recipe_name(fp8))  # fmt: skip
    optimizer = AdamW([target(n, p) for n, p in model.named_parameters()], cfg.optim).optimizer
    forward = torch.compile(model) if compiled else model
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=low) if low else contextlib.nullcontext():
            loss = forward(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hpc_train_step(cfg: JobConfig, device: torch.device, rank_env) -> Callable[[torch.Tensor, torch.Tensor], None]:
    run = build_run(cfg, rank_env, device, with_data=False)
    options = StepOptions(cfg.optim.grad_clip, run.scaler)
    return lambda tokens, targets: train_step(run.model, run.optimizer, [Batch(tokens, targets)], cfg.optim.lr, options)


def measure(step, tokens, targets, device: torch.device, warmup: int, steps: int, before: int) -> dict[str, float]:
    """Seconds per step after `warmup` steps (compiles happen there), and the peak memory of the row above
    the `before` bytes allocated when it started."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for _ in range(warmup):
        step(tokens, targets)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(tokens, targets)
    sync()
    seconds = (time.perf_counter() - start) / steps
    if device.type != "cuda":
        return {"seconds": seconds}
    peaks = {"allocated": torch.cuda.max_memory_allocated() - before,
             "reserved": torch.cuda.max_memory_reserved() - before}  # fmt: skip
    return {"seconds": seconds, **peaks}


Step = Callable[[torch.Tensor, torch.Tensor], None]
PLAIN_COMPILED = "plain + compile"  # the row every other is compared with


def config_keys(name: str, device: torch.device, overrides: list[str] = ()) -> list[str]:
    """The keys of model `name` (MODELS) on `device`: bf16 and ZeRO-1 on CUDA, then `overrides`."""
    return [*MODELS[name], *(CUDA if device.type == "cuda" else []), f"train.device={device.type}",
            "logging.progress=none", *overrides]  # fmt: skip


def random_batch(cfg: JobConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of random tokens and targets (seeded: every row trains on the same one)."""
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device) for _ in range(2))
    return tokens, targets


def row_builders(keys: list[str], device: torch.device, rank_env, fp8: bool) -> dict[str, Callable[[], Step]]:
    """Row name -> a builder of its step (built only when the row runs: each row holds its own model)."""
    cfg = load_config(None, keys)
    compiled = [*keys, "train.compile=true"]
    builders = {
        "plain eager": lambda: plain_loop(cfg, device, compiled=False),
        PLAIN_COMPILED: lambda: plain_loop(cfg, device, compiled=True),
        "hpc_train eager": lambda: hpc_train_step(cfg, device, rank_env),
        "hpc_train compile": lambda: hpc_train_step(load_config(None, compiled), device, rank_env),
    }
    if fp8:
        builders.update({
            "plain + compile fp8": lambda: plain_loop(cfg, device, compiled=True, fp8="tensorwise"),
            "hpc_train comp. fp8": lambda: hpc_train_step(load_config(None, [*compiled, "train.fp8=tensorwise"]),
                                                          device, rank_env),
            "hpc_train comp. fp8r": lambda: hpc_train_step(load_config(None, [*compiled, "train.fp8=rowwise"]),
                                                           device, rank_env),
        })  # fmt: skip
    return builders


def measure_rows(
    builders: dict[str, Callable[[], Step]],
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    warmup: int,
    steps: int,
    report: Callable[[str], None] = print,
) -> dict[str, dict[str, float | str]]:
    """Each row's `measure`, one after another in this process, each from a clean slate (compile caches,
    the allocator's peaks); a row that runs out of GPU memory gets {"error": ...} and the next one runs."""
    rows: dict[str, dict[str, float | str]] = {}
    for row, build in builders.items():
        torch._dynamo.reset()  # each row compiles its own graphs, with nothing cached from the last
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0  # the batch, and leftovers
        try:
            rows[row] = measure(build(), *batch, device, warmup, steps, before)
        except torch.cuda.OutOfMemoryError as err:
            rows[row] = {"error": f"out of memory ({str(err).splitlines()[0][:120]})"}
            report(f"  {row}: out of memory")
            continue
        report(f"  {row}: {rows[row]['seconds'] * 1e3:.1f} ms/step")
    return rows


def row_figures(rows: dict[str, dict], cfg: JobConfig, device: torch.device) -> dict[str, dict[str, float | None]]:
    """Tokens/s, MFU against the bf16 peak (6N, and with attention FLOPs) and the fp8 peak, peak memory (GB,
    CUDA) and each row's tokens/s and allocated memory against the compiled plain loop's (None where either
    is missing)."""
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_len
    flops = get_spec(m.arch).flops_per_token(m)
    attention = 12 * m.n_layers * m.d_model * m.seq_len
    # a device without a known peak (a CPU, a GPU not in the table) gets nan MFUs
    peak, fp8_peak = (device_peak_flops(device, kind) or float("nan") for kind in ("bf16", "fp8"))
    base = rows.get(PLAIN_COMPILED, {})
    out = {}
    for row, r in rows.items():
        if "seconds" not in r:
            continue
        rate = tokens / r["seconds"]
        gb = {k: r[k] / 1e9 if k in r else None for k in ("allocated", "reserved")}
        out[row] = {
            "tokens_s": rate, "mfu_6n": rate * (flops - attention) / peak, "mfu_attn": rate * flops / peak,
            "mfu_fp8_peak": rate * flops / fp8_peak, "allocated_gb": gb["allocated"], "reserved_gb": gb["reserved"],
            "x_tokens_s": base["seconds"] / r["seconds"] if "seconds" in base else None,
            "x_allocated": r["allocated"] / base["allocated"] if "allocated" in r and "allocated" in base else None,
        }  # fmt: skip
    return out


def print_table(rows: dict[str, dict], cfg: JobConfig, device: torch.device, name: str, warmup: int, steps: int):
    m = cfg.model
    print(f"\n{name} ({m.n_layers} layers, d {m.d_model}, seq {m.seq_len}), batch {cfg.train.micro_batch_size} x "
          f"{m.seq_len}, {cfg.train.precision}, zero_stage {cfg.optim.zero_stage}, {device.type}, "
          f"{warmup} warm-up + {steps} timed steps")  # fmt: skip
    print(f"{'':<20}{'tokens/s':>11}{'MFU 6N':>9}{'MFU+attn':>10}{'alloc GB':>10}{'reserv GB':>10}"
          f"{'x tok/s':>9}{'x alloc':>9}{'MFU fp8pk':>10}")  # fmt: skip
    figures = row_figures(rows, cfg, device)
    for row, r in rows.items():
        if row not in figures:
            print(f"{row:<20}  {r.get('error', 'not measured')}")
            continue
        f = figures[row]
        cells = [f"{f[k]:>10.1f}" if f[k] is not None else f"{'-':>10}" for k in ("allocated_gb", "reserved_gb")]
        cells += [f"{f[k]:>9.2f}" if f[k] is not None else f"{'-':>9}" for k in ("x_tokens_s", "x_allocated")]
        print(f"{row:<20}{f['tokens_s']:>11,.0f}{f['mfu_6n']:>9.1%}{f['mfu_attn']:>10.1%}{''.join(cells)}"
              f"{f['mfu_fp8_peak']:>10.1%}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--model", choices=MODELS, default=None, help="default: 1.3b on CUDA, tiny on CPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fp8", choices=("auto", "on", "off"), default="auto",
                        help="the float8 rows; auto: on a GPU with float8 tensor cores (8.9+)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp8 = args.fp8 == "on" or (args.fp8 == "auto" and fp8_supported(device))
    name = args.model or ("1.3b" if device.type == "cuda" else "tiny")
    keys = config_keys(name, device, args.overrides)
    cfg = load_config(None, keys)
    with single_process_group(device=device) as rank_env:
        rows = measure_rows(row_builders(keys, device, rank_env, fp8), random_batch(cfg, device), device,
                            args.warmup, args.steps)  # fmt: skip
    print_table(rows, cfg, device, name, args.warmup, args.steps)


def fp8_supported(device: torch.device) -> bool:
    """Whether this device runs float8 matmuls at speed: a GPU with float8 tensor cores."""
    return device.type == "cuda" and capability_problem(torch.cuda.get_device_capability(device)) is None


if __name__ == "__main__":
    main()
