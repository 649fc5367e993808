"""zero_stage 1: ZeRO-1, Megatron's distributed optimizer.

Each backward's gradient of a parameter is added, as soon as autograd has produced it, into its place in
its bucket's contiguous fp32 buffer and freed (Megatron's main_grad with gradient-accumulation fusion:
micro-batches accumulate in fp32, and no bf16 gradient outlives its own backward). Each bucket is then
reduce-scattered over dp in place, so rank r's contiguous 1/dp slice of the buffer holds the averaged
gradients it owns (with dp=1 the buffer is the slice: nothing is copied). A bucket's buffer lives from
the first gradient added to it to `zero_grad`: with one micro-batch and no pipeline it is not there at the
activation peak, where backward starts, and grows as the activations are freed (as a plain loop's
gradients do). Rank r keeps fp32 master weights and the update rule's state for its slice only
(AdamW: 12 bytes per owned element), updates it with the rule (the same arithmetic as zero_stage 0; a
rule that needs whole matrices, as Muon does, gets them all-gathered from the dp ranks' slices and over
tp), casts it to the parameters' dtype and all-gathers each bucket back into the model: bf16 weights,
an fp32 gradient buffer and the sharded AdamW state are 2 + 4 + 12/dp bytes per parameter. With
`offload="cpu"` (ZeRO-Offload) the master weights, the rule's state and a copy of the owned gradients live
in host memory (16 bytes per owned element with AdamW; pinned on CUDA): the gradients are reduced, checked
and clipped on the device, copied to the host once per step, updated there, and the masters are copied back
to the device by the all-gather. The configuration decides it, not the devices: on CPU the offload path
makes the same copies into its own buffers.

zero_stage 2 (`Zero2Optimizer`): each bucket's gradients are copied to an fp32 buffer and reduce-scattered
once per micro-batch, as soon as backward has produced them, and rank r accumulates only its fp32 slice
(DeepSpeed's stage 2): micro-batches never add up in the weights' dtype. With overlap_grad_reduce at most
two collectives are in flight while backward goes on; without it each is waited for at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import GradGroups, is_tp_sharded
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.buckets import BucketedReduction, bucketize, release, weak_hook
from hpc_train.optim.data_parallel import on_whole
from hpc_train.optim.rules import Target, is_hidden_matrix, rule_class, target
from hpc_train.optim.rules.protocol import MatrixFn, UpdateRule
from hpc_train.placement import like_param, local

# torch >= 2.13 names these *_single for gloo; older releases only have the *_tensor names
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _flat_slice(t: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    return local(t).reshape(-1)[offset : offset + numel].float()


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's local elements start in the bucket
    numel: int  # padded to a multiple of dp
    grad: torch.Tensor | None  # fp32, the whole bucket: stage 1's accumulation buffer (begin_step to zero_grad)
    grad_shard: torch.Tensor  # fp32, this rank's reduced 1/dp slice (stage 1: a view of `grad`)
    shard_numel: int
    spans: list[_Span] = field(default_factory=list)


@dataclass
class _Span:
    """A stretch of the owned slice lying inside one parameter: one fp32 master view for the update rule."""

    shard_start: int  # offset in the bucket's owned slice
    numel: int
    offset: int  # where its master (and with offload its gradient's host copy) starts in the master buffer
    param: nn.Parameter  # the model parameter it lies in
    param_offset: int  # where it starts in that parameter's flattened local tensor
    master: nn.Parameter  # view into the master buffer
    tp_sharded: bool
    counted_in_norm: bool


class ZeroOptimizer:
    """zero_stage 1: optimizer state sharded over the data-parallel group (see the module docstring)."""

    master_weights = True  # fp32 master slices: the model may hold bf16/fp16 weights
    shards_state = True  # so it can also live in host memory (optim.offload=cpu)
    shards_params = False
    takes_grads_in_backward = True  # into the fp32 buffers
    grads_before_backward = False
    every_micro_batch = False  # reduce once per step, after the last micro-batch

    def __init__(self, model: ParallelModel, cfg: OptimConfig, params: list | None = None, role: str = "dp_cp"):
        """Over `params` (every trainable parameter by default), sharded over the mesh's `role`: every rank
        with these parameters, dp x cp (edp for routed experts: optim/experts.py); the reduced gradients are
        always divided by dp x cp (an expert's gradient holds the tokens of its whole ep group already)."""
        self.model = model
        self.params = model.trainable_parameters if params is None else params
        self.dp_group = model.mesh.group(role)
        self.dp, self.dp_rank = model.mesh.size(role), model.mesh.rank(role)
        self.divisor = model.mesh.size("dp_cp")
        self.device = model.device
        self.offload = cfg.offload == "cpu"
        self.state_device = torch.device("cpu") if self.offload else self.device
        self.offloaded = ("optimizer",) if self.offload else ()
        # a rule whose state is per block of a parameter's elements has every parameter start, and every
        # rank's slice begin, at a block boundary: its blocks are the parameter's at any dp (zeros between)
        self.align = rule_class(cfg).block_size
        self.buckets = self._make_buckets(self.params, int(cfg.bucket_mb * 2**20))
        buckets = [b.params for b in self.buckets]
        self.reduction = BucketedReduction(buckets, self._launch, cfg.overlap_grad_reduce, model.holds_tied_copy,
                                           every_micro_batch=self.every_micro_batch,
                                           passes=model.backward_passes)  # fmt: skip
        self.slot = {id(p): (b, start) for b in self.buckets for p, start in zip(b.params, b.offsets, strict=True)}
        # parameters whose gradients arrive as partial sums over tp: the groups to sum them over
        self.partial_sums: dict[int, list[dist.ProcessGroup]] = {}
        self.hooked = self.accumulating = False
        self.master = self._make_spans()
        # with offload, the owned gradients' host copy the update reads, laid out as the masters
        self.host_grads = torch.empty(self.master.numel() if self.offload else 0, dtype=torch.float32,
                                      device=self.state_device, pin_memory=self._pinned)  # fmt: skip
        names = model.parameter_names()
        self.matrices = {id(p) for p in self.params if is_hidden_matrix(names[id(p)], p.ndim)}
        targets = [target(names[id(s.param)], s.param, s.master) for b in self.buckets for s in b.spans]
        self.writers = self._writer_ranks()  # which dp rank writes each parameter's state into a checkpoint
        self.rule = self._make_rule(targets, cfg)

    def _make_rule(self, targets: list[Target], cfg: OptimConfig) -> UpdateRule:
        return rule_class(cfg)(targets, cfg, self._whole_matrices)

    def _new_master(self, numel: int) -> torch.Tensor:
        """The fp32 master weights' buffer of the owned slice (on the state's device)."""
        return torch.empty(numel, dtype=torch.float32, device=self.state_device, pin_memory=self._pinned)

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int, int]:
        """For `params` local elements: the fp32 accumulation buffers (the reduced slice is a view of them),
        fp32 master weights and the rule's state per owned element."""
        owned = math.ceil(params / dp)
        return 4 * params, 4 * owned, owned

    @property
    def state_keys(self) -> tuple[str, ...]:
        return (*self.rule.state_keys, "master")

    def _make_buckets(self, params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        buckets = []
        for indices in bucketize([local(p) for p in params], bucket_bytes, element_bytes=4):
            group = [params[i] for i in indices]
            offsets, end = [], 0
            for p in group:
                offsets.append(math.ceil(end / self.align) * self.align)
                end = offsets[-1] + local(p).numel()
            numel = math.ceil(end / (self.dp * self.align)) * self.dp * self.align
            none_yet = torch.empty(0, dtype=torch.float32, device=self.device)
            buckets.append(_Bucket(group, offsets, numel, None, none_yet, numel // self.dp))
        return buckets

    def _make_spans(self) -> torch.Tensor:
        """Cut the owned slice of every bucket at parameter boundaries; return the fp32 master weights
        (one buffer, filled from the parameters), each span's master a view into it."""
        spans = []  # (bucket, parameter, its start in the bucket, owned begin, owned end)
        for bucket in self.buckets:
            lo, hi = self.dp_rank * bucket.shard_numel, (self.dp_rank + 1) * bucket.shard_numel
            for p, start in zip(bucket.params, bucket.offsets, strict=True):
                begin, end = max(lo, start), min(hi, start + local(p).numel())
                if begin < end:
                    spans.append((bucket, p, start, begin, end))
        owned = sum(end - begin for *_, begin, end in spans)
        master = self._new_master(owned)
        offset = 0
        for bucket, p, start, begin, end in spans:
            view = master[offset : offset + end - begin]
            view.copy_(local(p).detach().reshape(-1)[begin - start : end - start])
            lo = self.dp_rank * bucket.shard_numel
            span_master = nn.Parameter(view)  # shares the master buffer's storage
            bucket.spans.append(_Span(begin - lo, end - begin, offset, p, begin - start, span_master,
                                      is_tp_sharded(p), self.model.counted_in_norm(p)))  # fmt: skip
            offset += end - begin
        return master

    def _accumulate(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook, between `begin_step` and `zero_grad`: add this backward's gradient of `p`
        (in its parameter's tp placement; a partial sum over tp stays one until the launch) into the
        bucket's fp32 buffer, and free it."""
        if self.accumulating and p.grad is not None:
            self._move_grad(p)

    def _move_grad(self, p: nn.Parameter) -> None:
        bucket, start = self.slot[id(p)]
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            pairs = list(zip(p.placements, grad.placements, strict=True))
            if all(ours == theirs or (ours.is_replicate() and theirs.is_partial()) for ours, theirs in pairs):
                # summed over those mesh dimensions once, in the buffer, at the launch
                self.partial_sums[id(p)] = [p.device_mesh.get_group(dim) for dim, (ours, theirs) in enumerate(pairs)
                                            if ours != theirs]  # fmt: skip
            else:
                grad = grad.redistribute(p.device_mesh, p.placements)
        flat = local(grad).reshape(-1)
        assert flat.numel() == local(p).numel(), f"gradient of {tuple(local(p).shape)} came as {tuple(flat.shape)}"
        self._buffer(bucket)[start : start + flat.numel()].add_(flat)
        p.grad = None

    def _buffer(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's fp32 accumulation buffer, zeros when the step begins (or when no step began)."""
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        return bucket.grad

    def _finalize_buffer(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's accumulated buffer as plain data parallelism reduces it: tp partial sums reduced over
        tp, a tied embedding's pipeline copies summed over the stages that hold it."""
        full, model = self._buffer(bucket), self.model
        for p, start in zip(bucket.params, bucket.offsets, strict=True):
            if p.grad is not None:  # from a backward outside a step
                self._move_grad(p)
            view = full[start : start + local(p).numel()]
            for group in self.partial_sums.get(id(p), ()):
                dist.all_reduce(view, group=group)
            if p is model.tied_copy and model.tied_group is not None:
                dist.all_reduce(view, group=model.tied_group)
        return full

    def _launch(self, index: int) -> Callable[[], None]:
        """Start the in-place reduce-scatter of a bucket's accumulated buffer: the mean over dp lands in this
        rank's owned slice of it."""
        bucket = self.buckets[index]
        full = self._finalize_buffer(bucket)
        shard = full[self.dp_rank * bucket.shard_numel : (self.dp_rank + 1) * bucket.shard_numel]
        bucket.grad_shard = shard
        if self.dp == 1:
            if self.divisor > 1:  # routed experts of an ep group as wide as dp
                shard.div_(self.divisor)
            return lambda: None
        work = _reduce_scatter(shard, full, group=self.dp_group, async_op=True)

        def complete() -> None:
            work.wait()
            shard.div_(self.divisor)

        return complete

    def begin_step(self, micro_batches: int) -> None:
        if not self.hooked:  # registered late (the policy swaps the parameters after construction), and
            for p in self.params:  # before the reduction's own hooks, which must see the gradient accumulated
                p.register_post_accumulate_grad_hook(weak_hook(self._accumulate))
            self.hooked = True
        self.accumulating = True
        self.reduction.begin_step(micro_batches)

    def reduce_gradients(self) -> None:
        self.reduction.finish()

    def _owned_grads(self, bucket: _Bucket) -> list[torch.Tensor]:
        return [bucket.grad_shard[s.shard_start : s.shard_start + s.numel] for s in bucket.spans]

    def grad_groups(self) -> GradGroups:
        grads = [(g, s.tp_sharded, s.counted_in_norm)
                 for b in self.buckets for s, g in zip(b.spans, self._owned_grads(b), strict=True)]  # fmt: skip
        return GradGroups.of(grads, dp_sharded=True)

    @property
    def _pinned(self) -> bool:
        """Host buffers are pinned where copies cross to a GPU (faster, and they may be asynchronous)."""
        return self.offload and self.device.type == "cuda"

    def _grads_to_host(self) -> None:
        """Offload: the owned gradients (reduced, checked and clipped on the device) copied into their host
        buffer, one copy per bucket (per run of contiguous spans, in the masters' order, where a rule's blocks
        leave gaps), waited for once."""
        for bucket in self.buckets:
            for first, owned in _runs(bucket.spans):
                host = self.host_grads[first.offset : first.offset + owned]
                host.copy_(bucket.grad_shard[first.shard_start : first.shard_start + owned], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # before the host update reads them

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """Update the owned slice (fp32 master + the rule's state), then all-gather every bucket into the
        params (with dp=1 and no offload every span is a whole parameter: one multi-tensor copy casts the
        masters into them). With offload the update reads the gradients' host copy, and the gather copies the
        masters to the device. A skipped step leaves the masters as they are, so the gather writes the same
        weights back."""
        if self.offload:
            self._grads_to_host()
        for bucket in self.buckets:
            for span, grad in zip(bucket.spans, self._owned_grads(bucket), strict=True):
                span.master.grad = self.host_grads[span.offset : span.offset + span.numel] if self.offload else grad
        self.rule.step(lr, skip)
        if self.dp == 1 and not self.offload:
            spans = [s for b in self.buckets for s in b.spans]
            torch._foreach_copy_([local(s.param).view(-1) for s in spans], [s.master for s in spans])
            return
        self._gather_params(lambda span: span.master)

    def _gather_params(self, owned: Callable[[_Span], torch.Tensor]) -> None:
        """All-gather every bucket's owned slices (`owned` of each span: its updated master weights) into the
        parameters, in their dtype."""
        for bucket in self.buckets:
            with self._gathered(bucket, [owned(s) for s in bucket.spans], local(bucket.params[0]).dtype) as full:
                for p, start in zip(bucket.params, bucket.offsets, strict=True):
                    tensor = local(p)
                    tensor.copy_(full[start : start + tensor.numel()].view_as(tensor))

    def zero_grad(self) -> None:
        """Frees the parameters' gradients and the fp32 buffers: nothing gradient-sized between steps."""
        self.accumulating = False
        for p in self.params:
            p.grad = None
        for bucket in self.buckets:
            if bucket.grad is not None:  # a collective's work may still hold it (dp's, tp's or the tied copy's)
                release(bucket.grad)
            bucket.grad, bucket.grad_shard = None, bucket.grad_shard.new_empty(0)
            for span in bucket.spans:
                span.master.grad = None

    def grad_buffer_bytes(self) -> int:
        """This rank's fp32 accumulation buffers (its reduced slices are views of them)."""
        return sum(b.grad.nbytes for b in self.buckets if b.grad is not None)

    def host_buffer_bytes(self) -> int:
        """Offload: the owned gradients' host copy (the state itself is the offloaded `optimizer` category)."""
        return self.host_grads.nbytes

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    @contextmanager
    def _gathered(
        self, bucket: _Bucket, owned: list[torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> Iterator[torch.Tensor]:
        """The dp ranks' owned slices of one quantity all-gathered into the whole bucket, in `dtype`, for the
        block's use: its buffers are released after it."""
        shard = torch.zeros(bucket.shard_numel, dtype=dtype, device=self.device)
        for span, values in zip(bucket.spans, owned, strict=True):
            shard[span.shard_start : span.shard_start + span.numel].copy_(values)
        full = torch.empty(bucket.numel, dtype=dtype, device=self.device)
        _all_gather(full, shard, group=self.dp_group)
        try:
            yield full
        finally:
            release(full, shard)

    def _whole_matrices(self, fn: MatrixFn, targets: list[Target], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """`WholeMatrices` over the owned slices: every bucket holding a hidden-layer matrix is all-gathered
        over dp (every rank, whatever it owns), each matrix this rank owns a part of is gathered over tp and
        transformed whole, and the span this rank owns is cut out of the result. With dp=1 every span is a
        whole (tp-local) parameter: nothing is gathered over dp."""
        given = {id(t.tensor): piece for t, piece in zip(targets, pieces, strict=True)}
        out: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            if not any(id(p) in self.matrices for p in bucket.params):
                continue
            gathered = nullcontext()
            if self.dp > 1:
                zeros = torch.zeros(max(s.numel for s in bucket.spans), device=self.device)  # spans not given
                gathered = self._gathered(bucket, [given[id(s.master)] if id(s.master) in given else zeros[: s.numel]
                                                   for s in bucket.spans])  # fmt: skip
            with gathered as full:  # its results are new tensors: the gathered buffer goes after them
                for span in bucket.spans:
                    if id(span.master) in given:
                        p, (_, start) = span.param, self.slot[id(span.param)]
                        values = given[id(span.master)] if full is None else full[start : start + local(p).numel()]
                        piece = like_param(p, values.to(self.device).view(local(p).shape))
                        result = local(on_whole(fn, piece)).reshape(-1)
                        part = result[span.param_offset : span.param_offset + span.numel]
                        out[id(span.master)] = part.to(self.state_device)  # offload: the update runs on the host
        return [out[id(t.tensor)] for t in targets]

    def param_states(self) -> list[dict[str, torch.Tensor]]:
        """Per parameter, in the parameter's own shape and placement, on the dp rank that writes it into a
        checkpoint (`writers`; an empty dict on the others): the rule's state and the fp32 master weights
        (checkpoints store them per parameter so they can be resharded). Each bucket's owned slices reach
        their writers with one all-to-all over dp per key, so a rank holds about its 1/dp share of the
        state for a save, as it does while training, never the whole: the tensors are new (at dp 1, where
        nothing moves, the live state itself, as ZeRO-0 gives it). No rule state before the rule's first
        step (agreed over dp: a rank may own nothing)."""
        states: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in self.params}
        flag = torch.tensor(float(any(self.rule.state(s.master) for b in self.buckets for s in b.spans)),
                            device=self.device)  # fmt: skip
        if self.dp > 1:
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.dp_group)
        stepped = bool(flag.item())
        for bucket in self.buckets:
            keys = {id(p): ("master", *(self._rule_keys(p) if stepped else ())) for p in bucket.params}
            rule_states = [self.rule.state(s.master) if stepped else {} for s in bucket.spans]  # once per span
            for key in dict.fromkeys(k for ks in keys.values() for k in ks):  # the same keys on every dp rank
                owned = [self._span_state(s, key, state) for s, state in zip(bucket.spans, rule_states, strict=True)]
                mine = self._to_writers(bucket, owned)
                for p, values in mine.items():
                    if key in keys[id(p)]:
                        states[id(p)][key] = self._kept(p, values)
        return [states[id(p)] for p in self.params]

    def _kept(self, p: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        """A writer's whole local values of `p`, as a save keeps them: laid out like `p`, where the state lives
        (offload: back in host memory at once)."""
        return like_param(p, values.to(self.state_device).view(local(p).shape))

    def _writer_ranks(self) -> dict[int, int]:
        """The dp rank that writes each parameter's state: the largest first, each to the rank with the fewest
        elements so far (whole-tensor sizes: the same answer on every tp and dp rank)."""
        load, writers = [0] * self.dp, {}
        for p in sorted(self.params, key=lambda p: -p.numel()):  # stable: ties keep the parameters' order
            rank = min(range(self.dp), key=load.__getitem__)
            writers[id(p)], load[rank] = rank, load[rank] + p.numel()
        return writers

    def _to_writers(self, bucket: _Bucket, owned: list[torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """The whole local (flattened) values of the bucket's parameters this rank writes, from every dp rank's
        owned spans (`owned`, one tensor per span of this rank): one all-to-all over dp."""
        if self.dp == 1:  # every span is a whole parameter: its live state, as ZeRO-0's (a save writes, or stages,
            # it before the next update)
            return {s.param: values.to(self.device) for s, values in zip(bucket.spans, owned, strict=True)}

        def overlap(rank: int, start: int, numel: int) -> int:
            lo, hi = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
            return max(0, min(hi, start + numel) - max(lo, start))

        writes = [p for p in bucket.params if self.writers[id(p)] == self.dp_rank]
        sends = [[] for _ in range(self.dp)]
        for span, values in zip(bucket.spans, owned, strict=True):
            sends[self.writers[id(span.param)]].append(values.to(self.device))
        inputs = [torch.cat(pieces) if pieces else torch.empty(0, device=self.device) for pieces in sends]
        starts = dict(zip(map(id, bucket.params), bucket.offsets, strict=True))
        receives = [[overlap(r, starts[id(p)], local(p).numel()) for p in writes] for r in range(self.dp)]
        output = torch.empty(sum(map(sum, receives)), dtype=torch.float32, device=self.device)
        dist.all_to_all_single(output, torch.cat(inputs), [sum(r) for r in receives], [t.numel() for t in inputs],
                               group=self.dp_group)  # fmt: skip
        pieces: dict[int, list[torch.Tensor]] = {id(p): [] for p in writes}
        offset = 0
        for sizes in receives:  # from each rank in order: its pieces of these parameters, in bucket order
            for p, size in zip(writes, sizes, strict=True):
                pieces[id(p)].append(output[offset : offset + size])
                offset += size
        return {p: torch.cat(pieces[id(p)]) for p in writes}

    def _span_state(self, span: _Span, key: str, rule_state: dict[str, torch.Tensor]) -> torch.Tensor:
        """A span's `key`: the master, or from the rule's `rule_state` of it (a low-bit rule's is dequantized:
        asked once per span); zeros where its parameter has no such state."""
        if key == "master":
            return span.master.detach()
        value = rule_state.get(key)
        return span.master.new_zeros(span.numel) if value is None else value

    def _rule_keys(self, p: nn.Parameter) -> tuple[str, ...]:
        return self.rule.keys(id(p) in self.matrices)

    def local_states(self) -> list[dict[str, torch.Tensor]]:
        """The owned span of each parameter (none: an empty dict): its master and, once stepped, its rule state."""
        spans = {id(s.param): s for b in self.buckets for s in b.spans}
        rule_states = {key: self.rule.state(s.master) for key, s in spans.items()}
        stepped = any(rule_states.values())
        return [{key: self._span_state(spans[id(p)], key, rule_states[id(p)])
                 for key in ("master", *(self._rule_keys(p) if stepped else ()))} if id(p) in spans else {}
                for p in self.params]  # fmt: skip

    def owned_ranges(self) -> list[tuple[int, int] | None]:
        """A parameter's span of the owned slice (a bucket's owned slice is contiguous, and so is a parameter in
        its bucket: at most one span each)."""
        spans = {id(s.param): (s.param_offset, s.numel) for b in self.buckets for s in b.spans}
        return [spans.get(id(p), (0, 0)) for p in self.params]

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        return [{} for _ in self.params]

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Take each rank's owned slices of per-parameter states (`owned_ranges`: a load reads just those),
        after the model's weights were loaded. A master not in the checkpoint (zero_stage 0 saved it, or the
        parameter was frozen) is taken from the loaded weights; missing rule state starts as the rule starts
        it (AdamW: zeros, step 0), so that every master has state again and the next save holds all of it."""
        by_param = {id(p): s for p, s in zip(self.params, states, strict=True)}
        for bucket in self.buckets:
            for span in bucket.spans:
                state = by_param[id(span.param)]
                master = state.get("master")
                span.master.copy_(_flat_slice(span.param, span.param_offset, span.numel) if master is None else master)
                saved = {k: state[k].to(self.state_device) for k in self._rule_keys(span.param) if k in state}
                self.rule.load_state(span.master, saved, step)

    def state_bytes(self) -> int:
        """Exact bytes of optimizer state on this rank: fp32 master weights + the rule's state."""
        return self.master.nbytes + self.rule.state_bytes()


class Zero2Optimizer(ZeroOptimizer):
    """zero_stage 2: ZeRO-1 plus gradients sharded over dp (see the module docstring): a bucket's gradients
    are taken from the parameters, in fp32, once per micro-batch, with or without overlap_grad_reduce."""

    every_micro_batch = True
    takes_grads_in_backward = True  # each micro-batch's launches take them, from backward
    grads_before_backward = True  # the owned slices, from begin_step

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int, int]:
        """The fp32 owned gradient slice (the buckets' fp32 copies being reduced are communication buffers;
        a bucket's own gradients are freed each micro-batch as soon as it is launched); fp32 masters and the
        rule's state per owned element."""
        shard = math.ceil(params / dp)
        return 4 * shard, 4 * shard, shard

    def begin_step(self, micro_batches: int) -> None:
        """The parameters keep their own gradients until each launch takes them."""
        for bucket in self.buckets:
            self._owned_slice(bucket)  # held through the step, as at the step's peak
        self.reduction.begin_step(micro_batches)

    def grad_buffer_bytes(self) -> int:
        """This rank's accumulated fp32 slices (the copies in flight are communication buffers, not counted)."""
        return sum(b.grad_shard.nbytes for b in self.buckets)

    def _take_grads(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's local gradients in a new fp32 buffer of the bucket's size; the parameters' freed."""
        self.model.finalize_grads(bucket.params)
        full = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
        ends = [start + local(p).numel() for p, start in zip(bucket.params, bucket.offsets, strict=True)]
        for begin, end in zip(ends, [*bucket.offsets[1:], bucket.numel], strict=True):
            full[begin:end].zero_()  # the dp padding (and the gaps before block-aligned parameters)
        for p, start in zip(bucket.params, bucket.offsets, strict=True):
            target = full[start : start + local(p).numel()]
            target.copy_(local(p.grad).reshape(-1)) if p.grad is not None else target.zero_()
            p.grad = None  # the fp32 buffer holds it now: free the copy
        return full

    def _owned_slice(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's accumulated slice for this step, zeros when the step begins (or at its first launch
        when no step began)."""
        if bucket.grad_shard.numel() == 0:
            bucket.grad_shard = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=self.device)
        return bucket.grad_shard

    def _launch(self, index: int) -> Callable[[], None]:
        """Reduce-scatter the gradients the bucket's parameters hold now from a temporary fp32 copy, and add
        the mean of this rank's slice to its accumulated slice."""
        bucket = self.buckets[index]
        part = torch.empty_like(self._owned_slice(bucket))
        full = self._take_grads(bucket)
        work = _reduce_scatter(part, full, group=self.dp_group, async_op=True)

        def complete() -> None:
            work.wait()
            bucket.grad_shard.add_(part.div_(self.divisor))
            release(full, part)

        return complete


def _runs(spans: list[_Span]) -> list[tuple[_Span, int]]:
    """The spans as runs contiguous in the owned slice: (each run's first span, its elements)."""
    runs: list[tuple[_Span, int]] = []
    for span in spans:
        if runs and runs[-1][0].shard_start + runs[-1][1] == span.shard_start:
            runs[-1] = (runs[-1][0], runs[-1][1] + span.numel)
        else:
            runs.append((span, span.numel))
    return runs
