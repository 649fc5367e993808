"""Naming slow ranks: every rank times its own compute (forward and backward, without the data-parallel
waits that make every step as slow as the slowest rank's); every `logging.straggler_interval` steps one
all-gather of the interval's means shows which ranks compute slower than their peers' median, and by how
much."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.config import LoggingConfig
from hpc_train.launch.bootstrap import node_name


class ComputeClock:
    """The seconds of the compute spans of one step: CUDA events on a GPU (read after the step has
    synchronized, so timing adds no synchronization), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start: Any = None
        self.spans: list[tuple[Any, Any]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self) -> ComputeClock:
        self.start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.spans.append((self.start, self._now()))

    def take(self) -> float:
        """The seconds of the spans since the last take (the step must have finished on the device)."""
        spans, self.spans = self.spans, []
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1e3
        return sum(end - start for start, end in spans)


class StragglerMonitor:
    """Accumulates this rank's step and compute seconds; `report` gathers the interval's means (every rank
    calls it at the same steps) and returns rank 0's metrics record fields. A rank is compared only with
    the ranks doing the same work, `peers` (its pipeline stage and tensor-parallel rank, across the
    data-parallel replicas): stages differ in work, and a tensor-parallel group waits on its slowest rank."""

    def __init__(self, log: LoggingConfig, device: torch.device, peers: tuple[int, ...]):
        self.interval, self.threshold, self.device = log.straggler_interval, log.straggler_threshold, device
        self.clock = ComputeClock(device)
        self.sums, self.count = [0.0, 0.0], 0
        self.where: list[tuple[str, str, tuple[int, ...]]] = [("", "", ())] * dist.get_world_size()
        if self.interval:  # who is where and compares with whom, once
            dist.all_gather_object(self.where, (node_name(), str(device), peers))

    def add(self, step_s: float) -> None:
        """After a step: its wall seconds (the clock keeps its compute spans until `report`, when the step
        has finished on the device: reading them sooner would wait for it)."""
        if self.interval:
            self.sums[0] += step_s
            self.count += 1
        else:
            self.clock.spans.clear()

    def due(self, step: int) -> bool:
        """`report` gathers at this step (the loop reads the device first)."""
        return bool(self.interval) and step % self.interval == 0

    def report(self, step: int) -> dict[str, Any] | None:
        """On the interval's last step: every rank's mean step and compute seconds, and the ranks whose compute
        exceeds the median of their peers' by more than `threshold` (a fraction), slowest first."""
        if not self.due(step):
            return None
        self.sums[1] = self.clock.take()
        means = torch.tensor([s / max(1, self.count) for s in self.sums], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(means) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, means)
        self.sums, self.count = [0.0, 0.0], 0
        table = torch.stack(gathered).tolist()  # one copy to the host, not one per value
        step_s = [round(row[0], 6) for row in table]
        compute_s = [round(row[1], 6) for row in table]
        by_peers: dict[tuple[int, ...], list[float]] = {}
        for c, (_, _, peers) in zip(compute_s, self.where, strict=True):
            by_peers.setdefault(peers, []).append(c)
        medians = {peers: statistics.median(values) for peers, values in by_peers.items()}
        stragglers = []
        for rank, (node, device, peers) in enumerate(self.where):
            median = medians[peers]
            if median > 0 and compute_s[rank] > median * (1 + self.threshold):
                stragglers.append({"rank": rank, "host": node, "device": device, "compute_s": compute_s[rank],
                                   "median_s": median, "slower": round(compute_s[rank] / median, 3)})  # fmt: skip
        stragglers.sort(key=lambda s: -s["slower"])
        return {"rank_step_s": step_s, "rank_compute_s": compute_s, "stragglers": stragglers}


def describe_stragglers(stragglers: list[dict[str, Any]], step: int, interval: int) -> str:
    """One log line naming the slow ranks of the interval that ended at `step`."""
    named = "; ".join(
        f"rank {s['rank']} (host {s['host']}, {s['device']}) computes {s['slower']:.2f}x the median "
        f"({s['compute_s']:.3f} s vs {s['median_s']:.3f} s per step)"
        for s in stragglers
    )
    return f"stragglers over steps {step - interval + 1}-{step}: {named}"
