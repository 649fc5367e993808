"""What a checkpoint holds, laid out so that any (tp, pp, dp, zero) layout can load it.

Sharded through DCP: the model parameters (DTensor shards under tp) and the optimizer state *per
parameter* (exp_avg, exp_avg_sq and, with ZeRO-1, the fp32 master weights), each in its parameter's
placement, so DCP reshards both on load. The embedding and output head are stored unpadded and whole:
their vocabulary padding depends on tp. Per rank, in its own file: step, consumed samples, loss scaler
and the RNG states (Python, numpy, torch CPU and CUDA) of that rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hpc_train.distributed.grads import local
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.distributed.zero import STATE_KEYS

VOCAB_PADDED = ("tok_embeddings.weight", "output.weight")


def _stored(name: str, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if name in VOCAB_PADDED:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        return full[:vocab_size].detach().clone()
    return t


def sharded_state(model: ParallelModel, optimizer) -> dict[str, torch.Tensor]:
    """The tensors every rank hands to DCP: `model.<name>` and `optim.<name>.<key>`."""
    vocab = model.cfg.model.vocab_size
    names = [n for n, _ in model.named_parameters]
    state = {f"model.{n}": _stored(n, p.detach(), vocab) for n, p in model.named_parameters}
    for name, param_state in zip(names, optimizer.param_states(), strict=True):
        state.update({f"optim.{name}.{k}": _stored(name, t, vocab) for k, t in param_state.items()})
    return state


def load_template(model: ParallelModel, optimizer, stored_keys: set[str]) -> dict[str, torch.Tensor]:
    """Tensors for DCP to load into, for the current layout; only keys the checkpoint holds."""
    vocab = model.cfg.model.vocab_size
    template = {}
    for name, p in model.named_parameters:
        padded = name in VOCAB_PADDED
        shape = (vocab, *p.shape[1:])
        device = local(p).device
        template[f"model.{name}"] = torch.empty(shape, dtype=p.dtype, device=device) if padded else p.detach()
        for key in STATE_KEYS:
            if f"optim.{name}.{key}" in stored_keys:
                template[f"optim.{name}.{key}"] = (
                    torch.empty(shape, dtype=torch.float32, device=device)
                    if padded
                    else torch.zeros_like(p, dtype=torch.float32)
                )
    return {k: v for k, v in template.items() if k in stored_keys}


def _repad_like(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Unpadded whole rows -> a tensor laid out like `p` (padded for this layout, sharded like it)."""
    padded = torch.zeros(p.shape, dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    if isinstance(p, DTensor):
        return distribute_tensor(padded, p.device_mesh, p.placements, src_data_rank=None)
    return padded


@torch.no_grad()
def apply_loaded(model: ParallelModel, optimizer, loaded: dict[str, torch.Tensor], step: int) -> None:
    """Copy what DCP loaded into the model (in place) and the optimizer."""
    states = []
    for name, p in model.named_parameters:
        if name in VOCAB_PADDED:
            local(p).copy_(local(_repad_like(p, loaded[f"model.{name}"])))
        state = {}
        for key in STATE_KEYS:
            value = loaded.get(f"optim.{name}.{key}")
            if value is not None:
                state[key] = _repad_like(p, value) if name in VOCAB_PADDED else value
        states.append(state)
    if any(states):
        optimizer.load_param_states(states, step)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
