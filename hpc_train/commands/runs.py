"""`hpc-train runs DIR...`: many runs side by side (a sweep's members, a ladder, or any run directories): each
one's state (its job in the queue, else Slurm's accounting of its last job, else what its files say), the
step reached, the last loss, the best evaluation, the tokens read, the goodput with its largest loss, and the
config values that differ between them. `--plot` draws their loss curves on one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.commands.status import last_job, recorded_config, recorded_path
from hpc_train.launch.queue import jobs_of, queued_runs, slurm_output
from hpc_train.launch.sweep import read_manifest
from hpc_train.observe.goodput import account
from hpc_train.observe.metrics import read_records

IDENTITY = ("name", "run_dir", "checkpoint/dir", "slurm/log_dir", "slurm/job_name")  # differ by construction


def expand(dirs: list[str]) -> list[tuple[Path, str | None]]:
    """Each run directory, with the Slurm job (`<array>_<task>`) that last ran it where a sweep's array did: a
    sweep's directory stands for its members."""
    out = []
    for given in map(Path, dirs):
        manifest = read_manifest(given)
        if manifest is None:
            out.append((given, None))
            continue
        last: dict[int, str] = {}
        for array in manifest["arrays"]:
            many = len(array["members"]) > 1
            for task, member in enumerate(array["members"]):
                last[member] = f"{array['job_id']}_{task}" if many else array["job_id"]
        out += [(Path(m["path"]), last.get(i)) for i, m in enumerate(manifest["members"])]
    return out


def run_dirs(dirs: list[str]) -> list[Path]:
    """The run directories `dirs` stand for: a sweep's members, or the directory itself."""
    return [path for path, _ in expand(dirs)]


def slurm_state(path: Path, cfg: dict, array_task: str | None, queued) -> str | None:
    """The run's job in the queue, else Slurm's accounting of the last job that ran it; None without one."""
    if jobs := jobs_of(str(path), queued):
        return f"{jobs[0].state} (job {jobs[0].job_id})"
    if array_task is not None:
        out = slurm_output(["sacct", "-j", array_task, "-X", "-n", "-o", "State%40"]) or ""
        return f"{(out.split() or ['unknown'])[0]} (job {array_task})"
    logs = recorded_path(path, cfg, cfg["slurm"]["log_dir"] or f"{cfg['run_dir']}/slurm") if cfg else path / "slurm"
    if last := last_job(path, logs):
        return f"{last[1] or 'unknown'} (job {last[0]})"
    return None


def run_row(path: Path, array_task: str | None, queued) -> dict[str, Any]:
    cfg, records = recorded_config(path), read_records(path)
    total = cfg.get("train", {}).get("steps")
    step = records[-1]["step"] if records else None
    state = slurm_state(path, cfg, array_task, queued)
    if state is None:
        state = "not started" if step is None else ("finished" if total and step >= total else f"stopped at {step}")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    tokens = records[-1].get("consumed_samples", 0) * cfg["model"]["seq_len"] if records and cfg else None
    goodput = account(path)
    return {
        "run": cfg.get("name") or path.name,
        "state": state,
        "step": f"{'-' if step is None else step}/{total or '?'}",
        "loss": f"{records[-1]['loss']:.4f}" if records else "-",
        "best eval": f"{min(evals):.4f}" if evals else "-",
        "tokens": f"{tokens:,}" if tokens is not None else "-",
        "goodput": describe_goodput(goodput),
        "config": cfg,
        "records": records,
    }


def describe_goodput(goodput: dict[str, Any] | None) -> str:
    """`62.1% (redone 3.1s, startup 2s)`: the share, then every cause of lost time, the largest first."""
    if not goodput or goodput["goodput"] is None:
        return "-"
    lost = sorted(goodput["lost_s"].items(), key=lambda item: -item[1])
    return f"{100 * goodput['goodput']:.1f}%" + (f" ({', '.join(f'{c} {s:.2g}s' for c, s in lost)})" * bool(lost))


def differing(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's config values that are not the same in every row, as `key=value`s (identity keys apart)."""
    flat = [_leaves(row["config"]) for row in rows]
    keys = sorted({key for values in flat for key in values})
    varying = [k for k in keys if not k.startswith(IDENTITY) and len({repr(v.get(k)) for v in flat}) > 1]
    return [" ".join(f"{k.replace('/', '.')}={values.get(k)}" for k in varying) for values in flat]


def _leaves(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def runs_table(dirs: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The table, and its rows (with each run's config and records, for a plot)."""
    queued = queued_runs()
    rows = [run_row(path, task, queued) for path, task in expand(dirs)]
    if not rows:
        return "no runs", rows
    for row, values in zip(rows, differing(rows), strict=True):
        row["differs"] = values
    columns = ["run", "state", "step", "loss", "best eval", "tokens", "goodput", "differs"]
    widths = {c: max(len(c), *(len(str(row[c])) for row in rows)) for c in columns}
    lines = ["  ".join(f"{c:<{widths[c]}}" for c in columns)]
    lines += ["  ".join(f"{str(row[c]):<{widths[c]}}" for c in columns) for row in rows]
    return "\n".join(line.rstrip() for line in lines), rows


def plot_runs(rows: list[dict[str, Any]], out: str) -> Path:
    """The runs' training loss (and evaluation loss, dashed) against the step, one colour a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for n, row in enumerate(rows):
        colour, records = f"C{n % 10}", row["records"]
        axes.plot([r["step"] for r in records], [r["loss"] for r in records], color=colour, label=row["run"])
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if evals:
            axes.plot(*zip(*evals, strict=True), color=colour, linestyle="--")
    axes.set(xlabel="step", ylabel="loss (eval dashed)")
    axes.legend(fontsize="small")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path
