"""Throughput, MFU and memory measurement; the metrics.jsonl writer and the console progress display."""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# Dense bf16 tensor-core peak FLOP/s, per GPU (vendor data sheets). MFU is reported against these.
GPU_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


@functools.lru_cache(maxsize=1)
def measured_cpu_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """A CPU has no data-sheet figure here: the best fp32 matmul rate of this process's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16:
            if key in name:
                return peak
        return 312e12  # unknown GPU: an A100's figure, so MFU stays comparable
    return measured_cpu_peak_flops()


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peaks. CUDA: PyTorch's max allocated and max reserved (the caching
    allocator's pool, fragmentation included). CPU: the process's peak resident set size, twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return rss, rss


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl and shows one progress line per step."""

    def __init__(self, run_dir: Path, total_steps: int, progress: str, start_step: int = 0, tensorboard: bool = False):
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package ('.[viz]')

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if progress == "auto":
            progress = "bar" if sys.stdout.isatty() else "lines"
        self.progress = progress
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step") if progress == "bar" else None

    def write(self, record: dict[str, Any], show: bool = True) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in flatten(record).items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if not show:
            return
        line = format_record(record)
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.update(record["step"] - self.bar.n)
        elif self.progress == "lines":
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.progress != "none":
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.file.close()


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested record, keys joined with '/' (TensorBoard's grouping)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float) and key != "step":
            out[f"{prefix}{key}"] = value
    return out


def format_record(r: dict[str, Any]) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}"]
    if "eval_loss" in r:
        parts.append(f"eval {r['eval_loss']:.4f}")
    parts += [
        f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}", f"{r['tokens_per_s']:,.0f} tok/s",
        f"mfu {100 * r['mfu']:.1f}%", f"mem {r['memory_gb']:.2f}GB",
    ]  # fmt: skip
    return " | ".join(parts)
