"""What an update rule is: the arithmetic that turns gradients into a parameter update (AdamW, Muon),
kept apart from the data-parallel strategy (optim/data_parallel.py, zero.py, fsdp.py) that decides where
the tensors it updates live (whole parameters, tp or FSDP shards, ZeRO's flat fp32 slices) and how their
gradients were reduced. A strategy hands its rule `Target`s and, for rules that need whole matrices, a
`WholeMatrices` that gathers them across whatever the strategy shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from hpc_train.config import OptimConfig


@dataclass(frozen=True)
class Target:
    """One tensor a rule updates in place; its `.grad` is the reduced gradient."""

    tensor: torch.Tensor  # a parameter (or its tp / FSDP shard), or a ZeRO slice's fp32 master weights
    decay: bool  # weight decay applies (matrices; not norms or biases)
    # the whole hidden-layer matrix it is (part of), (out, in), or (experts, out, in) for a stack of them;
    # None: not one
    matrix_shape: torch.Size | None = None
    param_numel: int = 0  # elements of its (tp-local) parameter, whole: a ZeRO slice's is the parameter's


MatrixFn = Callable[[torch.Tensor], torch.Tensor]


class WholeMatrices(Protocol):
    def __call__(self, fn: MatrixFn, targets: list[Target], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """`pieces[i]` is matrix target i's part of some quantity, shaped like its tensor: apply `fn` to each
        whole matrix and return each target's part of the result. A collective over the ranks that share
        the matrices: every rank passes its targets in the same order. A 3-D piece is a stack of matrices
        that `fn` maps matrix by matrix: a part cut along its first dimension holds whole matrices."""
        ...


def local_matrices(fn: MatrixFn, targets: list[Target], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """`WholeMatrices` where every piece already is its whole matrix."""
    return [fn(piece) for piece in pieces]


class UpdateRule(Protocol):
    state_keys: ClassVar[tuple[str, ...]]  # every key `state` may hold, for checkpoints
    gathers_matrices: ClassVar[bool]  # calls `whole` each step (a collective where matrices are sharded)
    # its state is per block of this many consecutive elements of a parameter: ZeRO cuts slices at them
    block_size: ClassVar[int]

    def __init__(self, targets: list[Target], cfg: OptimConfig, whole: WholeMatrices = local_matrices) -> None: ...

    @staticmethod
    def check(cfg: OptimConfig) -> None:
        """Raise a ConfigError for settings this rule cannot run with (before any process starts)."""

    @staticmethod
    def planned_state_bytes(matrix: bool, numel: int, param_numel: int) -> int:
        """State bytes of `numel` elements of a (tp-local) parameter of `param_numel` elements, a hidden-layer
        matrix or not, for the planner."""
        ...

    def keys(self, matrix: bool) -> tuple[str, ...]:
        """What `state` holds for a target that is (part of) a hidden-layer matrix, or for another."""
        ...

    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        """Update every target with a gradient, unless the 0-dim device flag `skip` is nonzero (then nothing
        changes, state and step counts included; decided on the device). A rule with `whole` matrices
        calls it on every rank."""

    def zero_grad(self) -> None: ...

    def state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """A target's state by key, shaped like it ({} before its first update)."""
        ...

    def load_state(self, tensor: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        """Take a target's saved state (the tensors are given away: kept, not copied); keys not given
        start fresh, as before a first update, so that every target has state again."""

    def state_bytes(self) -> int:
        """Exact bytes of state this rule holds on this rank."""
        ...
