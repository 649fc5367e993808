"""ZeRO-1 and -2 with optim.offload=nvme: the owned slice's fp32 master weights and AdamW moments in files on
the node's disk (optim/nvme.py), streamed through a bounded ring of host buffers at each update.

The strategies are ZeRO-1's and ZeRO-2's (gradients reduced, checked and clipped on the device as there);
what changes is where the state lives. The masters are never whole in memory: the spans' master tensors are
meta placeholders, and the update reads each chunk of masters and moments from the files, copies the owned
gradients of the chunk into the ring, runs torch's fused AdamW kernel on it (the one the in-memory rule
runs, so the same arithmetic), writes the chunk back behind it and keeps the updated weights, in the
parameters' dtype, on the device for the all-gather. A checkpoint reads each parameter's state from the
files (the writers' share, as ZeRO-1's save holds it) and a resume writes them from the checkpoint.
"""

from __future__ import annotations

import os
import time

import torch

from hpc_train.config import OptimConfig
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.nvme import MEMORY_FILESYSTEMS, Chunk, StateFiles
from hpc_train.optim.rules import Target
from hpc_train.optim.rules.adamw import MOMENTS
from hpc_train.optim.zero import Zero2Optimizer, ZeroOptimizer, _flat_slice, _Span
from hpc_train.placement import local
from hpc_train.resilience.faults import fault_point

KEYS = ("master", *MOMENTS)


class StreamedAdamW:
    """The rule's face for a strategy whose state is in files: which keys it keeps and whether it has stepped.
    The arithmetic is `NvmeState._update_chunk`'s; this holds the hyperparameters and the step count."""

    state_keys = MOMENTS
    gathers_matrices = False
    block_size = 1

    def __init__(self, targets: list[Target], cfg: OptimConfig) -> None:
        self.decay = {id(t.tensor): t.decay for t in targets}
        self.cfg = cfg
        self.step_count = torch.zeros((), dtype=torch.float32)  # AdamW's step, as torch keeps it (a float)

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return MOMENTS

    def state(self, tensor: torch.Tensor) -> dict[str, None]:
        """Non-empty once stepped (the values are read from the files by the strategy)."""
        return dict.fromkeys(MOMENTS) if self.step_count.item() > 0 else {}

    def zero_grad(self) -> None:
        pass

    def state_bytes(self) -> int:
        return 0  # on disk


