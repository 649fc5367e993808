"""Throughput, MFU and memory measurement; the metrics.jsonl writer and the console progress display."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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

# Dense fp8 tensor-core peaks (twice bf16 on Hopper), for logging.mfu_peak=fp8. A GPU without fp8 (A100)
# is not listed: its fp8 figure is taken as twice its bf16 one, the ratio of every GPU that has fp8.
GPU_PEAK_FP8 = (
    ("H200", 1979e12),
    ("H100 PCIe", 1513e12),
    ("H100", 1979e12),
)
PEAKS = {"bf16": GPU_PEAK_BF16, "fp8": GPU_PEAK_FP8}


def gpu_peak_flops(name: str, kind: str = "bf16") -> float | None:
    """The data-sheet peak of the GPU called `name` (torch.cuda.get_device_name's), dense bf16 or fp8; None
    for a GPU not in the table (no MFU is reported against a guess)."""
    for key, peak in PEAKS[kind]:
        if key in name:
            return peak
    bf16 = gpu_peak_flops(name, "bf16") if kind == "fp8" else None
    return 2 * bf16 if bf16 else None


def device_peak_flops(device: torch.device, kind: str = "bf16") -> float | None:
    """MFU's denominator (`kind`: logging.mfu_peak, bf16 or fp8), where the device's peak is known: a GPU of
    the table. A CPU has no such figure (a matmul benchmark's rate depends on the threads and on the load
    when it ran, and gave MFUs above 100%): None, and its records carry tokens/s and TFLOP/s alone."""
    return gpu_peak_flops(torch.cuda.get_device_name(device), kind) if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> tuple[int, int, int]:
    """(allocated, reserved, host) peaks. CUDA: PyTorch's max allocated and max reserved (the caching
    allocator's pool, fragmentation included). CPU: the process's peak resident set size, twice. Host:
    the process's peak resident set size (where offloaded optimizer state and parameters live)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), rss
    return rss, rss, rss


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl and shows one progress line per step. Nothing is
    opened before the first record. A checkpoint part: its state is the last step recorded (and the record
    `held` for a step being saved, written only after its save), and on resume the records of later steps
    (to be trained again) are dropped, as is a partial last line."""

    def __init__(self, run_dir: Path, total_steps: int, progress: str, tensorboard: bool = False, wandb: Any = None):
        """`wandb`: the run's config where logging.wandb.project is set (observe/wandb_log.py), else None."""
        self.run_dir, self.total_steps, self.use_tensorboard = Path(run_dir), total_steps, tensorboard
        self.wandb_config, self.wandb = wandb, None
        self.path = self.run_dir / "metrics.jsonl"
        self.progress = ("bar" if sys.stdout.isatty() else "lines") if progress == "auto" else progress
        self.step = 0  # the last step recorded
        self.held: dict[str, Any] | None = None
        self.file = self.tensorboard = self.bar = None

    def hold(self, record: dict[str, Any]) -> None:
        """The record of a step being saved, whose line is written after the save: saved with it, so a
        kill between the commit and the line loses nothing."""
        self.held = record

    def state_dict(self) -> dict[str, Any]:
        held = self.held is not None and self.held["step"] > self.step
        return {"step": self.held["step"], "record": dict(self.held)} if held else {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        kept = self._lines_up_to(self.step) if self.path.is_file() else []
        previous = json.loads(kept[-1])["step"] if kept else 0
        if "record" in state and previous == self.step - 1:  # killed after the commit, before the line
            kept.append(json.dumps(state["record"]) + "\n")
        if kept or self.path.is_file():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(kept))
        if self.bar is not None:  # a rollback in the run (train.spike_guard): its steps are counted again
            self.bar.n = self.step
            self.bar.refresh()

    def start_afresh(self, report: Callable[[str], None] | None) -> Path | None:
        """A run starting from scratch over records of an earlier start: dropped where that start committed
        no checkpoint (it never happened, as far as the run goes: a restart, a relaunch); kept beside, named
        and `report`ed, where it did (checkpoint.resume=false, or no checkpoint verified). Returns where they
        were kept."""
        kept = None
        if not self.path.is_file() or not self.path.stat().st_size:
            return kept
        if report is not None:
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
            while (kept := self.path.with_name(f"metrics.{stamp}{f'-{n}' if n else ''}.jsonl")).exists():
                n += 1  # two starts in one second: the earlier one's records are never overwritten
            self.path.rename(kept)
            report(f"training from scratch: the earlier records in {self.path.name} are kept in {kept.name}")
        self.load_state_dict({"step": 0})
        return kept

    def _lines_up_to(self, step: int) -> list[str]:
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
                break
        return kept

    def _open(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        if self.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package ('.[viz]')

            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        if self.wandb_config is not None:
            from hpc_train.observe.wandb_log import WandbLog

            self.wandb = WandbLog(self.wandb_config)
        if self.progress == "bar":
            self.bar = tqdm(total=self.total_steps, initial=self.step, unit="step")

    def write(self, record: dict[str, Any], show: bool = True) -> None:
        if self.file is None:
            self._open()
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.step = record["step"]
        if self.tensorboard is not None:
            for key, value in flatten(record).items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)
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
        for handle in (self.bar, self.tensorboard, self.wandb, self.file):
            if handle is not None:
                handle.close()
        self.file = self.tensorboard = self.wandb = self.bar = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file a run appends to, up to a line being written (or cut short by a kill); [] without one."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl records."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def last_step(run_dir: str | Path) -> int | None:
    """The last step metrics.jsonl records (None before the first)."""
    records = read_records(run_dir)
    return records[-1]["step"] if records else None


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
        *([f"mfu {100 * r['mfu']:.1f}%"] if "mfu" in r else []), f"mem {r['memory_gb']:.2f}GB",
    ]  # fmt: skip
    return " | ".join(parts)


@dataclass
class StepMeter:
    """Turns one step's time and memory into its metrics record fields: throughput, MFU, memory by
    category (with the planner's prediction beside the first measurements) and the phase breakdown."""

    tokens_per_step: int  # global batch x sequence length
    flops_per_token: int
    world_size: int
    peak_flops: float | None  # per device, where known (metrics.device_peak_flops): MFU's denominator
    bubble_fraction: float  # the pipeline's idle share of forward+backward (0 without pipelining)
    predicted: dict[str, int]  # the planner's bytes by category
    first_step: int  # the first step of this run (after a resume)

    def fields(
        self,
        step: int,
        elapsed: float,
        memory: dict[str, int],
        peak_memory: tuple[float, float, float],
        timings: dict[str, float] | None,
    ) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / elapsed
        out = {
            "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * self.flops_per_token / self.world_size / 1e12,
            "memory_gb": peak_memory[0] / 1e9,  # max over ranks
            "memory_reserved_gb": peak_memory[1] / 1e9,
            "host_memory_gb": peak_memory[2] / 1e9,  # max over ranks
            "step_time_s": elapsed,
        }
        if self.peak_flops:
            out["mfu"] = tokens_per_s * self.flops_per_token / (self.world_size * self.peak_flops)
        if memory:  # rank 0's, by category: measured on the run's first two steps (and a profiled one)
            out["memory_bytes"] = memory
        if step < self.first_step + 2:
            out["memory_predicted_bytes"] = self.predicted
        if timings is not None:
            bubble = self.bubble_fraction * timings["forward_backward"]
            out["time_breakdown_s"] = {**timings, "pipeline_bubble_est": bubble, "total": elapsed}
        return out
