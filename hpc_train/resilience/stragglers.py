"""Naming slow ranks: every rank times its own compute (forward and backward, without the data-parallel
waits that make every step as slow as the slowest rank's); every `logging.straggler_interval` steps one
all-gather of the interval's means shows which ranks compute slower than their peers' median (the other
ranks doing the same work), and by how much."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.bootstrap import node_name
from hpc_train.config import LoggingConfig


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
        """On the interval's last step: every rank's mean step and compute seconds, and `find_stragglers`."""
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
        stragglers = find_stragglers(compute_s, [peers for _, _, peers in self.where], self.threshold)
        for s in stragglers:
            s["host"], s["device"] = self.where[s["rank"]][:2]
        return {"rank_step_s": step_s, "rank_compute_s": compute_s, "stragglers": stragglers}


def find_stragglers(compute_s: list[float], peers: list[tuple[int, ...]], threshold: float) -> list[dict[str, Any]]:
    """The ranks whose compute exceeds the median of their peers' (the other ranks with the same `peers` key,
    itself excluded) by more than `threshold`, slowest first. Excluding the rank keeps one slow rank from
    raising its own yardstick: at dp=2 a rank is named when it is `threshold` slower than its one peer
    (counting itself, the median of two would need 1 + 2 * threshold). A rank without peers (dp=1) is
    never named: nothing does the same work to compare it with."""
    stragglers = []
    for rank, (compute, key) in enumerate(zip(compute_s, peers, strict=True)):
        others = [c for r, (c, k) in enumerate(zip(compute_s, peers, strict=True)) if k == key and r != rank]
        median = statistics.median(others) if others else 0.0
        if median > 0 and compute > median * (1 + threshold):
            slower = round(compute / median, 3)
            stragglers.append({"rank": rank, "compute_s": compute, "median_s": median, "slower": slower})
    return sorted(stragglers, key=lambda s: -s["slower"])


def describe_stragglers(stragglers: list[dict[str, Any]], step: int, interval: int) -> str:
    """One log line naming the slow ranks of the interval that ended at `step`."""
    named = "; ".join(
        f"rank {s['rank']} (host {s['host']}, {s['device']}) computes {s['slower']:.2f}x its peers' median "
        f"({s['compute_s']:.3f} s vs {s['median_s']:.3f} s per step)"
        for s in stragglers
    )
    return f"stragglers over steps {step - interval + 1}-{step}: {named}"
