"""The one protocol a Hugging Face `transformers` class is converted through, `HFAdapter` (one file per class,
in its family's folder: gpt2/hf.py, llama/hf.py, llama/mixtral_hf.py), and the engine that runs any adapter:
the config mapping behind the adapter's import refusals, and its tensor table read forwards on import and
backwards, behind its export refusals, on export. Pure tables and shape arithmetic; reading and writing the
files is checkpoint/hf_io.py's, and which adapter serves a config.json or a ModelConfig is the registry's
(models/__init__.py). Every conversion accounts for every tensor on both sides: a tensor left over, missing
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
               "moe.score_func", "moe.norm_topk_prob")  # fmt: skip


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


def nothing_refused(*args: Any) -> list[str]:
    """An adapter's refusal that finds nothing: the HF class and the family agree on everything they hold."""
    return []


@dataclass(frozen=True)
class HFAdapter:
    """How one `transformers` class and an hpc_train family correspond, as plain functions the engine runs:
    the adapter says what maps to what and what cannot be mapped; the engine (`model_fields`, `plan_import`
    with `import_tensor`, `export_state`) applies it, checks that every tensor is accounted for, and reports
    every refusal at once. A refusal returns its problems, each naming the key, rather than raising, so a
    config with several gets them all in one error."""

    model_type: str  # config.json's model_type
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    # the config both ways: config.json -> ModelConfig fields (ARCH_FIELDS); ModelConfig -> the transformers
    # config's kwargs (what save_pretrained writes as config.json)
    from_hf_config: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf_config: Callable[[ModelConfig], dict[str, Any]]
    # the state dict both ways: which HF tensors make which of ours, read forwards on import and backwards on
    # export
    rules: Callable[[ModelConfig], list[TensorRule]]
    # what the family refuses: on import, an HF option its model does not implement (config.json -> problems);
    # on export, what the HF class cannot express (a config and its whole tensors -> problems)
    refuse_import: Callable[[dict[str, Any]], list[str]] = nothing_refused
    refuse_export: Callable[[ModelConfig, dict[str, torch.Tensor]], list[str]] = nothing_refused
    derived: tuple[str, ...] = ()  # suffixes of HF tensors that are recomputed buffers, not weights
    # suffixes of hpc_train buffers the HF class has no place for, left out on export: `refuse_export` refuses
    # a state in which they are not zero (a router's bias)
    zero_buffers: tuple[str, ...] = ()
    experts: bool = False  # the class for the family's model.moe configs (else for its dense ones)


def unsupported(config: dict[str, Any], key: str, allowed: tuple, default: Any = None) -> list[str]:
    """An HF option hpc_train's family does not implement, as a refusal's problem (not a silently different
    model); none if `config`'s `key` (or its default) is one of `allowed`."""
    value = config.get(key, default)
    if value in allowed:
        return []
    return [f"Hugging Face config {key}={value!r} is not supported (hpc_train's model needs one of "
            f"{', '.join(map(repr, allowed))})"]  # fmt: skip


def model_fields(adapter: HFAdapter, config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> ModelConfig fields (ARCH_FIELDS), once the adapter refuses nothing in it."""
    if problems := adapter.refuse_import(config):
        raise ConfigError("; ".join(problems))
    return adapter.from_hf_config(config)


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


def listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def plan_import(
    adapter: HFAdapter, cfg: ModelConfig, theirs: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]
) -> dict[str, tuple[TensorRule, int]]:
    """For each hpc_train tensor: the rule making it and its index among the rule's outputs. `theirs`: the
    HF tensors' shapes; `expected`: every hpc_train tensor's (unpadded) shape. Raises a ConfigError naming
    every tensor that is missing, left over or of another shape."""
    plan, used, problems, missing = {}, set(), [], []
    for rule in adapter.rules(cfg):
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
        problems.insert(0, f"missing tensor{'s' if len(missing) > 1 else ''} {listed(missing)}")
    left = sorted(n for n in theirs if n not in used and not n.endswith(adapter.derived))
    if left:
        problems.append(f"tensors hpc_train's {cfg.arch} model has no place for: {listed(left)}")
    unmade = sorted(set(expected) - set(plan))
    if unmade and not problems:
        problems.append(f"no Hugging Face tensor makes {listed(unmade)}")
    if problems:
        raise ConfigError("the Hugging Face checkpoint does not match the model: " + "; ".join(problems))
    return plan


def import_tensor(plan: dict[str, tuple[TensorRule, int]], name: str, read: Callable[[str], torch.Tensor]):
    """hpc_train tensor `name`, made from the HF tensor `read` returns."""
    rule, index = plan[name]
    return _to_ours(rule, [read(source) for source in rule.sources])[index]


def export_state(adapter: HFAdapter, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole hpc_train tensors (unpadded) -> HF's, once the adapter refuses nothing in `cfg` and `state` (every
    problem in one error); every tensor used exactly once, but `adapter.zero_buffers`, left out (its
    refusal has checked they are zero)."""
    if problems := adapter.refuse_export(cfg, state):
        raise ConfigError(f"cannot export to {adapter.architecture}: {'; '.join(problems)}")
    out, used = {}, {name for name in state if name.endswith(adapter.zero_buffers)}
    for rule in adapter.rules(cfg):
        missing = [name for name in rule.ours if name not in state]
        if missing:
            raise ConfigError(f"cannot export: the model has no tensor {missing[0]}")
        out.update(zip(rule.sources, _to_theirs(rule, [state[name] for name in rule.ours]), strict=True))
        used.update(rule.ours)
    if left := sorted(set(state) - used):
        raise ConfigError(f"cannot export: no Hugging Face tensor takes {listed(left)}")
    return out


def hf_modules(adapter: HFAdapter, cfg: ModelConfig, modules: list[str]) -> tuple[dict[str, str], bool]:
    """For PEFT's adapter format: the HF module each of our `modules` (LoRA-adapted projections) is, and
    whether HF stores their weights (in, out) (PEFT's fan_in_fan_out). A module of ours that is only part of
    an HF one (GPT-2's q, k, v: one fused module there) cannot carry its adapters alone: an error naming it."""
    rules = {rule.ours: rule for rule in adapter.rules(cfg)}
    found, kinds = {}, set()
    for module in modules:
        rule = rules.get((f"{module}.weight",))
        if rule is None or rule.kind not in ("same", "transpose"):
            raise ConfigError(f"--adapters-only: {module} has no Hugging Face module of its own; export the "
                              "merged model instead (without --adapters-only)")  # fmt: skip
        found[module] = rule.theirs.removesuffix(".weight")
        kinds.add(rule.kind)
    return found, kinds == {"transpose"}
