"""The parts a checkpoint is made of, laid out so that any (tp, pp, dp, zero) layout can load them.

Sharded through DCP, under `<part>.<key>`: the model (every parameter, frozen or not, and every
persistent buffer; DTensor shards under tp, and dp under ZeRO-3) and the optimizer state *per
parameter* (the update rule's: AdamW's exp_avg, exp_avg_sq, Muon's momentum_buffer; with ZeRO-1 and -2
also the fp32 master weights; ZeRO-3's parameters are fp32 themselves) in its parameter's placement, so
DCP reshards both on load (ZeRO-1 and -2 read each rank's owned range only: checkpoint/slices.py).
Vocabulary-padded tensors are stored unpadded and whole: their padding depends on tp.
Everything else is a small `state_dict` per part in each rank's own file (sampler, loss scaler, metrics
position, RNG).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import numpy as np
import torch

from hpc_train.checkpoint.slices import FlatSlice, flat_slice
from hpc_train.distributed.parallelize import ParallelModel, pad_rows, unpadded
from hpc_train.features.lora.adapters import is_adapter
from hpc_train.optim.nvme import FileRegion
from hpc_train.optim.protocol import Optimizer
from hpc_train.optim.rules import RULES, tp_local_numel
from hpc_train.optim.rules.lowbit import CODES, LowBitAdamW
from hpc_train.optim.rules.protocol import UpdateRule
from hpc_train.placement import distribute_like, like_param, local, origin_of


class Stateful(Protocol):
    """A part saved in each rank's own file."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedPart(Protocol):
    """A part saved through DCP, each rank writing its shards."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """What to save, by key."""
        ...

    def template(self, stored: set[str]) -> dict[str, torch.Tensor]:
        """Tensors to load into, for the keys in `stored` that this layout holds."""
        ...

    def load(self, loaded: dict[str, torch.Tensor], step: int) -> None:
        """Take what DCP loaded into `template`'s tensors."""


