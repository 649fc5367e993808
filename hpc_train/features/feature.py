"""What a feature declares beside its code, and how the shared files ask it.

A feature (float8, context parallelism, LoRA, activation offload...) is a folder under features/ whose
`FEATURE` says everything the rest of hpc_train needs to know of it: the config keys it owns (`options`:
a dataclass per section, each field's rule beside it, composed into the schema a run loads), when it is on,
the problems it refuses before anything runs, what it adds to the planner's memory and traffic, its steps in
parallelizing a stage, and its part in every training step (`hooks`: distributed/hooks.py). The registry
(hpc_train/job.py) lists the features; the schema's composition, the layout check, the planner, the builder
(and through it parallelize, the step and the loop) loop over them and name none.

Narrow signatures: every function a feature declares takes its runtime arguments positionally and, as
keyword-only parameters, what it reads, by name: config sections (`model`, `parallel`, `train`, `optim`,
`data`, `finetune`...), typed by what it reads of them (its own options class for its own keys), and what
the caller has besides (`dims`, `spec`, `mesh`, `block_policy`...). `bind` hands exactly those over, so a
feature never sees the whole job, and its functions are plain functions a test calls directly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Memory:
    """Bytes a feature adds on one rank (negative: removes), by where they sit in the planner's model of a step
    (planner/memory.py `estimate`): `block`, alive while one block runs (an exchange's buffers); `static`, alive
    through the step; `working`, a block backward's transient working set; `host`, in host memory (not in the
    device total). What a feature changes in the activations kept for backward is its `activations`."""

    block: int = 0
    static: int = 0
    working: int = 0
    host: int = 0


@dataclass(frozen=True)
class Links:
    """Bandwidths (GB/s) and node size the planner's step-time model assumes."""

    nvlink_gbps: float = 300.0
    ib_gbps: float = 25.0
    pcie_gbps: float = 25.0
    nvme_gbps: float = 3.0  # a node's local disk, shared by its ranks (optim.offload=nvme)
    gpus_per_node: int = 8

    def within_node(self, ranks: int) -> float:
        """Bytes/s of a group of `ranks` consecutive ranks: NVLink inside a node, InfiniBand across nodes."""
        return (self.nvlink_gbps if ranks <= self.gpus_per_node else self.ib_gbps) * 1e9


def _never(**_: Any) -> bool:
    return False


@dataclass(frozen=True)
class Feature:
    """One feature's declaration. Every field but `name` is optional; each function's keyword-only parameters
    say what it reads (see the module's docstring)."""

    name: str
    options: Mapping[str, type] = field(default_factory=dict)  # config section -> the dataclass of its keys there
    enabled: Callable[..., bool] = _never  # whether a run uses it
    # every problem of this config with the feature on (or of its keys' values), each naming its fix
    check: Callable[..., list[str]] | None = None
    # (stage, plan): one step of parallelizing a pipeline stage on the meta device, in place, in the
    # registry's order (distributed/transforms)
    transform: Callable[..., None] | None = None
    # (stage): once the stage is allocated and initialized (e.g. LoRA's adapters start at their init)
    initialize: Callable[..., None] | None = None
    # (model): its part in every step, attached to the built model (distributed/hooks.py StepHooks)
    hooks: Callable[..., Any] | None = None
    memory: Callable[..., Memory] | None = None  # what it adds to the plan of one rank's memory
    # bytes one micro-batch keeps for backward on the device that it adds (negative: moves elsewhere)
    activations: Callable[..., int] | None = None
    traffic: Callable[..., dict[str, float]] | None = None  # bytes a rank sends per step, by process group role
    step_time: Callable[..., float] | None = None  # seconds it adds to the planner's step-time model
    describe: Callable[..., list[str]] | None = None  # lines of `hpc-train plan`'s report
    # (shape): the family's activation formula's input, as this feature changes it (models/spec.py
    # ActivationShape: float8 projections, compiled blocks, LoRA's adapters...)
    activation_shape: Callable[..., Any] | None = None
    # the recompute choice ("none", "selective", "full") of a stage's i-th block, for the planner
    block_policy: Callable[..., Callable[[int], str]] | None = None


def forward_passes(block_policy: Callable[[int], str], layers: Iterable[int], per_stage: int,
                   recomputing: tuple[str, ...]) -> int:  # fmt: skip
    """Forward passes of the blocks `layers` (ids in the whole model, `per_stage` blocks a pipeline stage)
    per micro-batch: one each, and one more in backward for a block whose recompute choice (`block_policy`
    of its index in its stage) is among `recomputing`."""
    return sum(1 + (block_policy(i % per_stage) in recomputing) for i in layers)


@functools.lru_cache(maxsize=512)
def _injected(fn: Callable) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY)


def bind(fn: Callable, available: Mapping[str, Any], owner: str = "") -> Callable:
    """`fn` with its keyword-only parameters taken from `available` by name; the positional ones stay open."""
    names = _injected(fn)
    if missing := [name for name in names if name not in available]:
        raise TypeError(f"{owner or fn.__qualname__} reads {', '.join(missing)}, which its caller does not have "
                        f"(it has {', '.join(sorted(available))})")  # fmt: skip
    return functools.partial(fn, **{name: available[name] for name in names})
