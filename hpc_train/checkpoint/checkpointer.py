"""Save and resume during training: every rank writes its own shards (DCP) and its own state file, the
store commits them (checksums, manifest, atomic rename, `latest`), and on start the newest checkpoint
that verifies is loaded, in whatever layout this run uses.

With `checkpoint.async_save`, DCP writes on a background thread over its own gloo group while training
goes on; the next save (or the end of training) waits for it and only then commits it, so a crash
during an async save leaves only a `.tmp` directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import hpc_train
from hpc_train.checkpoint.state import apply_loaded, load_template, rng_state, set_rng_state, sharded_state
from hpc_train.checkpoint.store import CheckpointError, CheckpointStore, describe_files
from hpc_train.config import JobConfig, to_yaml
from hpc_train.distributed.parallelize import ParallelModel


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


class Checkpointer:
    def __init__(self, cfg: JobConfig, model: ParallelModel, optimizer, report: Callable[[str], None]):
        self.cfg, self.model, self.optimizer, self.report = cfg, model, optimizer, report
        self.store = CheckpointStore(cfg.checkpoint.dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        p = cfg.parallel
        self.layout = {"tp": p.tp, "pp": p.pp, "dp": model.mesh["dp"].size(), "world_size": self.world,
                       "zero_stage": cfg.optim.zero_stage, "precision": cfg.train.precision}  # fmt: skip
        # DCP's background writes need a group of their own, created collectively up front
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        self.pending: tuple[Any, int] | None = None

    # ---- save -------------------------------------------------------------------------------------
    def save(self, step: int, progress: dict[str, Any]) -> None:
        self.wait()
        tmp = self.store.tmp_dir(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale partial save of this step
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save({**progress, "rng": rng_state()}, tmp / rank_file(self.rank))
        state = sharded_state(self.model, self.optimizer)
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
    def resume(self) -> dict[str, Any] | None:
        """Load the newest checkpoint that verifies into the model and optimizer; return the progress
        state (step, consumed samples, loss scaler) or None when there is none."""
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
            loaded = load_template(self.model, self.optimizer, stored)
            dcp.load(loaded, checkpoint_id=path)
            progress = torch.load(Path(path) / rank_file(0), weights_only=False)
        except (CheckpointException, Exception) as err:  # DCP's exception derives from BaseException
            raise CheckpointError(f"loading checkpoint {path} failed: {err}") from None
        apply_loaded(self.model, self.optimizer, loaded, progress["step"])
        same_layout = manifest["layout"] == self.layout
        if same_layout:
            set_rng_state(torch.load(Path(path) / rank_file(self.rank), weights_only=False)["rng"])
        if self.rank == 0:
            change = "" if same_layout else f", resharded from {manifest['layout']} to {self.layout}"
            self.report(f"resumed from {path} (step {progress['step']}{change})")
        return {**progress, "resumed_from": {"step": progress["step"], "layout": manifest["layout"]}}
