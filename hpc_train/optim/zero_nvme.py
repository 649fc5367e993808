"""ZeRO-1, -2 and -3 with optim.offload=nvme: the owned slice's fp32 master weights and the update rule's state
(AdamW's moments; Muon's momentum for a matrix, in the first moment's place) in files on the node's disk
(optim/nvme.py), streamed through a bounded ring of host buffers at each update.

The strategies are ZeRO-1's and ZeRO-2's (gradients reduced, checked and clipped on the device as there);
what changes is where the state lives. The masters are never whole in memory: the spans' master tensors are
meta placeholders, and the update reads each chunk of masters and moments from the files, copies the owned
gradients of the chunk into the ring, runs torch's fused AdamW kernel on it (the one the in-memory rule
runs, so the same arithmetic), writes the chunk back behind it and keeps the updated weights, in the
parameters' dtype, on the device for the all-gather. A checkpoint reads each parameter's state from the
files (the writers' share, as ZeRO-1's save holds it) and a resume writes them from the checkpoint.
ZeRO-3 (`NvmeFullyShardedOptimizer`): FSDP2's shards (the masters) and gradients stay in host memory, and
only the moments are in files. AdamW's step is counted per span or parameter, as torch counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hpc_train.config import OptimConfig
from hpc_train.distributed.agree import raise_together
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.data_parallel import whole_dtensors
from hpc_train.optim.fsdp import FullyShardedOptimizer
from hpc_train.optim.nvme import MEMORY_FILESYSTEMS, Chunk, FileRegion, Scratch, StateFiles
from hpc_train.optim.rules import Target, target
from hpc_train.optim.rules.adamw import MOMENTS
from hpc_train.optim.rules.muon import MOMENTUM, decayed_step, nesterov_update, orthogonalize
from hpc_train.optim.zero import Zero2Optimizer, ZeroOptimizer, _flat_slice, _Span
from hpc_train.placement import local
from hpc_train.resilience.faults import fault_point

KEYS = ("master", *MOMENTS)


def rank_files(cfg: OptimConfig, keys: tuple[str, ...], numel: int, pinned: bool, role: str = "dp_cp",
               extra: tuple[str, ...] = ("grad",)) -> StateFiles:  # fmt: skip
    """This rank's files in optim.offload_dir, unnamed: only this process reaches them, so another job or a
    restart on the node never meets them, and nothing is left once the process ends (under ep the experts'
    state has its own files). The name is what messages call them."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    name = f"rank{rank:05d}" + ("" if role == "dp_cp" else f"-{role}")
    return StateFiles(cfg.offload_dir, name, keys, numel, int(cfg.offload_buffer_mb * 2**20), pinned, extra)


def dropped(skip: torch.Tensor | None) -> bool:
    """Whether the step is dropped (an fp16 overflow): it changes nothing, so there is no pass over the disk."""
    return skip is not None and bool(skip.item())


def adamw(groups: dict[bool, list[list[torch.Tensor]]], lr: float, cfg: OptimConfig) -> None:
    """torch's fused AdamW kernel (the in-memory rule's) over a chunk's pieces: [params, grads, exp_avgs,
    exp_avg_sqs, steps] with and without weight decay; each piece's step already counted."""
    for decay, (params, grads, exp_avgs, exp_avg_sqs, steps) in groups.items():
        if params:
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr,
                                beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay if decay else 0.0,
                                eps=cfg.eps, amsgrad=False, maximize=False)  # fmt: skip


