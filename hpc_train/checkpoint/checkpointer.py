"""Save and resume during training. The checkpointer owns the save policy (every `checkpoint.interval`
steps, at the end, on a stop signal) and the registered parts it saves (checkpoint/state.py): sharded
parts through DCP, every rank writing its own shards, and small per-rank parts in each rank's own file.
The store commits them (checksums, manifest, atomic rename, `latest`); on start the newest checkpoint
that verifies is loaded, in whatever layout this run uses.

With `checkpoint.async_save`, DCP writes on a background thread over its own gloo group while training
goes on; the next save (or the end of training) waits for it and only then commits it, so a crash
during an async save leaves only a `.tmp` directory.

Before the first save or load the run claims the directory (checkpoint/ownership.py): a lock no second
live run can take, and a check that the checkpoints there are this run's. Nothing is unpickled from
the files (checkpoint/safe_load.py).
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import hpc_train
from hpc_train.checkpoint.ownership import DirectoryLock, refuse_foreign
from hpc_train.checkpoint.safe_load import SafeFileSystemReader, load_rank_file, read_dcp_metadata
from hpc_train.checkpoint.state import ShardedPart, Stateful
from hpc_train.checkpoint.store import CheckpointError, CheckpointStore, describe_files
from hpc_train.config import JobConfig, to_yaml

# of the per-rank files; format 1 (hpc_train 08c1275) kept the sampler's count at top level, formats 1 and
# 2 the numpy RNG key as a numpy array (3: a tensor, so the files load with weights_only=True alone)
FORMAT = 3


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
        data: dict[str, int] | None = None,
    ):
        """`data`: the training data's size, recorded in each manifest as part of the run's identity."""
        self.cfg, self.layout, self.report, self.data = cfg, layout, report, data
        self.sharded, self.shared, self.per_rank = sharded, shared, per_rank
        self.store = CheckpointStore(cfg.checkpoint.dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # DCP's background writes need a group of their own, created collectively up front
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        self.pending: tuple[Any, int] | None = None
        self.lock = DirectoryLock(self.store.root)

    # ---- ownership --------------------------------------------------------------------------------
    def claim(self) -> None:
        """Lock the directory and, for a run that will not resume (`resume` checks what it loads), check
        that its checkpoints are this run's, before anything is written; every rank raises the same
        CheckpointError when either fails."""
        problem: list[str | None] = [None]
        if self.rank == 0:
            try:
                if note := self.lock.acquire():
                    self.report(note)
                fresh = not self.cfg.checkpoint.resume
                newest = self.store.newest_valid(full=False, report=lambda message: None) if fresh else None
                if newest is not None:
                    refuse_foreign(newest.path, newest.manifest, self.cfg, self.data)
            except (CheckpointError, OSError) as err:
                problem = [str(err)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            self.release()
            raise CheckpointError(problem[0])

    def release(self) -> None:
        self.lock.release()

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
        state = {f"{name}.{key}": t for name, part in self.sharded.items() for key, t in part.tensors().items()}
        doing = f"saving checkpoint of step {step} into {tmp}"
        problem = None
        try:  # serialized first, so a full disk is the OSError of a plain write
            buffer = io.BytesIO()
            torch.save({"format": FORMAT, "step": step, **parts}, buffer)
            (tmp / rank_file(self.rank)).write_bytes(buffer.getbuffer())
        except OSError as err:
            problem = f"{doing} failed on rank {self.rank}: {err}"
        problems = [None] * self.world
        dist.all_gather_object(problems, problem)  # every rank stops together, none waits inside DCP
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        with io_errors_named(doing, tmp):
            if self.async_group is None:
                dcp.save(state, checkpoint_id=tmp)
            else:
                response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.async_group)
        if self.async_group is None:
            self._commit(step)
            return
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # the weights may change only once they are staged to host memory
            staged.result()
        self.pending = (getattr(response, "upload_completion", response), step)

    def wait(self) -> None:
        """Finish and commit an async save in flight."""
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            with io_errors_named(f"writing checkpoint of step {step} in the background", self.store.tmp_dir(step)):
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
            manifest = {"layout": self.layout, "config": to_yaml(self.cfg), "code_version": hpc_train.__version__,
                        "data": self.data}  # fmt: skip
            final = self.store.commit(step, files, manifest)
            removed = self.store.prune(self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every, final)
            self.report(f"checkpoint {final} committed ({len(files)} files)" + (
                f"; removed {', '.join(p.name for p in removed)}" if removed else ""))  # fmt: skip
        dist.barrier()

    # ---- resume -----------------------------------------------------------------------------------
    def resume(self) -> Resumed | None:
        """Load the newest checkpoint that verifies into every registered part; None when there is none."""
        choice: list[Any] = [None, None, None]
        if self.rank == 0:
            info = self.store.newest_valid(full=self.cfg.checkpoint.verify == "full", report=self.report)
            if info is not None:
                choice = [str(info.path), info.manifest, None]
                try:
                    refuse_foreign(info.path, info.manifest, self.cfg, self.data)
                except CheckpointError as err:
                    choice[2] = str(err)
        dist.broadcast_object_list(choice, src=0)
        path, manifest, refused = choice
        if refused:
            raise CheckpointError(refused)
        if path is None:
            return None
        try:
            metadata = read_dcp_metadata(Path(path), set(manifest["files"])).state_dict_metadata
            self._check_shapes(path, {key: tuple(md.size) for key, md in metadata.items()})
            templates = {
                name: part.template({k.removeprefix(f"{name}.") for k in metadata if k.startswith(f"{name}.")})
                for name, part in self.sharded.items()
            }
            state = {f"{name}.{k}": t for name, ts in templates.items() for k, t in ts.items()}
            dcp.load(state, storage_reader=SafeFileSystemReader(path))
            shared = upgrade_rank_state(load_rank_file(Path(path) / rank_file(0)))
        except CheckpointError:
            raise
        except (CheckpointException, Exception) as err:  # DCP's exception derives from BaseException
            raise CheckpointError(f"loading checkpoint {path} failed: {root_cause(err)}") from None
        step = shared["step"]
        for name, part in self.sharded.items():  # in registration order: the model before the optimizer
            part.load(templates[name], step)
        for name, part in self.shared.items():
            if shared.get(name) is not None:
                part.load_state_dict(shared[name])
        same_layout = manifest["layout"] == self.layout
        if same_layout:
            own = upgrade_rank_state(load_rank_file(Path(path) / rank_file(self.rank)))
            for name, part in self.per_rank.items():
                part.load_state_dict(own[name])
        change = "" if same_layout else f", resharded from {manifest['layout']} to {self.layout}"
        self.report(f"resumed from {path} (step {step}{change})")
        return Resumed(step, manifest["layout"])

    def _check_shapes(self, path: str, stored: dict[str, tuple[int, ...]]) -> None:
        """Every tensor of a `strict` part (the model) must be in the checkpoint with its shape."""
        problems = []
        for name, part in self.sharded.items():
            if not getattr(part, "strict", False):
                continue
            for key, t in part.tensors().items():
                saved = stored.get(f"{name}.{key}")
                if saved != tuple(t.shape):
                    problems.append(f"{key}: {'absent' if saved is None else saved} there, {tuple(t.shape)} here")
        if problems:
            listed = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise CheckpointError(f"checkpoint {path} holds a different model ({listed})")


@contextmanager
def io_errors_named(doing: str, path: Path) -> Iterator[None]:
    """An OSError while writing (a full disk, a permission) as a CheckpointError naming what was being
    written and the system's reason, also when DCP wrapped it in its own exception (its tensor writer
    reports a full disk as a short write, so the free space is looked at too)."""
    try:
        yield
    except OSError as err:
        raise CheckpointError(f"{doing} failed: {err}") from None
    except CheckpointException as err:
        reason = root_cause(err)
        free = shutil.disk_usage(path).free if path.exists() else None
        if free is not None and free < 2**24 and "No space left" not in reason:
            reason = f"No space left on device ({free} bytes free there): {reason}"
        raise CheckpointError(f"{doing} failed: {reason}") from None


def root_cause(err: BaseException) -> str:
    """One line: DCP's exception carries each failed rank's exception (an OSError, if any, says most)."""
    if not isinstance(err, CheckpointException):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    causes = [pair[0] for pair in err.failures.values()]
    return root_cause(next((e for e in causes if isinstance(e, OSError)), causes[0])) if causes else "unknown"
