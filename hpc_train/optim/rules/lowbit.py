"""AdamW with its two moments held in torchao's blockwise low-bit state (adamw8bit.py, adamw4bit.py): the
update is torchao's own `single_param_adam`, on each target's local tensor; the quantization is torchao's
(`OptimState8bit` / `OptimState4bit`: codes plus one fp32 scale per block of consecutive elements).

Which tensors are quantized is decided per parameter, so that it does not depend on the layout: a
parameter of at least 4096 (tp-local) elements, a multiple of the block (bitsandbytes' and torchao's
threshold, applied to the whole parameter rather than to a ZeRO slice of it). The other targets (norms,
biases) keep fp32 moments, as torchao does. ZeRO-1 and -2 cut their slices at block boundaries
(optim/zero.py), so every block a rank quantizes is a block of the parameter, whatever dp is: the state
is the same at any dp size and stage 0-2. FSDP2 cuts dim 0 into ceil(rows / dp) rows: its blocks are the
parameter's when that times a row's length is a multiple of the block; a shard that is not keeps fp32
moments, and the rule says so at start-up.

Checkpoints hold each quantized moment as it lives, its codes and its block scales (`*_codes`, `*_scales`:
`to_saved`), so a checkpoint is no larger than the state: the codes laid out like the parameter (4-bit:
two to a byte along the last dimension), the scales a grid of the parameter's blocks (a block per
`block_size` elements of a row where rows are whole blocks, else one per run of the flattened tensor),
shaped by the parameter alone, so DCP reshards both over any dp, ZeRO stage and tp that keeps the blocks.
A load expands them to fp32 values and the signed moment's per-element scale (`from_saved`), the form
`load_state` takes: a load whose blocks each carry one saved scale rebuilds the codes and scales bit for bit
(the signed moment's codes cannot be recovered from its values alone: torchao's signed map has +1 but not
-1, so a block whose largest magnitude is negative requantizes to another scale); where a layout cut the
blocks differently, torchao requantizes the values (one rounding, as a fresh quantization). A layout whose
shards are not whole blocks of that grid (tp splitting a row narrower than a block, uneven FSDP rows)
writes the older form instead: fp32 moments (AdamW's keys) plus `exp_avg_scale` per element, 12 bytes per
element; that form, AdamW's and the fp32 moments of the small tensors still load.

torchao's step has no on-device skip: a skipped step (fp16 overflow, a non-finite norm or loss) is read
on the host once per step, the one host read these rules add. The update runs eagerly unless
`optim.compile_update` (default: on CUDA) has torch.compile build one kernel per tensor shape, as torchao
does: on CPU inductor takes seconds per shape and buys little.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor

from hpc_train.config import ConfigError, OptimConfig
from hpc_train.optim.rules.adamw import MOMENTS
from hpc_train.optim.rules.protocol import Target, WholeMatrices, local_matrices
from hpc_train.placement import like_param, local, origin_of

SCALE = "exp_avg_scale"  # the signed moment's block scale, per element (`state`; older checkpoints)
CODES = {key: f"{key}_codes" for key in MOMENTS}  # in checkpoints: a moment's codes ...
SCALES = {key: f"{key}_scales" for key in MOMENTS}  # ... and its block scales
Piece = tuple[tuple[int, ...], tuple[int, ...], int, int]  # (local shape, origin, start, count), as flat_slice takes
SCALE_FLOOR = 1e-12  # torchao's least block scale (quant_utils.scale_tensor)
MIN_QUANTIZED = 4096  # elements: smaller parameters keep fp32 moments (bitsandbytes' threshold)


@functools.cache
def _has_torchao() -> bool:
    """Looked up once: the planner's layout search asks for the rule of every layout it tries."""
    return importlib.util.find_spec("torchao") is not None


