"""Optimizers: a data-parallel strategy, selected by `optim.zero_stage`, holding an update rule, selected by
`optim.name` (optim/rules).

Every strategy follows `Optimizer` (optim/protocol.py): it takes a parallelized model's trainable
parameters, reduces their gradients over dp, lets its rule update them (or its sharded fp32 masters), and
hands the state to checkpoints per parameter. A new ZeRO stage (or FSDP) is a new class in `OPTIMIZERS`,
a new rule a module in optim/rules and a line in `RULES`, not a new branch elsewhere.
"""

from __future__ import annotations

from hpc_train.config import ConfigError, OptimConfig, TrainConfig
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.data_parallel import DataParallelOptimizer
from hpc_train.optim.experts import ExpertParallelOptimizer
from hpc_train.optim.fsdp import FullyShardedOptimizer
from hpc_train.optim.nvme import check_offload_dir
from hpc_train.optim.precision import PrecisionPolicy
from hpc_train.optim.protocol import Optimizer
from hpc_train.optim.rules import choices, rule_class
from hpc_train.optim.zero import Zero2Optimizer, ZeroOptimizer
from hpc_train.optim.zero_nvme import NvmeFullyShardedOptimizer, NvmeZero2Optimizer, NvmeZeroOptimizer

OPTIMIZERS: dict[int, type[Optimizer]] = {
    0: DataParallelOptimizer,
    1: ZeroOptimizer,
    2: Zero2Optimizer,
    3: FullyShardedOptimizer,
}
NVME: dict[int, type[Optimizer]] = {1: NvmeZeroOptimizer, 2: NvmeZero2Optimizer, 3: NvmeFullyShardedOptimizer}


def optimizer_class(cfg: OptimConfig) -> type[Optimizer]:
    """The class for `optim.zero_stage`, checked against what it supports (and its rule, `optim.name`)."""
    rule_class(cfg)
    if cfg.zero_stage not in OPTIMIZERS:
        raise ConfigError(f"optim.zero_stage={cfg.zero_stage} is not supported; use {choices(OPTIMIZERS)}")
    cls = OPTIMIZERS[cfg.zero_stage]
    if cfg.offload != "none" and not cls.shards_state:
        stage = next(stage for stage, c in OPTIMIZERS.items() if c.shards_state)
        raise ConfigError(f"optim.offload={cfg.offload} offloads the sharded optimizer state: set "
                          f"optim.zero_stage={stage}")  # fmt: skip
    if cfg.offload == "nvme":
        if cfg.name not in ("adamw", "muon"):
            raise ConfigError(f"optim.offload=nvme streams AdamW's and Muon's state; optim.name={cfg.name} is not "
                              "built for it yet: use optim.name=adamw or muon, or optim.offload=cpu")  # fmt: skip
        problems = check_offload_dir(cfg.offload_dir)
        if problems:
            raise ConfigError("\n".join(problems))
        return NVME[cfg.zero_stage]
    return cls


def build_optimizer(model: ParallelModel, cfg: OptimConfig) -> Optimizer:
    """With expert parallelism, the routed experts are reduced over their own group (optim/experts.py; FSDP2
    reduces them itself)."""
    cls = optimizer_class(cfg)
    if model.mesh.ep > 1 and not cls.shards_params:
        return ExpertParallelOptimizer(cls, model, cfg)
    return cls(model, cfg)


def precision_policy(train: TrainConfig, optim: OptimConfig) -> PrecisionPolicy:
    """Decided once, from train.precision and whether the optimizer keeps fp32 master weights."""
    return PrecisionPolicy.decide(train.precision, optimizer_class(optim).master_weights)