class NvmeState:
    """Mixed in before ZeroOptimizer or Zero2Optimizer (see the module docstring)."""

    files: StateFiles
    rule: StreamedAdamW
    buckets: list

    def __init__(self, model: ParallelModel, cfg: OptimConfig, params: list | None = None, role: str = "dp_cp"):
        self.cfg, self.role = cfg, role
        super().__init__(model, cfg, params, role)  # type: ignore[call-arg]
        self.state_device = torch.device("cpu")  # where a save's or a state copy's share is read to, not the GPU
        self.offloaded = ()  # the state is on disk; the ring is its host buffers, the updated weights on the device
        self.spans = [s for b in self.buckets for s in b.spans]
        # the updated weights of the owned slice in the parameters' dtype, on the device, for the all-gather
        # (made at the first update: the precision policy casts the parameters after construction)
        self.updated = torch.empty(0, device=self.device)
        start = time.perf_counter()
        self._write_state(lambda span, key: _flat_slice(span.param, span.param_offset, span.numel)
                          if key == "master" else None)  # fmt: skip
        self.write_gbps = self.files.disk_bytes / max(time.perf_counter() - start, 1e-9) / 1e9  # the first fill's

    def _new_master(self, numel: int) -> torch.Tensor:
        pinned = self.device.type == "cuda"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # a job's own directory (its restarts reuse it; another job on the node has its own), a rank's own files
        # in it (under ep: the experts' too)
        job = os.environ.get("SLURM_JOB_ID") or f"local{os.getppid()}"
        name = f"{job}/rank{rank:05d}" + ("" if self.role == "dp_cp" else f"-{self.role}")
        self.files = StateFiles(self.cfg.offload_dir, name, KEYS, numel, int(self.cfg.offload_buffer_mb * 2**20),
                                pinned)  # fmt: skip
        return torch.empty(numel, dtype=torch.float32, device="meta")  # never whole in memory

    def _make_rule(self, targets: list[Target], cfg: OptimConfig) -> StreamedAdamW:
        return StreamedAdamW(targets, cfg)

    def _overlaps(self, chunk: Chunk) -> list[tuple[_Span, int, int]]:
        """The spans a chunk of the owned slice covers: (span, first, last + 1) in the slice's elements."""
        end = chunk.start + chunk.numel
        return [(s, max(s.offset, chunk.start), min(s.offset + s.numel, end)) for s in self.spans
                if s.offset < end and s.offset + s.numel > chunk.start]  # fmt: skip

    @torch.no_grad()
    def _write_state(self, value) -> None:
        """Every chunk of the files written from `value(span, key)` (a flat tensor of the span's elements, or
        None for zeros): no reads."""

        def fill(chunk: Chunk) -> None:
            for key in KEYS:
                chunk.slot[key].zero_()
            for span, lo, hi in self._overlaps(chunk):
                for key in KEYS:
                    values = value(span, key)
                    if values is not None:
                        part = values.reshape(-1)[lo - span.offset : hi - span.offset]
                        chunk.slot[key][lo - chunk.start : hi - chunk.start].copy_(part)

        self.files.stream(fill, read=False)

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """Each chunk: its gradients to the ring, torch's fused AdamW over it, the new weights to the device;
        then the all-gather into the parameters. A skipped step changes no state and no step count."""
        found_inf = None if skip is None else skip.to("cpu", torch.float32)
        if found_inf is not None and found_inf.item():  # a dropped step changes nothing: no pass over the disk
            return
        dtype = local(self.params[0]).dtype if self.params else torch.float32
        if self.dp > 1 and (self.updated.numel() != self.master.numel() or self.updated.dtype != dtype):
            self.updated = torch.empty(self.master.numel(), dtype=dtype, device=self.device)
        self.rule.step_count.add_(1)
        grads = {id(s): g for b in self.buckets for s, g in zip(b.spans, self._owned_grads(b), strict=True)}
        cfg = self.cfg

        def update(chunk: Chunk) -> None:
            groups: dict[bool, list[list[torch.Tensor]]] = {True: [[], [], [], []], False: [[], [], [], []]}
            pieces = self._overlaps(chunk)
            for span, lo, hi in pieces:
                at = slice(lo - chunk.start, hi - chunk.start)
                grad = chunk.slot["grad"][at]
                grad.copy_(grads[id(span)][lo - span.offset : hi - span.offset])
                group = groups[self.rule.decay[id(span.master)]]
                for i, tensor in enumerate((chunk.slot["master"][at], grad, *(chunk.slot[k][at] for k in MOMENTS))):
                    group[i].append(tensor)
            for decay, (params, grads_, exp_avgs, exp_avg_sqs) in groups.items():
                if params:
                    torch._fused_adamw_(params, grads_, exp_avgs, exp_avg_sqs, [], [self.rule.step_count] * len(params),
                                        lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                        weight_decay=cfg.weight_decay if decay else 0.0, eps=cfg.eps, amsgrad=False,
                                        maximize=False, grad_scale=None, found_inf=found_inf)  # fmt: skip
            if self.dp > 1:  # the spans lie back to back in the owned slice: the chunk is theirs whole
                self.updated[chunk.start : chunk.start + chunk.numel].copy_(chunk.slot["master"])
                return
            for span, lo, hi in pieces:  # dp 1: every span is a whole parameter, written in place
                at = span.param_offset + lo - span.offset
                values = chunk.slot["master"][lo - chunk.start : hi - chunk.start]
                local(span.param).view(-1)[at : at + hi - lo].copy_(values)

        self.files.stream(update)
        # a failure test's kill here finds the files a step ahead of every checkpoint
        fault_point("nvme_written", int(self.rule.step_count.item()), torch.distributed.get_rank())
        if found_inf is not None:
            self.rule.step_count.sub_(found_inf)
        if self.dp > 1:
            self._gather_params(lambda span: self.updated[span.offset : span.offset + span.numel])

    def _span_state(self, span: _Span, key: str, rule_state: dict) -> torch.Tensor:
        """A span's `key`, read from its file into host memory (a checkpoint's or a state copy's share)."""
        return self.files.read_range(key, span.offset, span.numel)

    def _to_writers(self, bucket, owned: list[torch.Tensor]) -> dict:
        """At dp 1 the spans' values as read, in host memory (ZeRO-1's would go to the device)."""
        if self.dp == 1:
            return {s.param: values for s, values in zip(bucket.spans, owned, strict=True)}
        return super()._to_writers(bucket, owned)  # type: ignore[misc]

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """The files written from each span's saved state (a master not saved: the loaded weights; moments
        not saved: zeros, and the step count starts again, as AdamW's does)."""
        by_param = {id(p): s for p, s in zip(self.params, states, strict=True)}
        saved = all(all(k in by_param[id(s.param)] for k in MOMENTS) for s in self.spans)
        on_host: dict[tuple[int, str], torch.Tensor | None] = {}  # each span's value moved to the host once

        def value(span: _Span, key: str) -> torch.Tensor | None:
            if (id(span), key) not in on_host:
                state = by_param[id(span.param)]
                if key == "master":
                    master = state.get("master")
                    given = _flat_slice(span.param, span.param_offset, span.numel) if master is None else master
                else:
                    given = state[key] if saved and key in state else None
                on_host[id(span), key] = None if given is None else local(given).detach().reshape(-1).cpu()
            return on_host[id(span), key]

        self._write_state(value)
        self.rule.step_count.fill_(float(step) if saved else 0.0)

    def state_bytes(self) -> int:
        """On the device: the owned slice's updated weights awaiting the all-gather, at dp > 1 (the state is
        on disk; at dp 1 the update writes the parameters in place)."""
        return self.updated.nbytes

    def host_buffer_bytes(self) -> int:
        return self.files.buffer_bytes

    def disk_bytes(self) -> int:
        return self.files.disk_bytes

    def close(self) -> None:
        """The working copy let go: threads stopped, files deleted (the checkpoints hold the state)."""
        self.files.close()

    def describe(self) -> str:
        """The start-up line: where the state is, how it is written, and the disk's speed at the first fill."""
        direct = "O_DIRECT" if self.files.direct else "buffered writes (the filesystem refuses O_DIRECT)"
        if self.files.filesystem in MEMORY_FILESYSTEMS:
            direct += f"; on {self.files.filesystem}, so the state is in host memory after all"
        return (f"optim.offload=nvme: {self.files.disk_bytes / 2**30:.3f} GiB of optimizer state in {self.files.dir} "
                f"({direct}; written at {self.write_gbps:.2f} GB/s at start-up), through "
                f"{self.files.buffer_bytes / 2**20:.1f} MiB of host buffers")  # fmt: skip


class NvmeZeroOptimizer(NvmeState, ZeroOptimizer):
    """zero_stage 1 with optim.offload=nvme."""


class NvmeZero2Optimizer(NvmeState, Zero2Optimizer):
    """zero_stage 2 with optim.offload=nvme."""
