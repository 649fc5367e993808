"""Sweeps: many runs of one config, as one Slurm job array. `hpc-train sweep CONFIG key=v1,v2 ...` makes a
member for each combination of the values (the product, or with --zip the zip); each member is a run of
its own, named `<name>-<label>` in `<run_dir>/<label>`, where `<run_dir>` (the config's) becomes the
sweep's directory: its sweep.json lists the members and the arrays that ran them, its slurm/ holds the
array's logs. Every member passes `submit`'s checks before anything is submitted; a member whose
metrics.jsonl reached train.steps is finished and not submitted again, so submitting the same sweep again
resumes the unfinished members (each from its own newest checkpoint) and skips the rest. The model
ladder (commands/ladder.py) submits its sizes as a sweep."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.config import ConfigError
from hpc_train.launch.queue import SWEEP_FILE, array_comment, read_manifest
from hpc_train.launch.slurm import SlurmTask, executor_for, sbatch_script
from hpc_train.observe.metrics import last_step

# keys a member may not take a value of its own for: its identity (the sweep gives it), and the job's
# resources (one array runs every member with the same #SBATCH lines)
FIXED_KEYS = ("name", "run_dir", "slurm.")


@dataclass(frozen=True)
class Member:
    """One run of a sweep: its label (its directory under the sweep's, and its name's suffix), the values it
    sets, and its config once loaded."""

    label: str
    values: dict[str, str]
    cfg: Any = field(default=None, compare=False)


def split_values(value: str) -> list[str]:
    """A swept value's list: split at commas outside brackets and quotes, so `[1,2]` or `'0.3 a 0.7 b'` stays one
    value (a blend string is written with spaces)."""
    parts, depth, quote, current = [], 0, "", ""
    for char in value:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    return [*parts, current]


def sweep_axes(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The overrides every member shares, and the swept keys with their values (an override whose value
    holds a comma outside brackets and quotes)."""
    shared, axes = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        values = split_values(value)
        if len(values) == 1:
            shared.append(item)
            continue
        if key in axes:
            raise ConfigError(f"{key} is swept twice; give its values once: {key}=a,b,c")
        if key.startswith(FIXED_KEYS):
            raise ConfigError(
                f"{key} may not be swept: the sweep names each member and its run_dir, and one job array runs "
                "every member with one slurm section (submit such runs apart)"
            )
        if "" in values or len(set(values)) < len(values):
            raise ConfigError(f"{key}={value}: a swept value is empty or repeated; give distinct values, e.g. "
                              f"{key}=1e-3,3e-3")  # fmt: skip
        axes[key] = values
    return shared, axes


