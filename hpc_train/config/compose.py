"""The schema a run loads: the core sections (schema.py) with the keys every registered feature declares
mixed in. A feature's options are a dataclass of the keys it owns, each field's rule beside it, declared in
the feature's own folder: `train.fp8` is float8's, `parallel.cp_mode` context parallelism's. `compose` makes
each core section that gains keys a subclass of the core section and of those options, so users write the
keys where they always did while the code that reads them (the feature, typed by its options class) owns
them; a feature may also bring a section of its own (`finetune`).

The composed classes are given the qualified names `<job>.<section class>` in the registry's module, so a
config pickles to rank processes and Slurm jobs like any module-level dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from hpc_train.config.schema import JobConfig


def _chained_post_init(bases: tuple[type, ...]):
    """Each base's own `__post_init__` in turn (a dataclass runs only the first one its MRO finds)."""
    hooks = [vars(base)["__post_init__"] for base in bases if "__post_init__" in vars(base)]

    def __post_init__(self) -> None:
        for hook in hooks:
            hook(self)

    return __post_init__


def _section(core: type | None, options: list[type], job: str, module: str) -> type:
    """The core section `core` (None: the feature's own section) with `options` mixed in, core keys first."""
    bases = (*reversed(options), core) if core is not None else tuple(reversed(options))
    if len(bases) == 1:
        return bases[0]
    cls_name = (core or options[0]).__name__
    namespace = {"__post_init__": _chained_post_init(tuple(reversed(bases)))}
    section = dataclasses.make_dataclass(cls_name, [], bases=bases, namespace=namespace)
    section.__module__, section.__qualname__ = module, f"{job}.{cls_name}"
    return section


def compose(options: Iterable[tuple[str, type]], module: str, name: str = "JobConfig") -> type[JobConfig]:
    """`JobConfig` with every (section, options class) pair mixed in; the result must be bound to `name` in
    `module` (where pickle looks it up). Two options classes may not declare the same key."""
    by_section: dict[str, list[type]] = {}
    for section, cls in options:
        by_section.setdefault(section, []).append(cls)
    core = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
    for section, classes in by_section.items():
        keys = [f.name for cls in classes for f in dataclasses.fields(cls)]
        if core.get(section) not in (None, dataclasses.MISSING):
            keys += [f.name for f in dataclasses.fields(core[section])]
        if twice := sorted({key for key in keys if keys.count(key) > 1}):
            raise TypeError(f"{section}.{', '.join(twice)} declared twice by the registered features")
    sections = {section: _section(core.get(section), classes, name, module)
                for section, classes in by_section.items()}  # fmt: skip
    fields = [(section, cls, dataclasses.field(default_factory=cls)) for section, cls in sections.items()]
    job = dataclasses.make_dataclass(name, fields, bases=(JobConfig,))
    job.__module__ = module
    for cls in sections.values():
        if cls.__qualname__.startswith(f"{name}."):
            setattr(job, cls.__name__, cls)
    return job
