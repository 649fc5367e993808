"""Save and resume during training. The checkpointer owns the save policy (every `checkpoint.interval`
steps, at the end, on a stop signal) and the registered parts it saves (checkpoint/state.py): sharded
parts through DCP, every rank writing its own shards, and small per-rank parts in each rank's own file.
The store commits them (checksums, manifest, atomic rename, `latest`); on start the newest checkpoint
that verifies is loaded, in whatever layout this run uses.

With `checkpoint.async_save`, DCP writes on a background thread over its own gloo group while training
goes on; the next save (or the end of training) waits for it and only then commits it, so a crash
during an async save leaves only a `.tmp` directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import hpc_train
from hpc_train.checkpoint.state import ShardedPart, Stateful
from hpc_train.checkpoint.store import CheckpointError, CheckpointStore, describe_files
from hpc_train.config import JobConfig, to_yaml

FORMAT = 2  # of the per-rank files; format 1 (hpc_train 08c1275) kept the sampler's count at top level


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def upgrade_rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """A per-rank file of any format, as format 2: {"step", then one state_dict per part}."""
    if state.get("format", 1) > 1:
        return state
    step = state["step"]
    return {"step": step, "sampler": {"consumed_samples": state["consumed_samples"]},
            "loss_scaler": state["loss_scaler"], "rng": state["rng"], "metrics": {"step": step}}  # fmt: skip


@dataclass
class Resumed:
    step: int
    layout: dict[str, Any]  # the layout it was saved with


class Checkpointer:
    """`sharded` parts go through DCP; `shared` parts (the same on every rank) are restored from rank 0's
    file; `per_rank` parts (RNG streams) from each rank's own file, and only when the layout is the same."""

    def __init__(
        self,
        cfg: JobConfig,
        layout: dict[str, Any],
        sharded: dict[str, ShardedPart],
        shared: dict[str, Stateful],
        per_rank: dict[str, Stateful],
        report: Callable[[str], None],
    ):
        self.cfg, self.layout, self.report = cfg, layout, report
        self.sharded, self.shared, self.per_rank = sharded, shared, per_rank
        self.store = CheckpointStore(cfg.checkpoint.dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # DCP's background writes need a group of their own, created collectively up front
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        self.pending: tuple[Any, int] | None = None

    # ---- save -------------------------------------------------------------------------------------
    def should_save(self, step: int, stop_requested: bool) -> bool:
        interval = self.cfg.checkpoint.interval
        return stop_requested or bool(interval and (step % interval == 0 or step == self.cfg.train.steps))

    def save(self, step: int) -> None:
        self.wait()
        tmp = self.store.tmp_dir(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale partial save of this step
            tmp.mkdir(parents=True)
        dist.barrier()
        parts = {name: part.state_dict() for name, part in {**self.shared, **self.per_rank}.items()}
        torch.save({"format": FORMAT, "step": step, **parts}, tmp / rank_file(self.rank))
        state = {f"{name}.{key}": t for name, part in self.sharded.items() for key, t in part.tensors().items()}
        if self.async_group is None:
            dcp.save(state, checkpoint_id=tmp)
            self._commit(step)
            return
        response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.async_group)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # the weights may change only once they are staged to host memory
            staged.result()
        self.pending = (getattr(response, "upload_completion", response), step)

    def wait(self) -> None:
        """Finish and commit an async save in flight."""
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            future.result()
            self._commit(step)

    def _commit(self, step: int) -> None:
        tmp = self.store.tmp_dir(step)
        mine = [f for f in os.listdir(tmp) if f.startswith(f"__{self.rank}_")] + [rank_file(self.rank)]
        if self.rank == 0:
            mine.append(".metadata")
        described = [None] * self.world if self.rank == 0 else None
        dist.gather_object(describe_files(tmp, mine), described, dst=0)
        if self.rank == 0:
            files = {name: record for part in described for name, record in part.items()}
            manifest = {"layout": self.layout, "config": to_yaml(self.cfg), "code_version": hpc_train.__version__}
            final = self.store.commit(step, files, manifest)
            removed = self.store.prune(self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every, final)
            self.report(f"checkpoint {final} committed ({len(files)} files)" + (
                f"; removed {', '.join(p.name for p in removed)}" if removed else ""))  # fmt: skip
        dist.barrier()

    # ---- resume -----------------------------------------------------------------------------------
    def resume(self) -> Resumed | None:
        """Load the newest checkpoint that verifies into every registered part; None when there is none."""
        choice: list[Any] = [None, None]
        if self.rank == 0:
            info = self.store.newest_valid(full=self.cfg.checkpoint.verify == "full", report=self.report)
            if info is not None:
                choice = [str(info.path), info.manifest]
        dist.broadcast_object_list(choice, src=0)
        path, manifest = choice
        if path is None:
            return None
        try:
            stored = set(FileSystemReader(path).read_metadata().state_dict_metadata)
            templates = {
                name: part.template({k.removeprefix(f"{name}.") for k in stored if k.startswith(f"{name}.")})
                for name, part in self.sharded.items()
            }
            dcp.load({f"{name}.{k}": t for name, ts in templates.items() for k, t in ts.items()}, checkpoint_id=path)
            shared = upgrade_rank_state(torch.load(Path(path) / rank_file(0), weights_only=False))
        except (CheckpointException, Exception) as err:  # DCP's exception derives from BaseException
            raise CheckpointError(f"loading checkpoint {path} failed: {err}") from None
        step = shared["step"]
        for name, part in self.sharded.items():  # in registration order: the model before the optimizer
            part.load(templates[name], step)
        for name, part in self.shared.items():
            if shared.get(name) is not None:
                part.load_state_dict(shared[name])
        same_layout = manifest["layout"] == self.layout
        if same_layout:
            own = upgrade_rank_state(torch.load(Path(path) / rank_file(self.rank), weights_only=False))
            for name, part in self.per_rank.items():
                part.load_state_dict(own[name])
        change = "" if same_layout else f", resharded from {manifest['layout']} to {self.layout}"
        self.report(f"resumed from {path} (step {step}{change})")
        return Resumed(step, manifest["layout"])
