"""Whose checkpoints these are: the run identity a checkpoint directory belongs to, and the lock that keeps
a second live run from writing into it.

The identity is read from the config every manifest already records (so checkpoints of earlier
versions have one too): the run's name and the model's shape; manifests also record the size of the
training data (tokens, documents) and its content fingerprint (from the dataset's header), so that a moved
dataset is the same data and another one, even one of the same size, is not; a side without a fingerprint
(a checkpoint or a dataset from before them, a Megatron-LM corpus) is compared by its size only. Resuming
with a different one is refused with the differences named. So is resuming under another update rule
(`optim.name`), unless `optim.reset_state=true` asks for the optimizer state to start afresh; resuming at
another global batch is warned of (`batch_change`). The lock is an `flock` on `<dir>/.lock`, held by global
rank 0 for as long as it trains; the kernel drops it when that process dies however it dies, so a lock left
by a dead run is simply taken over (the file names the last holder, for the messages).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpc_train.checkpoint.safe_load import CheckpointError
from hpc_train.checkpoint.store import CheckpointStore
from hpc_train.config import to_yaml
from hpc_train.job import JobConfig

IDENTITY_KEYS = (
    "name", "model.arch", "model.vocab_size", "model.n_layers", "model.n_heads",
    "model.n_kv_heads", "model.d_model", "model.ffn_hidden", "model.ffn_multiple", "model.tie_embeddings",
    "model.seq_len", "finetune.method", "finetune.lora_rank", "finetune.lora_targets",
    "model.moe.num_experts", "model.moe.num_shared_experts", "model.moe.expert_ffn_hidden",
    "model.moe.first_dense_layers",
)  # fmt: skip
LOCK = ".lock"


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else getattr(tree, part)
    return tree


# None means "the family's choice" for these: compared only when both sides name a value (the tensor
# shapes, checked on resume, decide the rest)
FAMILY_DEFAULTS = ("model.n_kv_heads", "model.ffn_hidden", "model.tie_embeddings")


def identity_differences(saved_config: str, cfg: JobConfig) -> list[str]:
    """`key: saved -> here` for every identity key on which a checkpoint's recorded config and `cfg` differ
    (a key older versions did not record counts as its default)."""
    saved = yaml.safe_load(saved_config)
    if not isinstance(saved, dict):
        return ["the checkpoint's recorded config is unreadable"]
    defaults, out = JobConfig(), []
    for key in IDENTITY_KEYS:
        try:
            old = _lookup(saved, key)
        except AttributeError:
            old = None
        old, new = _lookup(defaults, key) if old is None else old, _lookup(cfg, key)
        if old != new and not (key in FAMILY_DEFAULTS and None in (old, new)):
            out.append(f"{key}: {old!r} in the checkpoint, {new!r} here")
    return out


def dataset_difference(saved: dict, here: dict, what: str) -> str | None:
    """How one dataset's identity differs from the checkpoint's (`what` names it), or None: its counts, then
    its content fingerprint where both sides record one."""
    counts = lambda identity: {key: value for key, value in identity.items() if key != "fingerprint"}
    if counts(saved) != counts(here):
        return f"{what}: {saved} in the checkpoint, {here} here"
    fingerprints = saved.get("fingerprint"), here.get("fingerprint")
    if None not in fingerprints and fingerprints[0] != fingerprints[1]:
        return (f"{what}: the same {here['tokens']} tokens and {here['documents']} document(s) but other content "
                f"(fingerprint {saved['fingerprint']} in the checkpoint, {here['fingerprint']} here): prepared again "
                "or edited since")  # fmt: skip
    return None


def data_differences(saved: dict, here: dict, train_path: str | None = None) -> list[str]:
    """The training data of a checkpoint against this run's: one dataset (data.train_path, `train_path`
    names it) must be the same; a blend's sources present on both sides must be the same by name (a source
    added or left out is a new phase of the mix)."""
    if "sources" in saved and "sources" in here:
        common = sorted(saved["sources"].keys() & here["sources"].keys())
        found = [dataset_difference(saved["sources"][name], here["sources"][name], f"training data source {name!r}")
                 for name in common]  # fmt: skip
        return [f"{difference} (give a changed source another name)" for difference in found if difference]
    if "sources" in saved or "sources" in here:
        return [f"training data: {saved} in the checkpoint, {here} here"]
    difference = dataset_difference(saved, here, "training data")
    where = "" if train_path is None else f" (data.train_path={train_path})"
    return [difference + where] if difference else []


def refuse_foreign(
    path: Path, manifest: dict, cfg: JobConfig, data: dict | None = None, base_weights: str | None = None
) -> None:
    """Raise a CheckpointError naming the differences when a checkpoint is not this run's: its config's
    identity keys, the training data's size when both sides know it, and the fingerprint of base weights
    it does not hold (QLoRA's)."""
    differences = identity_differences(manifest["config"], cfg)
    if data is not None and manifest.get("data") is not None:
        differences += data_differences(manifest["data"], data, cfg.data.train_path)
    if base_weights is not None and manifest.get("base_weights") != base_weights:
        differences.append(f"base weights (model.init_from): {manifest.get('base_weights')} in the checkpoint, "
                           f"{base_weights} here")  # fmt: skip
    if differences:
        raise CheckpointError(
            f"checkpoint {path} belongs to another run or model ({'; '.join(differences)}); resuming it would "
            "mix two runs and then prune its checkpoints. Point checkpoint.dir at a directory of this run's own "
            "(or set the keys back to the checkpoint's values to continue that run)"
        )


def rule_change(path: Path, manifest: dict, cfg: JobConfig) -> str | None:
    """A resume under another update rule than the checkpoint's (`optim.name`; older manifests record it too):
    refused with a CheckpointError, since the new rule's state would start at zero unnoticed, unless
    `optim.reset_state=true` asks for that; then the line the log gets. None: the same rule."""
    saved = yaml.safe_load(manifest["config"])
    try:
        old = _lookup(saved, "optim.name") if isinstance(saved, dict) else None
    except AttributeError:
        old = None
    old, new = old or JobConfig().optim.name, cfg.optim.name
    if old == new:
        return None
    if not cfg.optim.reset_state:
        raise CheckpointError(
            f"checkpoint {path} was trained with optim.name={old}, and this run asks for optim.name={new}: {old}'s "
            f"optimizer state would be dropped and {new}'s would start at zero. Set optim.name={old} to continue "
            f"the run as it was, or optim.reset_state=true to resume its weights with the optimizer state reset"
        )
    return (f"optimizer state reset (optim.reset_state=true): checkpoint {path} was trained with optim.name={old}; "
            f"{new}'s state starts at zero for every parameter")  # fmt: skip


BATCH_KEYS = "train.micro_batch_size x train.grad_accum x dp"


def batch_change(path: Path, manifest: dict, cfg: JobConfig, dp: int) -> str | None:
    """The warning a resume at another global batch than the checkpoint's gets (its recorded config's micro
    batch and gradient accumulation, its layout's dp), naming both and how to keep the checkpoint's; None
    where it is the same. Not refused: the data position (consumed samples) carries over, and a run may mean
    to change it (Megatron-LM's batch-size ramp-up does as much)."""
    saved = yaml.safe_load(manifest["config"]).get("train") or {}
    defaults = JobConfig().train
    old_parts = [saved.get("micro_batch_size", defaults.micro_batch_size), saved.get("grad_accum", defaults.grad_accum),
                 manifest["layout"]["dp"]]  # fmt: skip
    t = cfg.train
    new_parts = [t.micro_batch_size, t.grad_accum, dp]
    old, new = math.prod(old_parts), math.prod(new_parts)
    if old == new:
        return None
    per_rank, uneven = divmod(old, dp)
    if uneven:
        keep = f"a layout whose dp divides {old}"
    elif per_rank % t.micro_batch_size == 0:
        keep = f"train.grad_accum={per_rank // t.micro_batch_size}"
    else:
        keep = f"train.micro_batch_size x train.grad_accum = {per_rank}"
    spell = lambda parts: " x ".join(map(str, parts))
    return (f"warning: the global batch changes on resume, from {old} samples a step (checkpoint {path}: "
            f"{BATCH_KEYS} = {spell(old_parts)}) to {new} ({spell(new_parts)}); the learning-rate schedule still "
            f"counts steps. To keep {old}, set {keep} (train.global_batch_size={old} then refuses a layout that "
            "changes it)")  # fmt: skip


@dataclass(frozen=True)
class RunIdentity:
    """What makes checkpoints this run's, as the checkpointer records it in each manifest and checks it on
    every checkpoint it would resume or write beside: the config (whose identity keys count), the training
    data's size and content fingerprint, and the fingerprint of base weights the checkpoints do not hold (QLoRA's)."""

    cfg: JobConfig
    data: dict | None = None  # the training data's identity (IndexedDataset.identity)
    base_weights: str | None = None

    @functools.cached_property
    def config_yaml(self) -> str:
        """The config as every manifest records it: rendered once (OmegaConf takes tens of ms per rendering)."""
        return to_yaml(self.cfg)

    def manifest_fields(self) -> dict[str, Any]:
        return {"config": self.config_yaml, "data": self.data, "base_weights": self.base_weights}

    def digest(self) -> str:
        """The identity in a few bytes, for what has no manifest (node-local copies): the whole config (its
        run_dir and checkpoint.dir included), the data's and the base weights'; any difference is another run."""
        return hashlib.sha256(json.dumps(self.manifest_fields(), sort_keys=True).encode()).hexdigest()[:16]

    def refuse_foreign(self, path: Path, manifest: dict) -> None:
        refuse_foreign(path, manifest, self.cfg, self.data, self.base_weights)

    def rule_change(self, path: Path, manifest: dict) -> str | None:
        return rule_change(path, manifest, self.cfg)


class DirectoryLock:
    """An exclusive, process-lifetime claim on a checkpoint directory."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a note when it took over from a run that is gone. Raises CheckpointError
        naming the holder when a live run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096)
            os.close(fd)
            raise self._busy(holder) from None
        previous = os.read(fd, 4096)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return f"took over the lock of {self.path.parent} from a run that is gone ({_describe(previous)})" if (
            previous) else None  # fmt: skip

    def check_free(self) -> None:
        """Raise the same CheckpointError as `acquire` when a live run holds the lock; take nothing."""
        if not self.path.is_file():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(os.read(fd, 4096)) from None
        finally:
            os.close(fd)

    def _busy(self, holder: bytes) -> CheckpointError:
        return CheckpointError(
            f"checkpoint.dir {self.path.parent} is in use by a live run ({_describe(holder)}); two runs must "
            "never write one directory: wait for it to end or stop it, or give this run its own checkpoint.dir"
        )

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a clean end: the next run has nothing to take over
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _describe(raw: bytes) -> str:
    try:
        h = json.loads(raw)
        job = f", Slurm job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
        return f"pid {h['pid']} on {h['host']}{job}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def check_checkpoint_dir(cfg: JobConfig, probe_lock: bool) -> None:
    """Before any process starts: the newest checkpoint in checkpoint.dir is this run's (and, to be resumed,
    of its update rule or optim.reset_state=true) and (`probe_lock`, for a run about to start here) no live
    run holds the directory."""
    store = CheckpointStore(cfg.checkpoint.dir)
    newest = store.newest_valid(full=False, report=lambda message: None)
    if newest is not None:
        refuse_foreign(newest.path, newest.manifest, cfg)
        if cfg.checkpoint.resume:
            rule_change(newest.path, newest.manifest, cfg)
    if probe_lock:
        DirectoryLock(store.root).check_free()
