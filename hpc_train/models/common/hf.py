"""How a model family corresponds to its Hugging Face `transformers` class: config keys both ways, and which
HF tensors make which hpc_train tensors. Pure tables and shape arithmetic; reading and writing the files is
checkpoint/hf_io.py's. Every conversion accounts for every tensor on both sides: a tensor left over, missing
or of the wrong shape is an error naming it (silent loss is how converters usually fail)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpc_train.config import ConfigError, ModelConfig

# what a family's architecture is made of, its context included (GPT-2's learned positions; what a Llama
# was trained to serve); the rest of ModelConfig (seq_len, recompute, init) is the run's choice
ARCH_FIELDS = ("arch", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model", "ffn_hidden", "rope_theta",
               "norm_eps", "tie_embeddings", "max_position_embeddings")  # fmt: skip


@dataclass(frozen=True)
class TensorRule:
    """One HF tensor makes `ours`: `same` as it is, `transpose`d (GPT-2's Conv1D stores (in, out)), or `split`
    (transposed first if 2-D) into len(ours) equal parts along dim 0 (GPT-2's fused q, k, v)."""

    ours: tuple[str, ...]
    theirs: str
    kind: str = "same"


@dataclass(frozen=True)
class HFFormat:
    model_type: str  # config.json's model_type
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    model_fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields (ARCH_FIELDS)
    hf_config: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> the transformers config's kwargs
    rules: Callable[[ModelConfig], list[TensorRule]]
    derived: tuple[str, ...] = ()  # suffixes of HF tensors that are recomputed buffers, not weights


def require(config: dict[str, Any], key: str, allowed: tuple, default: Any = None) -> None:
    """An HF option hpc_train's family does not implement is an error, not a silently different model."""
    value = config.get(key, default)
    if value not in allowed:
        raise ConfigError(f"Hugging Face config {key}={value!r} is not supported (hpc_train's model needs one of "
                          f"{', '.join(map(repr, allowed))})")  # fmt: skip


def _theirs_shape(rule: TensorRule, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of `rule.ours` made from an HF tensor of `shape`."""
    if rule.kind == "same":
        return [shape]
    flipped = tuple(reversed(shape))
    if rule.kind == "transpose":
        return [flipped]
    parts = len(rule.ours)
    return [(flipped[0] // parts, *flipped[1:])] * parts


def _to_ours(rule: TensorRule, t: torch.Tensor) -> list[torch.Tensor]:
    if rule.kind == "same":
        return [t]
    t = t.t() if t.dim() == 2 else t
    return [t.contiguous()] if rule.kind == "transpose" else [c.contiguous() for c in t.chunk(len(rule.ours))]


def _to_theirs(rule: TensorRule, ts: list[torch.Tensor]) -> torch.Tensor:
    if rule.kind == "same":
        return ts[0]
    t = torch.cat(ts) if rule.kind == "split" else ts[0]
    return (t.t() if t.dim() == 2 else t).contiguous()


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def plan_import(
    fmt: HFFormat, cfg: ModelConfig, theirs: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]
) -> dict[str, tuple[TensorRule, int]]:
    """For each hpc_train tensor: the rule making it and its index among the rule's outputs. `theirs`: the
    HF tensors' shapes; `expected`: every hpc_train tensor's (unpadded) shape. Raises a ConfigError naming
    every tensor that is missing, left over or of another shape."""
    plan, used, problems = {}, set(), []
    for rule in fmt.rules(cfg):
        if rule.theirs not in theirs:
            problems.append(f"missing tensor {rule.theirs}")
            continue
        used.add(rule.theirs)
        for index, (name, shape) in enumerate(zip(rule.ours, _theirs_shape(rule, theirs[rule.theirs]), strict=True)):
            if expected.get(name) != shape:
                problems.append(f"{rule.theirs} has shape {tuple(theirs[rule.theirs])}, which makes {name} "
                                f"{shape}, but the model's {name} is {expected.get(name, 'absent')}")  # fmt: skip
            plan[name] = (rule, index)
    left = sorted(n for n in theirs if n not in used and not n.endswith(fmt.derived))
    if left:
        problems.append(f"tensors hpc_train's {cfg.arch} model has no place for: {_listed(left)}")
    unmade = sorted(set(expected) - set(plan))
    if unmade and not problems:
        problems.append(f"no Hugging Face tensor makes {_listed(unmade)}")
    if problems:
        raise ConfigError("the Hugging Face checkpoint does not match the model: " + "; ".join(problems))
    return plan


def import_tensor(plan: dict[str, tuple[TensorRule, int]], name: str, read: Callable[[str], torch.Tensor]):
    """hpc_train tensor `name`, made from the HF tensor `read` returns."""
    rule, index = plan[name]
    return _to_ours(rule, read(rule.theirs))[index]


def export_state(fmt: HFFormat, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole hpc_train tensors (unpadded) -> HF's; every one used exactly once."""
    out, used = {}, set()
    for rule in fmt.rules(cfg):
        missing = [name for name in rule.ours if name not in state]
        if missing:
            raise ConfigError(f"cannot export: the model has no tensor {missing[0]}")
        out[rule.theirs] = _to_theirs(rule, [state[name] for name in rule.ours])
        used.update(rule.ours)
    if left := sorted(set(state) - used):
        raise ConfigError(f"cannot export: no Hugging Face tensor takes {_listed(left)}")
    return out