def covered(chunk: Chunk, extents: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The items of a flat layout a chunk covers, their (start, numel) in `extents`: (index, first, last + 1)
    in the layout's elements."""
    end = chunk.start + chunk.numel
    return [(i, max(start, chunk.start), min(start + numel, end)) for i, (start, numel) in enumerate(extents)
            if start < end and start + numel > chunk.start]  # fmt: skip


@torch.no_grad()
def write_all(files: StateFiles, keys: tuple[str, ...], extents: list[tuple[int, int]], value,
              kept: frozenset[tuple[int, str]] = frozenset()) -> None:  # fmt: skip
    """Every chunk of `files` written from `value(i, key)`: item i's values (None: zeros), the items laid out
    at their (start, numel) `extents`; the (i, key) in `kept` are in the files already (a resume loaded them
    there) and stay as they are. No reads when nothing is kept; no pass when everything is."""
    if len(kept) == len(extents) * len(keys):
        return

    def fill(chunk: Chunk) -> None:
        if not kept:
            for key in keys:
                chunk.slot[key].zero_()
        for i, lo, hi in covered(chunk, extents):
            for key in keys:
                if (i, key) in kept:
                    continue
                values, start = value(i, key), extents[i][0]
                into = chunk.slot[key][lo - chunk.start : hi - chunk.start]
                into.zero_() if values is None else into.copy_(values.reshape(-1)[lo - start : hi - start])

    files.stream(fill, read=bool(kept))


def in_place(given: torch.Tensor | None, target: torch.Tensor | None) -> bool:
    """Whether a loaded value is the load target itself (the files' mapped pages: loaded into them)."""
    if given is None or target is None or not target.numel():
        return False
    return local(given).data_ptr() == target.data_ptr()


def muon_momentum(momentum: torch.Tensor, grad: torch.Tensor, cfg: OptimConfig) -> torch.Tensor:
    """Muon's momentum updated in place by `grad` (a chunk's, in the ring), and the update it gives, as Muon's."""
    momentum.lerp_(grad, 1 - cfg.momentum)
    return nesterov_update(grad, momentum, cfg)


def decay_groups() -> dict[bool, list[list[torch.Tensor]]]:
    return {True: [[], [], [], [], []], False: [[], [], [], [], []]}


class OnDisk:
    """What a strategy with its state in `files` reports: the ring in host memory, the files on disk, the
    start-up line; and lets go of them at the run's end."""

    files: StateFiles
    write_gbps: float
    holds = "optimizer state"

    def host_buffer_bytes(self) -> int:
        return self.files.buffer_bytes

    def disk_bytes(self) -> int:
        return self.files.disk_bytes

    def close(self) -> None:
        """The working copy let go: threads stopped, files closed, their space freed (the checkpoints hold the
        state)."""
        self.files.close()

    def _first_fill(self, fill: Callable[[], None]) -> None:
        """The files written at start-up, timed: the disk's write speed for the start-up line."""
        start = time.perf_counter()
        fill()
        self.write_gbps = self.files.disk_bytes / max(time.perf_counter() - start, 1e-9) / 1e9

    def update_s(self) -> float:
        """What an update's passes over the files (every byte read and written) cost at the speed the first
        fill measured: the planner's disk term, at this disk's speed rather than the one it assumes."""
        return 2 * (self.files.disk_bytes + self.second_pass_bytes()) / 1e9 / max(self.write_gbps, 1e-9)

    def second_pass_bytes(self) -> int:
        """Bytes of the files an update reads again (and writes) after its first pass."""
        return 0

    def describe(self) -> str:
        """The start-up line: where the state is, how it is written, the disk's speed at the first fill and what
        an update's disk traffic costs at that speed."""
        direct = "O_DIRECT" if self.files.direct else "buffered writes (the filesystem refuses O_DIRECT)"
        if self.files.filesystem in MEMORY_FILESYSTEMS:
            direct += f"; on {self.files.filesystem}, so the state is in host memory after all"
        return (f"optim.offload=nvme: {self.files.disk_bytes / 2**30:.3f} GiB of {self.holds} in unnamed files in "
                f"{self.files.dir} ({direct}; written at {self.write_gbps:.2f} GB/s at start-up: an update reads "
                f"and writes it, {self.update_s():.2f} s a step at that speed), through "
                f"{self.files.buffer_bytes / 2**20:.1f} MiB of host buffers")  # fmt: skip


class StreamedRule:
    """The rule's face for a strategy whose state is in files, AdamW or Muon: which keys it keeps, which
    targets are Muon's matrices (their momentum lies where AdamW's first moment would, the second moment's
    place unused) and whether a target has stepped. The arithmetic is `NvmeState.step`'s; this holds each
    target's weight decay and AdamW step."""

    block_size = 1

    def __init__(self, targets: list[Target], cfg: OptimConfig) -> None:
        self.gathers_matrices = cfg.name == "muon"
        self.state_keys = (MOMENTUM, *MOMENTS) if self.gathers_matrices else MOMENTS
        self.matrices = [t for t in targets if self.gathers_matrices and t.matrix_shape is not None]
        self.matrix_ids = {id(t.tensor) for t in self.matrices}
        self.decay = {id(t.tensor): t.decay for t in targets}
        # AdamW's step per target, as torch keeps it (a float tensor each): a resume may start one afresh
        self.steps = {id(t.tensor): torch.zeros((), dtype=torch.float32) for t in targets}

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return (MOMENTUM,) if self.gathers_matrices and matrix else MOMENTS

    def file_of(self, tensor: torch.Tensor, key: str) -> str | None:
        """The file holding a target's `key` (None: not the target's state, e.g. a matrix's exp_avg)."""
        if key == "master":
            return key
        if id(tensor) in self.matrix_ids:
            return "exp_avg" if key == MOMENTUM else None
        return key if key in MOMENTS else None

    def held_in(self, tensor: torch.Tensor, file: str) -> str | None:
        """The key a target's place in `file` holds (None: unused, a Muon matrix's in exp_avg_sq)."""
        if file == "master" or id(tensor) not in self.matrix_ids:
            return file
        return MOMENTUM if file == "exp_avg" else None

    def state(self, tensor: torch.Tensor) -> dict[str, None]:
        """Non-empty once stepped (the values are read from the files by the strategy)."""
        keys = (MOMENTUM,) if id(tensor) in self.matrix_ids else MOMENTS
        return dict.fromkeys(keys) if self.steps[id(tensor)].item() > 0 else {}

    def zero_grad(self) -> None:
        pass

    def state_bytes(self) -> int:
        return 0  # on disk


class NvmeState(OnDisk):
    """Mixed in before ZeroOptimizer or Zero2Optimizer (see the module docstring)."""

    files: StateFiles
    rule: StreamedRule
    buckets: list

    def __init__(self, model: ParallelModel, cfg: OptimConfig, params: list | None = None, role: str = "dp_cp"):
        self.cfg, self.role = cfg, role
        super().__init__(model, cfg, params, role)  # type: ignore[call-arg]
        self.offloaded = ()  # the state is on disk; the ring is its host buffers, the updated weights on the device
        self.spans = [s for b in self.buckets for s in b.spans]
        self.extents = [(s.offset, s.numel) for s in self.spans]  # back to back in the owned slice
        # the updated weights of the owned slice in the parameters' dtype, on the device, for the all-gather
        # (made at the first update: the precision policy casts the parameters after construction)
        self.updated = torch.empty(0, device=self.device)
        self.targets: dict[tuple[int, str], torch.Tensor] = {}  # what `load_targets` handed out, by span and key

        def weights(span: _Span, key: str) -> torch.Tensor | None:  # the masters from the model, moments at zero
            return _flat_slice(span.param, span.param_offset, span.numel) if key == "master" else None

        self._first_fill(lambda: self._write_state(weights))

    def second_pass_bytes(self) -> int:
        """Muon's: the masters' file, once its matrices' updates are orthogonalized."""
        return self.files.disk_bytes // len(KEYS) if self.rule.matrices else 0

    def _new_master(self, numel: int) -> torch.Tensor:
        self.files = rank_files(self.cfg, KEYS, numel, self.device.type == "cuda", self.role)
        return torch.empty(numel, dtype=torch.float32, device="meta")  # never whole in memory

    def _make_rule(self, targets: list[Target], cfg: OptimConfig) -> StreamedRule:
        return StreamedRule(targets, cfg)

    def _write_state(self, value, kept: frozenset[tuple[int, str]] = frozenset()) -> None:
        """The files written from `value(span, key)` (a tensor of the span's elements, or None for zeros), but
        for the (span index, key) `kept`."""
        write_all(self.files, KEYS, self.extents, lambda i, key: value(self.spans[i], key), kept)

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """Each chunk: its gradients to the ring, torch's fused AdamW over it, the new weights to the device;
        then the all-gather into the parameters. Muon's matrices: their momentum updated in the same pass and
        the update kept in the owned gradients, orthogonalized whole, then applied in a second pass over the
        masters (`_apply_matrix_updates`). A skipped step changes no state and no step count."""
        if dropped(skip):
            return
        dtype = local(self.params[0]).dtype if self.params else torch.float32
        if self.dp > 1 and (self.updated.numel() != self.master.numel() or self.updated.dtype != dtype):
            self.updated = torch.empty(self.master.numel(), dtype=dtype, device=self.device)
        steps = [self.rule.steps[id(s.master)] for s in self.spans]
        torch._foreach_add_(steps, 1.0)
        grads = {id(s): g for b in self.buckets for s, g in zip(b.spans, self._owned_grads(b), strict=True)}
        cfg, matrices = self.cfg, self.rule.matrix_ids

        def update(chunk: Chunk) -> None:
            groups = decay_groups()
            pieces = [(self.spans[i], lo, hi) for i, lo, hi in covered(chunk, self.extents)]
            for span, lo, hi in pieces:
                at = slice(lo - chunk.start, hi - chunk.start)
                grad, owned = chunk.slot["grad"][at], grads[id(span)][lo - span.offset : hi - span.offset]
                grad.copy_(owned)
                if id(span.master) in matrices:  # Muon's momentum (in exp_avg's place); its update kept in the gradient
                    owned.copy_(muon_momentum(chunk.slot["exp_avg"][at], grad, cfg))
                    continue
                group = groups[self.rule.decay[id(span.master)]]
                pieces_ = (chunk.slot["master"][at], grad, *(chunk.slot[k][at] for k in MOMENTS),
                           self.rule.steps[id(span.master)])  # fmt: skip
                for i, tensor in enumerate(pieces_):
                    group[i].append(tensor)
            adamw(groups, lr, cfg)
            self._to_weights(chunk, pieces)

        self.files.stream(update)
        if self.rule.gathers_matrices and self.matrices:  # every dp rank, owning a matrix or not: it gathers
            self._apply_matrix_updates(lr, grads)
        # a failure test's kill here finds the files a step ahead of every checkpoint
        fault_point("nvme_written", int(steps[0].item()) if steps else 0, torch.distributed.get_rank())
        if self.dp > 1:
            self._gather_params(lambda span: self.updated[span.offset : span.offset + span.numel])

    def _to_weights(self, chunk: Chunk, pieces: list[tuple[_Span, int, int]]) -> None:
        """A chunk's updated masters kept on the device for the all-gather (dp > 1: the spans lie back to back
        in the owned slice, the chunk is theirs whole), or written into the parameters (dp 1: every span is a
        whole parameter)."""
        if self.dp > 1:
            self.updated[chunk.start : chunk.start + chunk.numel].copy_(chunk.slot["master"])
            return
        for span, lo, hi in pieces:
            at = span.param_offset + lo - span.offset
            values = chunk.slot["master"][lo - chunk.start : hi - chunk.start]
            local(span.param).view(-1)[at : at + hi - lo].copy_(values)

    def _apply_matrix_updates(self, lr: float, grads: dict[int, torch.Tensor]) -> None:
        """Muon's second pass: the updates the first left in the owned gradients orthogonalized whole (gathered
        over dp and tp, as Muon's in memory), then each chunk's matrix masters decayed and stepped by them (a
        pass over the masters' file only)."""
        cfg, matrices = self.cfg, self.rule.matrices
        span_of = {id(s.master): s for s in self.spans}
        whole = self._whole_matrices(lambda m: orthogonalize(m, cfg.ns_steps), matrices,
                                     [grads[id(span_of[id(t.tensor)])] for t in matrices])  # fmt: skip
        steps = {id(t.tensor): (u, t.matrix_shape) for t, u in zip(matrices, whole, strict=True)}
        if not steps:  # owns no matrix (its dp ranks' gathers joined): the first pass updated everything
            return

        def update(chunk: Chunk) -> None:
            pieces = [(self.spans[i], lo, hi) for i, lo, hi in covered(chunk, self.extents)]
            for span, lo, hi in pieces:
                if id(span.master) in steps:
                    at, (orthogonal, shape) = slice(lo - chunk.start, hi - chunk.start), steps[id(span.master)]
                    step, master = chunk.slot["grad"][at], chunk.slot["master"][at]
                    step.copy_(orthogonal[lo - span.offset : hi - span.offset])
                    master.copy_(decayed_step(master, step, lr, cfg, shape))
            self._to_weights(chunk, pieces)

        self.files.stream(update, keys=("master",), read_keys=("master",))

    def param_states(self) -> list[dict]:
        """Each parameter's state as its file region (a save writes it from there; never read into memory).
        At dp 1 every span is a whole parameter: its regions of the files themselves. At dp > 1 the spans go
        to their writers (ZeRO-1's all-to-all, a bucket and key at a time) and each writer's share is written
        to a scratch file beside the state, a snapshot the save writes from."""
        if self.dp > 1:
            self.scratch, self.problem = None, None
            try:
                states = super().param_states()  # type: ignore[misc]
            finally:
                problem = self.problem
                del self.scratch, self.problem
            raise_together(problem)  # a full disk on one node: every rank stops here, none waits for it
            return states
        spans = {id(s.param): s for s in self.spans}
        stepped = any(self.rule.state(s.master) for s in self.spans)
        return [{key: self.files.region(self.rule.file_of(spans[id(p)].master, key), spans[id(p)].offset, p)
                 for key in ("master", *(self._rule_keys(p) if stepped else ()))} for p in self.params]  # fmt: skip

    def _span_state(self, span: _Span, key: str, rule_state: dict) -> torch.Tensor:
        """A span's `key`, read from its file into host memory (sent to its writer, or a state copy's); zeros
        where it is not the span's (a bucket's keys are its parameters' together)."""
        file = self.rule.file_of(span.master, key)
        return torch.zeros(span.numel) if file is None else self.files.read_range(file, span.offset, span.numel)

    def _kept(self, p: torch.nn.Parameter, values: torch.Tensor) -> FileRegion | None:
        if self.problem is None:  # after a failure the collectives go on, writing nothing, and every rank raises
            try:
                self.scratch = self.scratch or Scratch(self.files.dir)
                return self.scratch.append(values, p)
            except OSError as err:
                self.problem = f"{self.files.dir}: writing a save's share of the optimizer state failed: {err}"
        return None

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        """Each span's master and rule state where they lie in the files, mapped: a resume loads into them."""
        files = {key: self.files.mapped(key) for key in KEYS}
        self.targets = {(id(s), key): files[key][s.offset : s.offset + s.numel] for s in self.spans for key in KEYS}
        spans = {id(s.param): s for s in self.spans}
        return [{key: self.targets[id(s), self.rule.file_of(s.master, key)] for key in ("master", *self._rule_keys(p))}
                if (s := spans.get(id(p))) else {} for p in self.params]  # fmt: skip

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """The files written from each span's saved state (a master not saved: the loaded weights; moments
        not saved: zeros, and the step count starts again, as AdamW's does); what a resume loaded into the
        files themselves (`load_targets`) stays there, and only the rest goes through the ring."""
        by_param = {id(p): s for p, s in zip(self.params, states, strict=True)}
        saved = {id(s): all(k in by_param[id(s.param)] for k in self._rule_keys(s.param)) for s in self.spans}
        targets, self.targets = self.targets, {}

        def stays(span: _Span, key: str) -> bool:  # loaded into the file, or a place the rule does not use
            held = self.rule.held_in(span.master, key)
            if held is None:
                return True
            given = by_param[id(span.param)].get(held) if key == "master" or saved[id(span)] else None
            return in_place(given, targets.get((id(span), key)))

        on_host: dict[tuple[int, str], torch.Tensor | None] = {}  # each span's value moved to the host once

        def value(span: _Span, key: str) -> torch.Tensor | None:
            if (id(span), key) not in on_host:
                state, held = by_param[id(span.param)], self.rule.held_in(span.master, key)
                if key == "master":
                    master = state.get("master")
                    given = _flat_slice(span.param, span.param_offset, span.numel) if master is None else master
                else:  # not saved (a rule's first run) or not used: zeros
                    given = state[held] if saved[id(span)] and held is not None else None
                on_host[id(span), key] = None if given is None else local(given).detach().reshape(-1).cpu()
            return on_host[id(span), key]

        self.files.flush()
        self._write_state(value, frozenset((i, k) for i, s in enumerate(self.spans) for k in KEYS if stays(s, k)))
        for span in self.spans:
            self.rule.steps[id(span.master)].fill_(float(step) if saved[id(span)] else 0.0)

    def state_bytes(self) -> int:
        """On the device: the owned slice's updated weights awaiting the all-gather, at dp > 1 (the state is
        on disk; at dp 1 the update writes the parameters in place)."""
        return self.updated.nbytes


class NvmeZeroOptimizer(NvmeState, ZeroOptimizer):
    """zero_stage 1 with optim.offload=nvme."""


class NvmeZero2Optimizer(NvmeState, Zero2Optimizer):
    """zero_stage 2 with optim.offload=nvme."""


class NvmeFullyShardedOptimizer(OnDisk, FullyShardedOptimizer):
    """zero_stage 3 with optim.offload=nvme: FSDP2 keeps the parameter shards (the fp32 master weights) and
    their gradients in host memory, as with offload=cpu (each block's weights copied to the device as it
    runs: at dp 1, the one-GPU case), and AdamW's two moments (Muon's momentum, for a matrix) are in files,
    streamed through the ring: each chunk's are read, updated with the shards and gradients in place by
    torch's fused AdamW kernel (a matrix's momentum as Muon's, its update kept in the gradient) and written
    back; Muon's updates are then orthogonalized whole and applied to the shards in memory."""

    offloaded = ("params", "grads")  # in host memory; the optimizer state is on disk
    holds = "optimizer state (the shards and their gradients in host memory)"

    def __init__(self, model: ParallelModel, cfg: OptimConfig):
        super().__init__(model, cfg)
        self.cfg, self.offloaded = cfg, ("params", "grads")
        names = model.parameter_names()
        # each parameter's weight decay, whether it is Muon's matrix, and where its state lies in the files
        self.streamed = StreamedRule([target(names[id(p)], p) for p in self.params], cfg)
        sizes = [local(p).numel() for p in self.params]
        self.extents = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]  # the local shards back to back
        self.files = rank_files(cfg, MOMENTS, sum(sizes), model.device.type == "cuda", extra=())
        self.steps = [self.streamed.steps[id(p)] for p in self.params]  # AdamW's, per parameter (the rule's)
        self.targets: list[dict[str, torch.Tensor]] = []  # what `load_targets` handed out, per parameter
        self._first_fill(lambda: self._write_moments(lambda i, key: None))

    def _write_moments(self, value, kept: frozenset[tuple[int, str]] = frozenset()) -> None:
        """The files written from `value(i, key)` (parameter i's flat moment, None: zeros), but for `kept`."""
        write_all(self.files, MOMENTS, self.extents, value, kept)

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        if dropped(skip):
            return
        torch._foreach_add_([s for p, s in zip(self.params, self.steps, strict=True) if p.grad is not None], 1.0)
        cfg, matrices = self.cfg, self.streamed.matrix_ids

        def update(chunk: Chunk) -> None:
            groups = decay_groups()
            for i, lo, hi in covered(chunk, self.extents):
                p, off = self.params[i], self.extents[i][0]
                if p.grad is None:
                    continue
                at = slice(lo - chunk.start, hi - chunk.start)
                weight, grad = local(p).view(-1)[lo - off : hi - off], local(p.grad).view(-1)[lo - off : hi - off]
                if id(p) in matrices:  # Muon's momentum (in exp_avg's place); its update kept in the gradient
                    grad.copy_(muon_momentum(chunk.slot["exp_avg"][at], grad, cfg))
                    continue
                tensors = (weight, grad, *(chunk.slot[k][at] for k in MOMENTS), self.steps[i])
                for group, tensor in zip(groups[self.streamed.decay[id(p)]], tensors, strict=True):
                    group.append(tensor)
            adamw(groups, lr, cfg)

        self.files.stream(update)
        matrices_stepped = [t for t in self.streamed.matrices if t.tensor.grad is not None]
        updates = whole_dtensors(lambda m: orthogonalize(m, cfg.ns_steps), matrices_stepped,
                                 [t.tensor.grad for t in matrices_stepped])  # fmt: skip
        for t, orthogonal in zip(matrices_stepped, updates, strict=True):  # as Muon's, on the shards in memory
            local(t.tensor).copy_(decayed_step(local(t.tensor), local(orthogonal), lr, cfg, t.matrix_shape))
        # a failure test's kill here finds the files a step ahead of every checkpoint
        fault_point("nvme_written", int(self.steps[0].item()) if self.steps else 0, torch.distributed.get_rank())

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _keys(self, p: torch.Tensor) -> tuple[str, ...]:
        return self.streamed.keys(id(p) in self.streamed.matrix_ids)

    def param_states(self) -> list[dict[str, FileRegion]]:
        """Each parameter's state as its regions of the files, laid out like its shard (a save writes it from
        there)."""
        return [{key: self.files.region(self.streamed.file_of(p, key), off, p) for key in self._keys(p)}
                if step.item() else {}
                for p, (off, _), step in zip(self.params, self.extents, self.steps, strict=True)]  # fmt: skip

    def local_states(self) -> list[dict[str, torch.Tensor]]:
        """Each parameter's state read into host memory, flat (a state copy's: the spike guard's, local
        checkpoints'; `load_param_states` takes it back)."""
        return [{key: region.read().view(-1) for key, region in state.items()} for state in self.param_states()]

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        """Each parameter's state where it lies in the files, mapped, flat (its shard's elements in order; a
        DTensor over them would be moved to the mesh's device): a resume loads into them."""
        files = {key: self.files.mapped(key) for key in MOMENTS}
        self.targets = [{key: files[key][off : off + numel] for key in MOMENTS} for off, numel in self.extents]
        return [{key: targets[self.streamed.file_of(p, key)] for key in self._keys(p)}
                for p, targets in zip(self.params, self.targets, strict=True)]  # fmt: skip

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """The files written from the loaded state (none saved: zeros, and the step count starts again); what a
        resume loaded into the files themselves (`load_targets`) stays there, as does a place the rule does not
        use."""
        saved = [all(k in state for k in self._keys(p)) for p, state in zip(self.params, states, strict=True)]
        targets, self.targets = self.targets or [{} for _ in self.params], []
        held = [{file: self.streamed.held_in(p, file) for file in MOMENTS} for p in self.params]

        def stays(i: int, file: str) -> bool:  # loaded into the file, or a place the rule does not use
            key = held[i][file]
            return key is None or saved[i] and in_place(states[i][key], targets[i].get(file))

        kept = frozenset((i, file) for i in range(len(self.params)) for file in MOMENTS if stays(i, file))
        flat = [{file: local(state[key]).detach().reshape(-1).cpu() for file, key in held[i].items()
                 if (i, file) not in kept} if ok else {}
                for i, (state, ok) in enumerate(zip(states, saved, strict=True))]  # fmt: skip
        self.files.flush()
        self._write_moments(lambda i, key: flat[i].get(key), kept)
        for count, ok in zip(self.steps, saved, strict=True):
            count.fill_(float(step) if ok else 0.0)

    def state_bytes(self) -> int:
        return 0  # on disk: `disk_bytes`
