"""Weights & Biases, beside metrics.jsonl (logging.wandb; the optional extra `.[wandb]`, imported only when a
project is set). The metrics writer's rank opens the W&B run with the resolved config, and every record it
writes goes there too, against the run's own step (W&B's internal step keeps counting: a step trained again
after a resume is logged again, as metrics.jsonl's history had it). The W&B run id is the run's identity:
derived from its name and resolved run directory, so every start of the run (a requeue, an in-job restart,
a later submission resuming it) continues the same W&B run, online or in offline files under run_dir/wandb
(`wandb sync` uploads them)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from hpc_train.errors import UserError
from hpc_train.observe.metrics import flatten


def wandb_run_id(name: str, run_dir: str | Path) -> str:
    """The run's W&B id: its name (readable in W&B's URLs) and a digest of its resolved run directory (unique
    where two runs share a name), in the characters W&B allows."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    readable = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:48]
    return f"{readable}-{digest}"


class WandbLog:
    """The W&B run of a training run: opened at the first record, closed with the metrics."""

    def __init__(self, cfg: Any):
        try:
            import wandb
        except ImportError:
            raise UserError("logging.wandb.project is set but wandb is not installed: pip install "
                            "'hpc_train[wandb]' (or unset logging.wandb.project)") from None  # fmt: skip
        options = cfg.logging.wandb
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=options.project, entity=options.entity, mode=options.mode, dir=cfg.run_dir, name=cfg.name,
            id=wandb_run_id(cfg.name, cfg.run_dir), resume="allow", config=dataclasses.asdict(cfg),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )  # fmt: skip
        self.run.define_metric("*", step_metric="step")  # charts against the run's step, not W&B's counter

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **flatten(record)})

    def close(self) -> None:
        self.run.finish()