class LowBitAdamW:
    """A torchao low-bit AdamW (a subclass names the state class, its block and its bits per code)."""

    saved_keys = (*CODES.values(), *SCALES.values())  # what a checkpoint stores of a quantized moment
    state_keys = (*MOMENTS, SCALE, *saved_keys)
    gathers_matrices = False
    block_size: ClassVar[int]
    code_bits: ClassVar[int]  # bits per element of a moment's codes
    qmap_entries: ClassVar[int]  # entries of the code book each state tensor carries

    @staticmethod
    def state_zeros(shape: torch.Size, signed: bool, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def quantize(normalized: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        """torchao's codes of the flat `normalized` (each block already divided by its scale), flat, in its
        storage (4-bit: two to a byte, the first in the high half)."""
        raise NotImplementedError

    def __init__(self, targets: list[Target], cfg: OptimConfig, whole: WholeMatrices = local_matrices):
        self.cfg, self.targets = cfg, targets
        self.states: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.by_tensor = {id(t.tensor): t for t in targets}
        device = local(targets[0].tensor).device if targets else torch.device("cpu")
        from torchao.optim.adam import single_param_adam  # torchao is imported where a run uses it

        compiled = cfg.compile_update if cfg.compile_update is not None else device.type == "cuda"
        self.update = torch.compile(single_param_adam, fullgraph=True, dynamic=False) if compiled else single_param_adam
        fallbacks = [local(t.tensor).numel() for t in targets
                     if self.planned_quantized(t.param_numel) and not self.quantized(t)]  # fmt: skip
        if fallbacks:  # layout-dependent state the planner does not count: said at start-up
            print(
                f"optim.name={cfg.name}: {len(fallbacks)} parameter shard(s) here keep fp32 moments: their "
                f"{fallbacks[:4]} elements are not whole {self.block_size}-element blocks (FSDP's rows or tp's "
                f"split of a parameter)",
                flush=True,
            )

    @staticmethod
    def check(cfg: OptimConfig) -> None:
        if not _has_torchao():
            raise ConfigError(
                f"optim.name={cfg.name} needs torchao (its low-bit state): pip install 'hpc_train[lowbit]'"
            )

    @classmethod
    def planned_quantized(cls, param_numel: int) -> bool:
        """Whether a parameter of `param_numel` (tp-local) elements gets low-bit moments."""
        return param_numel >= MIN_QUANTIZED and param_numel % cls.block_size == 0

    def quantized(self, t: Target) -> bool:
        numel = local(t.tensor).numel()
        return self.planned_quantized(t.param_numel) and numel > 0 and numel % self.block_size == 0

    @classmethod
    def planned_state_bytes(cls, matrix: bool, numel: int, param_numel: int) -> int:
        """Both moments of `numel` elements of a parameter of `param_numel`: codes, one fp32 scale per block
        and the code book of each, or fp32 moments for a parameter too small to quantize."""
        if not cls.planned_quantized(param_numel):
            return 8 * numel
        return 2 * (numel * cls.code_bits // 8 + 4 * (numel // cls.block_size) + 4 * cls.qmap_entries)

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return (*MOMENTS, SCALE)  # what `state` holds; a checkpoint stores it `to_saved`

    def _fresh(self, t: Target) -> dict[str, torch.Tensor]:
        tensor = local(t.tensor)
        if self.quantized(t):
            moments = {k: self.state_zeros(tensor.shape, k == "exp_avg", tensor.device) for k in MOMENTS}
        else:
            moments = {k: torch.zeros_like(tensor, dtype=torch.float32) for k in MOMENTS}
        return {"step": torch.zeros((), dtype=torch.float32), **moments}

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        if skip is not None and bool(skip):  # torchao's update has no on-device skip (module docstring)
            return
        lr_tensor = torch.tensor(lr, dtype=torch.float32)
        # one compiled graph per tensor shape: a fixed number for a model, so torchao lifts dynamo's limit too
        with torch._dynamo.utils.disable_cache_limit():
            self._update_all(lr_tensor)

    def _update_all(self, lr_tensor: torch.Tensor) -> None:
        beta1, beta2 = self.cfg.beta1, self.cfg.beta2
        for t in self.targets:
            if t.tensor.grad is None:
                continue
            state = self.states.get(t.tensor)
            if state is None:
                state = self.states[t.tensor] = self._fresh(t)
            state["step"] += 1
            decay = self.cfg.weight_decay if t.decay else 0.0
            moments = state["exp_avg"], state["exp_avg_sq"], None  # no amsgrad
            self.update(local(t.tensor).detach(), local(t.tensor.grad), state["step"], *moments, lr_tensor, beta1,
                        beta2, decay, self.cfg.eps, True, False)  # fmt: skip

    def zero_grad(self) -> None:
        for t in self.targets:
            t.tensor.grad = None

    def state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments in fp32 and the signed moment's block scale per element, laid out like `tensor` (new
        tensors: what ZeRO moves to a parameter's writer; a checkpoint stores them `to_saved`)."""
        state = self.states.get(tensor)
        if state is None:
            return {}
        out = {}
        for key in MOMENTS:
            moment = state[key]
            out[key] = moment.dequantize() if _low_bit(moment) else moment.clone()
        moment = state["exp_avg"]
        if _low_bit(moment):
            scale = moment.scale.repeat_interleave(self.block_size).view(moment.shape)
        else:
            scale = torch.zeros_like(moment)
        out[SCALE] = scale
        return {k: like_param(tensor, v) for k, v in out.items()}

    def load_state(self, tensor: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        t = self.by_tensor[id(tensor)]
        fresh = self._fresh(t)
        if not all(k in state for k in MOMENTS):
            self.states[tensor] = fresh
            return
        fresh["step"].fill_(float(step))
        for key in MOMENTS:
            values = local(state[key]).to(local(tensor).device, torch.float32)
            target = fresh[key]
            if not _low_bit(target):
                fresh[key] = values
                continue
            scale = local(state[SCALE]) if key == "exp_avg" and SCALE in state else None
            if scale is None or not self._load_exactly(target, values, scale.to(values.device)):
                target.copy_(values)  # torchao's quantization, scales from each block's largest magnitude
        self.states[tensor] = fresh

    def _load_exactly(self, target: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> bool:
        """Codes and scales as saved, where every block carries one saved scale (module docstring); False
        (nothing changed) where a block holds two. A block with none (zeros: a vocabulary's padding rows,
        stored without their state, as AdamW's) takes torchao's own scale of its values."""
        from torchao.optim.quant_utils import scale_tensor

        blocks = scale.reshape(-1, self.block_size)
        saved = blocks.amax(dim=1)
        if not ((blocks == saved[:, None]) | (blocks == 0)).all():
            return False
        per_block = torch.where(saved > 0, saved, scale_tensor(values.reshape(-1), self.block_size)[1])
        normalized = values.reshape(-1, self.block_size) / per_block[:, None]
        target.codes.copy_(self.quantize(normalized.reshape(-1), target.qmap).view(target.codes.shape))
        target.scale.copy_(per_block)
        return True

    def state_bytes(self) -> int:
        total = 0
        for state in self.states.values():
            for key in MOMENTS:
                moment = state[key]
                parts = (moment.codes, moment.scale, moment.qmap) if _low_bit(moment) else (moment,)
                total += sum(p.nbytes for p in parts)
        return total

    @classmethod
    def saved_shapes(cls, shape: Sequence[int]) -> dict[str, tuple[int, ...]] | None:
        """The stored shape of each of `to_saved`'s keys, for a parameter of `shape` (unpadded: a vocabulary's
        rows); None where the codes cannot pair along the last dimension (4-bit, odd)."""
        per_byte, block = 8 // cls.code_bits, cls.block_size
        if shape[-1] % per_byte:
            return None
        codes = (*shape[:-1], shape[-1] // per_byte)
        rows = shape[-1] % block == 0  # rows of whole blocks: a grid of them, else one scale per flat run
        scales = (*shape[:-1], shape[-1] // block) if rows else (-(-math.prod(shape) // block),)
        return {**dict.fromkeys(CODES.values(), codes), **dict.fromkeys(SCALES.values(), scales)}

    @classmethod
    def saved_piece(cls, like: torch.Tensor, shape: Sequence[int], start: int, count: int) -> dict[str, Piece] | None:
        """Where elements [start, start + count) of `like`'s local tensor (laid out like a parameter of
        `shape`) lie in each stored tensor of `to_saved`; None where they are not whole codes and blocks of
        it (then a load reads the stored tensors whole). Only even shards count, so every rank agrees."""
        shapes, local_shape = cls.saved_shapes(shape), _even_local_shape(like)
        per_byte, block = 8 // cls.code_bits, cls.block_size
        if shapes is None or local_shape is None or start % block or count % block or local_shape[-1] % per_byte:
            return None
        *lead, last = local_shape
        *at, at_last = origin_of(like)
        codes = ((*lead, last // per_byte), (*at, at_last // per_byte), start // per_byte, count // per_byte)
        if shape[-1] % block == 0:
            if last % block:
                return None
            scales = ((*lead, last // block), (*at, at_last // block), start // block, count // block)
        elif tuple(local_shape[1:]) == tuple(shape[1:]) and math.prod(local_shape) % block == 0:  # runs of rows
            runs = math.prod(local_shape) // block
            scales = ((runs,), (origin_of(like)[0] * math.prod(shape[1:]) // block,), start // block, count // block)
        else:
            return None
        return {**dict.fromkeys(CODES.values(), codes), **dict.fromkeys(SCALES.values(), scales)}

    @classmethod
    def to_saved(cls, state: dict[str, torch.Tensor], quantized: bool) -> dict[str, torch.Tensor]:
        """A parameter's `state` (laid out like it, or whole and unpadded) as a checkpoint stores it: the
        moments' codes and block scales where it is `quantized` (planned so) and its layout holds whole
        blocks of the stored grid (module docstring), else the fp32 moments (with the scale per element
        where quantized)."""
        if not quantized:
            return {k: v for k, v in state.items() if k != SCALE}
        like = state["exp_avg"]
        block, numel, out = cls.block_size, local(like).numel(), {}
        shapes, whole = cls.saved_shapes(like.shape), not isinstance(like, DTensor)  # whole: written by one rank
        piece = None if whole or shapes is None else cls.saved_piece(like, like.shape, 0, numel)
        if shapes is None or not (whole or piece):
            return state
        padding = -numel % block  # a vocabulary's last run of rows may end within a block
        for key in MOMENTS:
            values = torch.nn.functional.pad(local(state[key]).reshape(-1), (0, padding))
            if key == "exp_avg":
                scale = torch.nn.functional.pad(local(state[SCALE]).reshape(-1), (0, padding))[::block]
            else:  # the unsigned map has 1.0: a block's largest value is its scale (at least torchao's floor)
                scale = values.view(-1, block).amax(dim=1).clamp_min(SCALE_FLOOR)
            per_element = scale.repeat_interleave(block)
            normalized = torch.where(per_element > 0, values / per_element, 0.0)
            qmap = cls._qmap(key == "exp_avg", values.device)
            out[CODES[key]] = cls.quantize(normalized, qmap)[: numel * cls.code_bits // 8]
            out[SCALES[key]] = scale
        return {k: _like(like, v.view(shapes[k] if whole else piece[k][0]), shapes[k]) for k, v in out.items()}

    @classmethod
    def from_saved(cls, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`to_saved`'s codes and scales (a piece of each, as `saved_piece` places it, or the whole) back
        to what `load_state` takes, flat: the fp32 moments and the signed moment's scale per element."""
        out = {}
        for key in MOMENTS:
            codes, scale = saved[CODES[key]].reshape(-1), saved[SCALES[key]].reshape(-1).float()
            if cls.code_bits == 4:
                codes = torch.stack([codes >> 4, codes & 15], dim=-1).reshape(-1)
            per_element = scale.repeat_interleave(cls.block_size)[: codes.numel()]
            out[key] = cls._qmap(key == "exp_avg", codes.device)[codes.long()] * per_element
            if key == "exp_avg":
                out[SCALE] = per_element
        return out

    @classmethod
    def _qmap(cls, signed: bool, device: torch.device) -> torch.Tensor:
        return cls.state_zeros(torch.Size([cls.block_size]), signed, device).qmap


def _like(like: torch.Tensor, local_tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """`local_tensor` as this rank's part of a tensor of `shape` placed as `like` is."""
    if not isinstance(like, DTensor):
        return local_tensor
    stride = torch.empty(tuple(shape), device="meta").stride()
    return DTensor.from_local(local_tensor, like.device_mesh, like.placements, shape=torch.Size(shape), stride=stride)


def _even_local_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s local shape where every rank's is the same (its shards even), else None."""
    if not isinstance(t, DTensor):
        return tuple(t.shape)
    sizes = list(t.shape)
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_shard():
            n = t.device_mesh.size(mesh_dim)
            if sizes[placement.dim] % n:
                return None
            sizes[placement.dim] //= n
    return tuple(sizes)


def _low_bit(moment: torch.Tensor) -> bool:
    """torchao's quantized state (codes, scale, qmap), not a plain fp32 moment."""
    return hasattr(moment, "codes")
