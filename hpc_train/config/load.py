"""Loading a config: the schema's defaults, then a YAML file (or the config a checkpoint recorded), then
`key=value` overrides, merged and type-checked by omegaconf (`data.sources` may be Megatron-LM's blend
string: blend_string.py); every merge error becomes a ConfigError that names the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from hpc_train.config.blend_string import expand_blend_strings
from hpc_train.config.fields import ConfigError
from hpc_train.config.schema import JobConfig


def _all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        full = f"{prefix}{key}"
        keys.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            keys.extend(_all_keys(child, f"{full}."))
    return keys


def _merge_error(err: OmegaConfBaseException, source: str, schema: type[JobConfig]) -> ConfigError:
    """Turn an omegaconf merge error into a message naming the key, the value and the fix."""
    key = err.full_key or err.key or "?"
    if isinstance(err, ConfigKeyError):
        valid = _all_keys(OmegaConf.structured(schema))
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else "; `hpc-train config show` lists the valid keys"
        return ConfigError(f"unknown config key '{key}' (from {source}){hint}")
    if isinstance(err, ValidationError) and err.value is not None and key != "?":
        value = err.value._value() if hasattr(err.value, "_value") else err.value
        expected = schema
        try:
            for part in str(key).split("."):
                expected = typing.get_type_hints(expected)[part]
        except KeyError:  # a field of a list's element (data.sources): omegaconf names the field alone
            return ConfigError(f"invalid config key '{key}' of a list's element (from {source}): "
                               f"{str(err.msg).splitlines()[0]}")  # fmt: skip
        expected_name = getattr(expected, "__name__", str(expected))
        return ConfigError(
            f"config key '{key}' (from {source}) got {value!r} of type {type(value).__name__}, expected {expected_name}"
        )
    where = f"config key '{key}' " if key != "?" else "config "
    return ConfigError(f"invalid {where}(from {source}): {str(err.msg or err).splitlines()[0]}")


def _check_sections(layer: DictConfig, source: str, schema: type[JobConfig]) -> None:
    """A section given as a plain value (`model: 5`) is named before omegaconf reports it obscurely."""
    sections = {f.name for f in dataclasses.fields(schema) if f.default_factory is not dataclasses.MISSING}
    for key in layer:
        if key in sections and not isinstance(layer._get_node(key), DictConfig):
            raise ConfigError(f"config section '{key}' (from {source}) must be a mapping of its keys "
                              f"(e.g. '{key}.<key>=...'), not {layer[key]!r}")  # fmt: skip


def parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=10)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        bad = next((item for item in overrides if not _parses(item.partition("=")[2])), "?")
        raise ConfigError(f"override '{bad}' is not valid YAML ({problem}); quote the value, e.g. \"['*']\"") from None


def _parses(value: str) -> bool:
    try:
        yaml.safe_load(value)
        return True
    except yaml.YAMLError:
        return False


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    saved: str | None = None,
    *,
    schema: type[JobConfig] = JobConfig,
) -> JobConfig:
    """Defaults <- YAML file (or `saved`, the YAML text a checkpoint recorded) <- `key=value` overrides,
    type-checked and interpolations resolved, into `schema`: the core sections, or (hpc_train.job) those
    with every registered feature's keys."""
    merged = OmegaConf.structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if saved is not None:
        layers.append(("a checkpoint's recorded config", OmegaConf.create(saved)))
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file '{path}' does not exist; the presets live in configs/")
        try:
            loaded = OmegaConf.load(path)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(f"config file '{path}' is not valid YAML{line}: {problem}") from None
        except (UnicodeDecodeError, OSError) as err:
            raise ConfigError(f"config file '{path}' cannot be read: {err}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, not a list")
        layers.append((str(path), loaded))
    layers.append(("command line", parse_overrides(overrides or [])))
    for source, layer in layers:
        _check_sections(layer, source, schema)
        expand_blend_strings(layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _merge_error(err, source, schema) from None
    try:
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"could not resolve config: {err.msg}") from None


class _Text(str):
    """A string value of the config, which YAML writes single-quoted: no reader then takes it for another
    type (omegaconf reads `1e3` as a float, YAML 1.1 reads `on` as a bool)."""


def _quoted(value: typing.Any) -> typing.Any:
    if isinstance(value, dict):
        return {key: _quoted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_quoted(item) for item in value]
    return _Text(value) if isinstance(value, str) else value


class _Dumper(yaml.SafeDumper):
    """SafeDumper writing `_Text` single-quoted."""


_Dumper.add_representer(_Text, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, "'"))


def to_yaml(cfg: JobConfig) -> str:
    """The resolved config as YAML (a run's config.yaml, each checkpoint's manifest), which `load_config`
    reads back to the same config. Dumped from the dataclasses directly: omegaconf's structured rendering
    took ~40 ms, a step's worth of a small model, at every run's start and first checkpoint."""
    return yaml.dump(_quoted(dataclasses.asdict(cfg)), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
