"""Context parallelism's key, in the `parallel` section (its size, parallel.cp, is a mesh dimension)."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_train.config import choice


@dataclass
class ContextParallelOptions:
    # how each attention sees the other cp ranks' keys and values: around a ring (zig-zag split: equal causal
    # work per rank) or all-to-all between sequence and head shards (Ulysses)
    cp_mode: str = choice("ring", "ulysses")
