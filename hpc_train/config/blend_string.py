"""Megatron-LM's blend string as `data.sources`: `"0.3 /data/a 0.7 /data/b"` (weight, path pairs), or paths
alone (equal weights), as teams moving from Megatron-LM write its `--data-path`. It becomes the list form
before omegaconf merges it, so that everything after loading (the checks, the blend, the recorded config)
sees one form."""

from __future__ import annotations

from omegaconf import DictConfig

from hpc_train.config.fields import ConfigError


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def parse_blend(text: str, key: str, source: str) -> list[dict]:
    """The sources a blend string names, as the list form's entries; ConfigError naming the key otherwise."""
    words = text.split()
    weights = [_number(word) for word in words[0::2]]
    if words and len(words) % 2 == 0 and None not in weights:
        return [{"path": path, "weight": weight} for weight, path in zip(weights, words[1::2], strict=True)]
    if words and all(_number(word) is None for word in words):
        return [{"path": path} for path in words]
    raise ConfigError(f"{key}={text!r} (from {source}) is not a blend string: give weight and path pairs, e.g. "
                      f"{key}='0.3 /data/a 0.7 /data/b', or paths alone for equal weights")  # fmt: skip


def expand_blend_strings(layer: DictConfig, source: str) -> None:
    """`data.sources` given as a blend string, in one layer of the config, becomes the list form in place."""
    data = layer.get("data") if "data" in layer else None
    if isinstance(data, DictConfig) and "sources" in data and isinstance(data.sources, str):
        data.sources = parse_blend(data.sources, "data.sources", source)
