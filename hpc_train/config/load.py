"""Loading a config: the schema's defaults, then a YAML file (or the config a checkpoint recorded), then
`key=value` overrides, merged and type-checked by omegaconf (`data.sources` may be Megatron-LM's blend
string: blend_string.py); every merge error becomes a line of one ConfigError that names the key, the value
and the fix. A config file is a path from where the user stands, else a preset (`config_path`)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from hpc_train.config.blend_string import expand_blend_strings
from hpc_train.config.fields import ConfigError
from hpc_train.config.schema import JobConfig

# where the presets may be: configs/ of the source tree the package is in (a checkout, an editable install),
# then the data folder of the environment it is installed in (where a wheel would install them)
SOURCE_TREE = Path(__file__).resolve().parents[2]
PRESET_DIRS = (SOURCE_TREE / "configs", Path(sys.prefix) / "share" / "hpc_train" / "configs")


def presets_dir() -> Path | None:
    """The first of PRESET_DIRS there is; the source tree's only where it is one (its pyproject.toml beside the
    package), not the site-packages folder an installed package is in."""
    tree = (SOURCE_TREE / "pyproject.toml").is_file()
    return next((folder for folder in PRESET_DIRS[not tree :] if folder.is_dir()), None)


def config_path(path: str | os.PathLike) -> Path:
    """The config file `path` names: a file from the current directory (or an absolute path), else a preset,
    by name (`tiny`) or by its path in the repository (`configs/tiny.yaml`), so either works from any
    directory; a ConfigError naming the presets otherwise."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    presets = presets_dir()
    if presets is not None and not given.is_absolute():
        named = presets / (given.name if given.suffix == ".yaml" else f"{given.name}.yaml")
        found = named if len(given.parts) == 1 else presets.parent / given
        if found.is_file() and found.resolve().parent == presets.resolve():
            return found
    if presets is None:
        where = " or ".join(str(folder) for folder in PRESET_DIRS)
        raise ConfigError(f"config file '{path}' does not exist (from {Path.cwd()}); no presets were found either "
                          f"(looked in {where}): give a config file's path")  # fmt: skip
    names = ", ".join(sorted(preset.stem for preset in presets.glob("*.yaml")))
    raise ConfigError(f"config file '{path}' does not exist (from {Path.cwd()}), nor is it a preset: the presets, "
                      f"by name, are {names} (in {presets}), e.g. `hpc-train config show tiny`")  # fmt: skip


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
        return ConfigError(f"unknown config key '{key}' (from {source}){_did_you_mean(str(key), schema)}")
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


def _did_you_mean(key: str, schema: type[JobConfig]) -> str:
    """The hint for an unknown key: the same key in another section (`train.lr`: 'optim.lr'), else the
    closest key (not the key's own section: it has none close)."""
    section, _, leaf = key.rpartition(".")
    own = {".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 1)}
    valid = [other for other in _all_keys(OmegaConf.structured(schema)) if other not in own]
    close = [other for other in valid if section and other.rpartition(".")[2] == leaf]
    close = close or difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:
        return "; `hpc-train config show` lists the valid keys"
    return f"; did you mean {' or '.join(repr(other) for other in close[:3])}?"


def _bad_sections(layer: DictConfig, source: str, schema: type[JobConfig]) -> list[str]:
    """A section given as a plain value (`model: 5`) is named before omegaconf reports it obscurely, and
    left out of `layer`."""
    sections = {f.name for f in dataclasses.fields(schema) if f.default_factory is not dataclasses.MISSING}
    bad = [key for key in layer if key in sections and not isinstance(layer._get_node(key), DictConfig)]
    problems = [f"config section '{key}' (from {source}) must be a mapping of its keys (e.g. '{key}.<key>=...'), "
                f"not {layer[key]!r}" for key in bad]  # fmt: skip
    for key in bad:
        del layer[key]
    return problems


def _merge(
    merged: DictConfig, layer: DictConfig, source: str, schema: type[JobConfig], problems: list[str]
) -> DictConfig:
    """`layer` merged over `merged`. Each key omegaconf refuses is named in `problems` and left out of the
    layer, and the rest merged again, so that every bad key is reported, not only the first; a key that
    cannot be left out (a field of a list's element) ends the layer's merge."""
    while True:
        try:
            return OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            problems.append(str(_merge_error(err, source, schema)))
            if not _drop(layer, err.full_key):
                return merged


def _drop(layer: DictConfig, key: str | None) -> bool:
    """Remove the dotted `key` from `layer`; False where it is not there by that name."""
    parent, _, leaf = (key or "").rpartition(".")
    node = OmegaConf.select(layer, parent) if parent else layer
    if not isinstance(node, DictConfig) or not leaf or leaf not in node:
        return False
    del node[leaf]
    return True


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
    with every registered feature's keys. `path`: see `config_path`. Every bad key is reported, one line each.
    Paths the config holds (data.train_path, run_dir...) are the run's, from where it starts, not the file's."""
    merged = OmegaConf.structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if saved is not None:
        layers.append(("a checkpoint's recorded config", OmegaConf.create(saved)))
    if path is not None:
        path = config_path(path)
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
    problems: list[str] = []
    for source, layer in layers:
        problems += _bad_sections(layer, source, schema)
        expand_blend_strings(layer, source)
        merged = _merge(merged, layer, source, schema, problems)
    if problems:
        raise ConfigError("\n".join(problems))
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