def combinations(axes: dict[str, list[str]], zipped: bool) -> list[dict[str, str]]:
    """Each member's values: every combination (the product, the last key varying fastest), or the i-th value of
    every key (`zipped`: the keys' lists must have one length)."""
    keys = list(axes)
    if not zipped:
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]
    lengths = {key: len(values) for key, values in axes.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{key}: {n}" for key, n in lengths.items())
        raise ConfigError(f"--zip pairs the i-th values of every swept key, but they have different counts ({listed}); "
                          "give each as many values, or drop --zip for every combination")  # fmt: skip
    return [dict(zip(keys, values, strict=True)) for values in zip(*axes.values(), strict=True)]


def member_label(values: dict[str, str]) -> str:
    """A member's label from its values: each key's last part and its value (`lr0.001-micro_batch_size4`), the
    whole key where two swept keys end alike; characters a file name should not hold become '_'."""
    last = [key.rsplit(".", 1)[-1] for key in values]
    parts = []
    for key, short in zip(values, last, strict=True):
        name = short if last.count(short) == 1 else key.replace(".", "_")
        parts.append(name + re.sub(r"[^A-Za-z0-9._+-]", "_", values[key].strip("'\"")))
    return "-".join(parts)


def load_members(
    load: Callable[[list[str]], Any], shared: list[str], members: list[Member]
) -> tuple[Any, list[Member]]:
    """The sweep's own config (`load(overrides)`: its name and run_dir are the sweep's) and every member's,
    named `<name>-<label>` in `<run_dir>/<label>`. Members must not share a checkpoint directory."""
    labels = [member.label for member in members]
    if repeated := [member for member in members if labels.count(member.label) > 1]:
        listed = "; ".join(" ".join(f"{k}={v}" for k, v in member.values.items()) for member in repeated)
        raise ConfigError(f"members with different values get one label, {repeated[0].label} ({listed}): their run "
                          "directories would be one; give values that differ in letters or digits")  # fmt: skip
    base = load(shared)
    loaded = []
    for member in members:
        own = [f"{key}={value}" for key, value in member.values.items()]
        identity = [f"name={base.name}-{member.label}", f"run_dir={base.run_dir}/{member.label}"]
        try:
            cfg = load([*shared, *own, *identity])
        except ConfigError as err:
            raise ConfigError(in_member(member.label, str(err))) from None
        loaded.append(Member(member.label, member.values, cfg))
    dirs = [m.cfg.checkpoint.dir for m in loaded]
    if len(set(dirs)) < len(dirs):
        raise ConfigError(f"every member would write checkpoint.dir={dirs[0]}: leave it under ${{run_dir}} (its "
                          "default, ${run_dir}/checkpoints) so that each member has its own")  # fmt: skip
    return base, loaded


def in_member(label: str, problems: str) -> str:
    """A member's problems, each line naming it."""
    return "\n".join(f"member {label}: {line}" for line in problems.splitlines())


def finished(cfg: Any) -> bool:
    """A member whose metrics.jsonl records its last step (written once that step's save has committed)."""
    step = last_step(Path(cfg.run_dir))
    return step is not None and step >= cfg.train.steps


def check_sweep_dir(base: Any) -> None:
    """The sweep's directory holds sweeps, not a run of its own (its checkpoints would sit among the members')."""
    path = Path(base.run_dir)
    if (path / "config.yaml").is_file() or (path / "metrics.jsonl").is_file():
        raise ConfigError(f"{path} holds a run (config.yaml), not a sweep: give the sweep its own name= (its "
                          "directory is run_dir, runs/<name> by default)")  # fmt: skip


def with_members(base: Any, members: list[Member]) -> tuple[dict[str, Any], list[int]]:
    """sweep.json's contents with `members` in it (those of earlier submissions kept: a sweep submitted again
    with more values grows), and the members' indices there."""
    manifest = read_manifest(Path(base.run_dir)) or {"name": base.name, "members": [], "arrays": []}
    labels = [m["label"] for m in manifest["members"]]
    for member in members:
        if member.label not in labels:
            cfg = member.cfg
            manifest["members"].append({"label": member.label, "name": cfg.name, "run_dir": cfg.run_dir,
                                        "path": str(Path(cfg.run_dir).resolve()), "values": member.values})  # fmt: skip
            labels.append(member.label)
    return manifest, [labels.index(member.label) for member in members]


def write_manifest(base: Any, manifest: dict[str, Any]) -> None:
    """sweep.json, written whole: a temporary file renamed over it."""
    path = Path(base.run_dir) / SWEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{SWEEP_FILE}.{os.getpid()}")
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, path)


def array_parameters(base: Any, indices: list[int]) -> dict[str, Any]:
    """submitit's parameters of the array over the sweep's own: the comment naming the sweep and the member each
    task runs, and at most slurm.array_parallelism members at once."""
    return {"comment": array_comment(base.run_dir, indices),
            "array_parallelism": base.slurm.array_parallelism or len(indices)}  # fmt: skip


def array_script(base: Any, members: list[Member]) -> str:
    """The sbatch script of the members' array (as a dry run prints it): #SBATCH --array=0-<n-1>%<parallelism>
    (a single member: a plain job, as submitit submits it)."""
    indices = with_members(base, members)[1]
    return sbatch_script(
        base, **array_parameters(base, indices), **({"map_count": len(indices)} if len(indices) > 1 else {})
    )


def submit_array(base: Any, members: list[Member], entry: Callable) -> list:
    """One job array (one job where there is one member): task i runs members[i]'s `entry`. sweep.json lists
    the members before the array is submitted (the queue's view of it reads them), and then the array."""
    manifest, indices = with_members(base, members)
    write_manifest(base, manifest)
    executor = executor_for(base)  # its logs in the sweep's slurm/
    executor.update_parameters(**array_parameters(base, indices))
    with executor.batch():
        jobs = [executor.submit(SlurmTask(member.cfg, entry)) for member in members]
    manifest["arrays"].append({"job_id": jobs[0].job_id.split("_")[0], "members": indices})
    write_manifest(base, manifest)
    return jobs


def format_members(members: list[Member], done: list[bool]) -> str:
    """The members as a dry run and a submission list them: label, run directory, values, what happens."""
    rows = [(m.label, m.cfg.run_dir, " ".join(f"{k}={v}" for k, v in m.values.items()),
             "finished: skipped" if d else "runs") for m, d in zip(members, done, strict=True)]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