def _repad_like(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Unpadded whole rows -> a tensor laid out like `p` (padded for this layout, sharded like it)."""
    return distribute_like(pad_rows(rows, p.shape[0]), p)


def _template_like(model: ParallelModel, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where DCP loads `name`: a whole unpadded tensor for vocabulary rows, else a tensor laid out like `t`
    (uninitialised: DCP fills every element of a key it loads, or fails)."""
    if name in model.spec.vocab_params:
        return torch.empty((model.model_cfg.vocab_size, *t.shape[1:]), dtype=dtype, device=local(t).device)
    return torch.empty_like(t, dtype=dtype)


class ModelState:
    """Every parameter and persistent buffer, under its whole-model name; `strict`: a checkpoint must
    hold every one of them, in its shape. Without `adapters`: only the base model's (LoRA's adapters left
    out), for loading weights a run starts from. QLoRA's NF4 weights are never held: they are rebuilt from
    `model.init_from`, whose fingerprint the checkpoint records."""

    strict = True

    def __init__(self, model: ParallelModel, adapters: bool = True):
        self.model, self.adapters = model, adapters

    def live_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters and persistent buffers this part holds, by whole-model name, as this rank holds them."""
        named = self.model.named_parameters + self.model.persistent_buffers
        return [(n, t) for n, t in named if n not in self.model.quantized and (self.adapters or not is_adapter(n))]

    def tensors(self) -> dict[str, torch.Tensor]:
        vocab = self.model.model_cfg.vocab_size
        return {n: unpadded(self.model.spec, n, t.detach(), vocab) for n, t in self.live_tensors()}

    def template(self, stored: set[str]) -> dict[str, torch.Tensor]:
        """Vocabulary rows into a new whole tensor; everything else straight into the model, in place."""
        out = {}
        for name, t in self.live_tensors():
            if name in stored:
                padded = name in self.model.spec.vocab_params
                out[name] = _template_like(self.model, name, t, t.dtype) if padded else t.detach()
        return out

    @torch.no_grad()
    def load(self, loaded: dict[str, torch.Tensor], step: int) -> None:
        for name, t in self.live_tensors():
            if name in self.model.spec.vocab_params and name in loaded:
                local(t).copy_(local(_repad_like(t, loaded[name])))


class OptimizerState:
    """The optimizer's state per trainable parameter: `<name>.<key>` (e.g. `layers.0.attn.wq.weight.exp_avg`).
    A rank that keeps the state of a range of a parameter's elements (ZeRO-1 and -2) loads that range only."""

    def __init__(self, model: ParallelModel, optimizer: Optimizer):
        self.model, self.optimizer = model, optimizer
        names = model.parameter_names()
        self.names = [names[id(p)] for p in optimizer.params]
        rule = _rule_of(optimizer)  # a low-bit rule stores its moments as codes and block scales
        self.low_bit = type(rule) if isinstance(rule, LowBitAdamW) else None

    def tensors(self) -> dict[str, torch.Tensor | FileRegion]:
        """Tensors, or the regions of files where optim.offload=nvme keeps them (written from there: a save
        never holds that state in memory), except the vocabulary's, read whole to be stored unpadded."""
        vocab, states, out = self.model.model_cfg.vocab_size, self.optimizer.param_states(), {}
        for name, p, state in zip(self.names, self.optimizer.params, states, strict=True):
            kept = {}
            for key, t in state.items():
                if isinstance(t, FileRegion) and name in self.model.spec.vocab_params:
                    t = like_param(p, t.read())
                kept[key] = unpadded(self.model.spec, name, t, vocab)
            if self.low_bit is not None and kept:
                kept = self.low_bit.to_saved(kept, self.low_bit.planned_quantized(tp_local_numel(p)))
            out.update({f"{name}.{key}": t for key, t in kept.items()})
        return out

    def without_rule_state(self, stored: set[str]) -> set[str]:
        """`stored` less the update rule's state: what a resume under another rule loads (optim.reset_state).
        ZeRO's fp32 master weights stay: they are the weights, which the bf16 or fp16 model only rounds."""
        rule_keys = {key for rule in RULES.values() for key in rule.state_keys}
        return {key for key in stored if key.rpartition(".")[2] not in rule_keys}

    def template(self, stored: set[str]) -> dict[str, torch.Tensor | FlatSlice]:
        out = {}
        vocab, optimizer = self.model.model_cfg.vocab_size, self.optimizer
        for name, p, owned, into in zip(self.names, optimizer.params, optimizer.owned_ranges(),
                                        optimizer.load_targets(), strict=True):  # fmt: skip
            if owned is not None and owned[1] == 0:
                continue  # no state of it here
            for key in optimizer.state_keys:
                if f"{name}.{key}" not in stored:
                    continue
                if self.low_bit is not None and key in self.low_bit.saved_keys:
                    out[f"{name}.{key}"] = self._saved_template(name, p, key, owned)
                    continue
                rows, given = vocab if name in self.model.spec.vocab_params else None, into.get(key)
                if owned is None and given is None:
                    out[f"{name}.{key}"] = _template_like(self.model, name, p, torch.float32)
                else:  # a flat range (the owned one, or all) into the optimizer's target where it gives one;
                    # stored unpadded: the vocabulary's padding rows are left out of the read
                    start, count = (0, local(p).numel()) if owned is None else owned
                    out[f"{name}.{key}"] = flat_slice(local(p).shape, start, count, origin_of(p), rows, given)
        return out

    def _shape(self, name: str, p: torch.Tensor) -> tuple[int, ...]:
        """`p`'s shape as stored: a vocabulary's unpadded."""
        vocab_rows = name in self.model.spec.vocab_params
        return (self.model.model_cfg.vocab_size, *p.shape[1:]) if vocab_rows else tuple(p.shape)

    def _saved_template(self, name: str, p: torch.Tensor, key: str, owned: tuple[int, int] | None
                        ) -> torch.Tensor | FlatSlice:  # fmt: skip
        """Where a low-bit rule's stored codes or scales load: this rank's piece of them where it is whole
        codes and blocks of the stored ones (`saved_piece`), else the whole stored tensor (a layout that
        cut the blocks otherwise: a vocabulary's rows, tp's split of a narrow row)."""
        rule, shape = self.low_bit, self._shape(name, p)
        dtype = torch.uint8 if key in CODES.values() else torch.float32
        start, count = (0, local(p).numel()) if owned is None else owned
        vocab_rows = name in self.model.spec.vocab_params
        piece = None if vocab_rows else rule.saved_piece(p, shape, start, count)
        if piece is None:
            return torch.empty(rule.saved_shapes(shape)[key], dtype=dtype, device=local(p).device)
        local_shape, origin, first, n = piece[key]
        return flat_slice(local_shape, first, n, origin, None, torch.empty(n, dtype=dtype))

    def _from_saved(self, name: str, p: torch.Tensor, owned: tuple[int, int] | None,
                    saved: dict[str, torch.Tensor | FlatSlice]) -> dict[str, torch.Tensor]:  # fmt: skip
        """A low-bit rule's stored codes and scales of `p` as `load_param_states` takes its state."""
        pieces = not isinstance(next(iter(saved.values())), torch.Tensor)
        state = self.low_bit.from_saved({k: v.values if pieces else v for k, v in saved.items()})
        if pieces:  # this rank's elements, in order
            return state if owned is not None else {k: like_param(p, v.view(local(p).shape)) for k, v in state.items()}
        shape, vocab_rows = self._shape(name, p), name in self.model.spec.vocab_params
        laid = {k: _repad_like(p, v.view(shape)) if vocab_rows else distribute_like(v.view(shape), p)
                for k, v in state.items()}  # fmt: skip
        if owned is None:
            return laid
        start, count = owned
        return {k: local(v).reshape(-1)[start : start + count].clone() for k, v in laid.items()}

    def load(self, loaded: dict[str, torch.Tensor | FlatSlice], step: int) -> None:
        states = []
        for name, p, owned in zip(self.names, self.optimizer.params, self.optimizer.owned_ranges(), strict=True):
            state = {}
            saved_keys = () if self.low_bit is None else self.low_bit.saved_keys
            saved = {k: loaded[f"{name}.{k}"] for k in saved_keys if f"{name}.{k}" in loaded}
            if len(saved) == len(saved_keys) > 0:
                state.update(self._from_saved(name, p, owned, saved))
            for key in self.optimizer.state_keys:
                if key in saved_keys:
                    continue
                value = loaded.get(f"{name}.{key}")
                if isinstance(value, FlatSlice):  # the owned range, as the optimizer asked
                    state[key] = value.values
                elif value is not None:
                    state[key] = _repad_like(p, value) if name in self.model.spec.vocab_params else value
            states.append(state)
        self.optimizer.load_param_states(states, step)  # always: ZeRO's masters follow the loaded weights


def _rule_of(optimizer: Optimizer) -> UpdateRule | None:
    """The update rule an optimizer runs (the first part's, where it is made of several)."""
    parts = getattr(optimizer, "parts", [optimizer])
    return getattr(parts[0], "rule", None) if parts else None


class RNGState:
    """This rank's Python, numpy, torch CPU and CUDA generators."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, *rest = np.random.get_state()  # its key array as a tensor: per-rank files hold no numpy
        numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), *rest)
        state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
