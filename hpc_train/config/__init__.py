"""Configuration: the schema (schema.py: one dataclass per section, each field's rule beside it), loading
YAML + `key=value` overrides over it (load.py), and the checks omegaconf cannot express (checks.py).
Every error is a `ConfigError` naming the key and the fix."""

from hpc_train.config.checks import (
    check_values,
    derive_dp,
    has_control_chars,
    raise_all,
    time_limit_minutes,
    validate,
)
from hpc_train.config.load import load_config, parse_overrides, to_yaml
from hpc_train.config.schema import (
    BUILTIN_DATA,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DataSource,
    FinetuneConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "BUILTIN_DATA", "CheckpointConfig", "ConfigError", "DataConfig", "DataSource", "FinetuneConfig", "JobConfig",
    "LoggingConfig", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "SlurmConfig", "TrainConfig",
    "check_values",
    "derive_dp", "has_control_chars", "load_config", "parse_overrides", "raise_all", "time_limit_minutes", "to_yaml",
    "validate",
]  # fmt: skip
