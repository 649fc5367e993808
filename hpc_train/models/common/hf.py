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
# was trained to serve), its experts' shape and routing ("moe.<key>": a key of model.moe); the rest of
# ModelConfig (seq_len, recompute, init, model.moe's balancing and capacity) is the run's choice
ARCH_FIELDS = ("arch", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model", "ffn_hidden", "rope_theta",
               "norm_eps", "tie_embeddings", "max_position_embeddings", "moe.num_experts", "moe.top_k",
               "moe.num_shared_experts", "moe.expert_ffn_hidden", "moe.first_dense_layers",
               "moe.score_func")  # fmt: skip


@dataclass(frozen=True)
class TensorRule:
    """One HF tensor makes `ours`: `same` as it is, `transpose`d (GPT-2's Conv1D stores (in, out)), or `split`
    (transposed first if 2-D) into len(ours) equal parts along dim 0 (GPT-2's fused q, k, v). Or, `stack`,
    the HF tensors `theirs` (a tuple: Mixtral's one per expert), each transposed, make the one `ours` stacked
    along a new dim 0 (the experts' weights, as the grouped GEMM takes them)."""

    ours: tuple[str, ...]
    theirs: str | tuple[str, ...]
    kind: str = "same"

    @property
    def sources(self) -> tuple[str, ...]:
        return self.theirs if isinstance(self.theirs, tuple) else (self.theirs,)


@dataclass(frozen=True)
class HFFormat:
    model_type: str  # config.json's model_type
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    model_fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields (ARCH_FIELDS)
    hf_config: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> the transformers config's kwargs
    rules: Callable[[ModelConfig], list[TensorRule]]
    derived: tuple[str, ...] = ()  # suffixes of HF tensors that are recomputed buffers, not weights
    # suffixes of hpc_train buffers the HF class has no place for, exported only while zero (a router's bias)
    zero_buffers: tuple[str, ...] = ()
    moe: HFFormat | None = None  # the family's counterpart for model.moe configs (llama: Mixtral)


def formats(fmt: HFFormat) -> list[HFFormat]:
    """The HF classes a family reads: its own and its MoE counterpart's."""
    return [fmt] if fmt.moe is None else [fmt, fmt.moe]


def format_for(fmt: HFFormat, cfg: ModelConfig) -> HFFormat:
    """The HF class `cfg` exports to: the family's MoE counterpart for an MoE config."""
    if not cfg.moe.num_experts:
        return fmt
    if fmt.moe is None:
        raise ConfigError(f"model.arch={cfg.arch} has no Hugging Face counterpart for model.moe")
    return fmt.moe


def require(config: dict[str, Any], key: str, allowed: tuple, default: Any = None) -> None:
    """An HF option hpc_train's family does not implement is an error, not a silently different model."""
    value = config.get(key, default)
    if value not in allowed:
        raise ConfigError(f"Hugging Face config {key}={value!r} is not supported (hpc_train's model needs one of "
                          f"{', '.join(map(repr, allowed))})")  # fmt: skip


def _theirs_shape(rule: TensorRule, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of `rule.ours` made from HF tensors of `shape` (each of them, for `stack`)."""
    if rule.kind == "same":
        return [shape]
    flipped = tuple(reversed(shape))
    if rule.kind == "transpose":
        return [flipped]
    if rule.kind == "stack":
        return [(len(rule.sources), *flipped)]
    parts = len(rule.ours)
    return [(flipped[0] // parts, *flipped[1:])] * parts


def _flipped(t: torch.Tensor) -> torch.Tensor:
    return t.t() if t.dim() == 2 else t


def _to_ours(rule: TensorRule, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`rule.ours` from the HF tensors `rule.sources`."""
    if rule.kind == "same":
        return ts
    if rule.kind == "stack":
        return [torch.stack([_flipped(t) for t in ts])]
    t = _flipped(ts[0])
    return [t.contiguous()] if rule.kind == "transpose" else [c.contiguous() for c in t.chunk(len(rule.ours))]


def _to_theirs(rule: TensorRule, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors `rule.sources` from `rule.ours`."""
    if rule.kind == "same":
        return ts
    if rule.kind == "stack":
        return [_flipped(t).contiguous() for t in ts[0].unbind(0)]
    t = torch.cat(ts) if rule.kind == "split" else ts[0]
    return [_flipped(t).contiguous()]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def plan_import(
    fmt: HFFormat, cfg: ModelConfig, theirs: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]
) -> dict[str, tuple[TensorRule, int]]:
    """For each hpc_train tensor: the rule making it and its index among the rule's outputs. `theirs`: the
    HF tensors' shapes; `expected`: every hpc_train tensor's (unpadded) shape. Raises a ConfigError naming
    every tensor that is missing, left over or of another shape."""
    plan, used, problems, missing = {}, set(), [], []
    for rule in fmt.rules(cfg):
        used.update(name for name in rule.sources if name in theirs)
        if absent := [name for name in rule.sources if name not in theirs]:
            missing += absent
            continue
        first = rule.sources[0]
        if others := [name for name in rule.sources if theirs[name] != theirs[first]]:
            problems.append(f"{others[0]} has shape {tuple(theirs[others[0]])}, unlike {first}'s "
                            f"{tuple(theirs[first])}")  # fmt: skip
        for index, (name, shape) in enumerate(zip(rule.ours, _theirs_shape(rule, theirs[first]), strict=True)):
            if expected.get(name) != shape:
                problems.append(f"{first} has shape {tuple(theirs[first])}, which makes {name} "
                                f"{shape}, but the model's {name} is {expected.get(name, 'absent')}")  # fmt: skip
            plan[name] = (rule, index)
    if missing:
        problems.insert(0, f"missing tensor{'s' if len(missing) > 1 else ''} {_listed(missing)}")
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
    return _to_ours(rule, [read(source) for source in rule.sources])[index]


def export_state(fmt: HFFormat, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole hpc_train tensors (unpadded) -> HF's; every one used exactly once, but `fmt.zero_buffers`,
    left out if zero and an error naming them if not (the HF model would compute something else)."""
    out, used = {}, {name for name in state if name.endswith(fmt.zero_buffers)}
    if nonzero := sorted(name for name in used if state[name].any()):
        raise ConfigError(f"cannot export to {fmt.architecture}: it has no place for {_listed(nonzero)}, which are "
                          "not zero (auxiliary-loss-free balancing moved them: model.moe.bias_update_rate > 0), "
                          "and its routing without them would differ")  # fmt: skip
    for rule in fmt.rules(cfg):
        missing = [name for name in rule.ours if name not in state]
        if missing:
            raise ConfigError(f"cannot export: the model has no tensor {missing[0]}")
        out.update(zip(rule.sources, _to_theirs(rule, [state[name] for name in rule.ours]), strict=True))
        used.update(rule.ours)
    if left := sorted(set(state) - used):
        raise ConfigError(f"cannot export: no Hugging Face tensor takes {_listed(left)}")
    return out
