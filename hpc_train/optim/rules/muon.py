"""Muon (torch.optim.Muon's arithmetic) for hidden-layer matrices (each routed expert's as its own matrix),
AdamW for every other parameter (the MoE router's too).

Muon's momentum and Nesterov step are elementwise, so they run on whatever part of a matrix a rank holds;
its Newton-Schulz orthogonalization needs the whole matrix, so that one step runs on the matrix gathered by
the strategy's `WholeMatrices` (over tp, and over dp under ZeRO/FSDP) and each rank keeps its part of the
result. The iteration and the learning-rate adjustment are written here: torch has them only as private
functions (torch.optim._muon), which a torch release may change or drop. They do torch's arithmetic in
torch's order, so one process updates exactly as `torch.optim.Muon` does (tests/test_rules.py compares both
functions with torch's where it has them).
"""

from __future__ import annotations

import math

import torch

from hpc_train.config import ConfigError, OptimConfig
from hpc_train.optim.rules.adamw import MOMENTS, AdamW
from hpc_train.optim.rules.protocol import Target, WholeMatrices, local_matrices
from hpc_train.placement import local

MOMENTUM = "momentum_buffer"
MAX_NS_STEPS = 99  # torch.optim.Muon's limit too: more iterations only cost time
# Keller Jordan's quintic (a, b, c), tuned for a steep rise at zero rather than convergence, and the floor
# of the norm the matrix is divided by first; torch.optim.Muon's defaults as well
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_EPS = 1e-7


def orthogonalize(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz iterations towards U V^T of the matrix's SVD U S V^T, in bf16: its singular values end
    up roughly in (0.5, 1.5) rather than at 1, which costs Muon nothing and saves iterations. The Gram matrix
    is taken on the shorter side (a tall matrix is worked on transposed). A 3-D `matrix` is a stack (the
    routed experts'): each of its matrices is orthogonalized as its own, in one batched iteration."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.size(-2) > matrix.size(-1)
    x = matrix.bfloat16().mT if tall else matrix.bfloat16()
    # Frobenius norm 1 bounds the spectral norm by 1: the iteration's range
    if x.ndim == 2:
        x, mm = x / x.norm().clamp(min=NS_EPS), torch.addmm
    else:
        x, mm = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS), torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.mT if tall else x


def adjusted_lr(lr: float, how: str, shape: torch.Size) -> float:
    """The learning rate for a (rows, cols) matrix, or a stack of them (optim.muon_adjust_lr): `match_rms_adamw`
    makes the update's RMS AdamW's typical one (Moonlight), `original` is Keller Jordan's
    sqrt(max(1, rows / cols))."""
    rows, cols = shape[-2:]
    ratio = 0.2 * math.sqrt(max(rows, cols)) if how == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
    return lr * ratio


def nesterov_update(grad: torch.Tensor, momentum: torch.Tensor, cfg: OptimConfig) -> torch.Tensor:
    """Muon's update from a gradient and its momentum (already updated): Nesterov's look-ahead where
    optim.nesterov, else the momentum itself."""
    return grad.lerp(momentum, cfg.momentum) if cfg.nesterov else momentum


def decayed_step(
    weight: torch.Tensor, update: torch.Tensor, lr: float, cfg: OptimConfig, shape: torch.Size
) -> torch.Tensor:
    """The weight after Muon's step, a new tensor: decayed, then moved by the orthogonalized update at the
    learning rate adjusted for the matrix's `shape`."""
    return (weight * (1 - lr * cfg.weight_decay)).add_(update, alpha=-adjusted_lr(lr, cfg.muon_adjust_lr, shape))


class Muon:
    state_keys = (MOMENTUM, *MOMENTS)
    gathers_matrices = True
    block_size = 1

    def __init__(self, targets: list[Target], cfg: OptimConfig, whole: WholeMatrices = local_matrices):
        self.check(cfg)
        self.cfg, self.whole = cfg, whole
        self.matrices = [t for t in targets if t.matrix_shape is not None]
        self.others = AdamW([t for t in targets if t.matrix_shape is None], cfg)
        self.matrix_ids = {id(t.tensor) for t in self.matrices}
        # where the matrices (and their state) live, so where a skip flag must be: the host with offload
        self.device = local(self.matrices[0].tensor).device if self.matrices else None
        self.buffers: dict[torch.Tensor, torch.Tensor] = {}

    @staticmethod
    def check(cfg: OptimConfig) -> None:
        if cfg.ns_steps > MAX_NS_STEPS:
            raise ConfigError(f"optim.ns_steps={cfg.ns_steps} must be at most {MAX_NS_STEPS} (5 is Muon's usual)")

    @staticmethod
    def planned_state_bytes(matrix: bool, numel: int, param_numel: int) -> int:
        return (4 if matrix else 8) * numel  # one fp32 momentum buffer; AdamW's two moments

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return (MOMENTUM,) if matrix else MOMENTS

    def _orthogonalize(self, update: torch.Tensor) -> torch.Tensor:
        return orthogonalize(update, self.cfg.ns_steps)

    @torch.no_grad()
    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """`skip` (nonzero: leave everything as it is) is applied on the device: the matrices' momentum and
        weights keep their old values through `torch.where`, as the fused AdamW kernel keeps the others."""
        self.others.step(lr, skip)
        keep = None if skip is None or self.device is None else skip.to(self.device, torch.bool)
        cfg, targets, updates = self.cfg, [], []
        for target in self.matrices:
            grad = target.tensor.grad
            if grad is None:
                continue
            buf = self.buffers.get(target.tensor)
            if buf is None:
                buf = self.buffers[target.tensor] = torch.zeros_like(grad)
            _kept_unless(keep, local(buf), local(buf).lerp(local(grad), 1 - cfg.momentum))
            targets.append(target)
            updates.append(nesterov_update(grad, buf, cfg))
        for target, update in zip(targets, self.whole(self._orthogonalize, targets, updates), strict=True):
            weight = local(target.tensor)
            _kept_unless(keep, weight, decayed_step(weight, local(update), lr, cfg, target.matrix_shape))

    def zero_grad(self) -> None:
        self.others.zero_grad()
        for target in self.matrices:
            target.tensor.grad = None

    def state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if tensor in self.buffers:
            return {MOMENTUM: self.buffers[tensor]}
        return self.others.state(tensor)

    def load_state(self, tensor: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        if id(tensor) in self.matrix_ids:
            self.buffers[tensor] = state[MOMENTUM] if MOMENTUM in state else torch.zeros_like(tensor)
        else:
            self.others.load_state(tensor, state, step)

    def state_bytes(self) -> int:
        return self.others.state_bytes() + sum(local(b).nbytes for b in self.buffers.values())


def _kept_unless(keep: torch.Tensor | None, tensor: torch.Tensor, new: torch.Tensor) -> None:
    """`tensor` becomes `new`, unless the device flag `keep` is set (NaN-safe, no host read)."""
    tensor.copy_(new if keep is None else torch.where(keep, tensor, new))
