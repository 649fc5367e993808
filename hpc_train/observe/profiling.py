"""Looking inside a run: a torch.profiler window (and a CUDA memory snapshot) over chosen steps, a
memory summary when a step runs out of memory, and per-phase step timing."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch


class ProfileWindow:
    """logging.profile_steps=[a, b]: trace steps a..b into <run_dir>/profile/ (per rank)."""

    def __init__(self, steps: list[int], run_dir: Path, rank: int, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.out, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self.profiler = None

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history()
        self.profiler = torch.profiler.profile(activities=activities, profile_memory=True)
        self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is None or step != self.last:
            return
        self.profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.out / f"trace_rank{self.rank:05d}.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory_snapshot_rank{self.rank:05d}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profiler = None


def write_oom_report(run_dir: Path, rank: int, device: torch.device, last_memory: dict[str, int]) -> Path:
    """What was allocated when a step ran out of memory: CUDA's allocator summary, and the last measured
    bytes by category, into <run_dir>/oom_rank<r>.txt."""
    lines = [f"out of memory on rank {rank} ({device})", "last measured bytes by category:"]
    lines += [f"  {k:<28} {v / 2**30:10.3f} GiB" for k, v in last_memory.items()]
    if device.type == "cuda":
        lines.append(torch.cuda.memory_summary(device))
    path = Path(run_dir) / f"oom_rank{rank:05d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def timed(timings: dict[str, float] | None, key: str, device: torch.device):
    """Adds the wall time of the block to timings[key] (synchronizing CUDA so the time is the GPU's)."""
    if timings is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - start
