"""Activation offload's key, in the `model` section."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_train.config import choice


@dataclass
class ActivationOffloadOptions:
    # the tensors a block saves for backward go to host memory during forward (pinned on CUDA) and come
    # back one block ahead of its backward: selective, every block but each pipeline stage's last (its
    # backward comes first); full, every block. Blocks that recompute (model.recompute) keep theirs
    activation_offload: str = choice("none", "selective", "full")
