"""`hpc-train runs DIR...`: many runs side by side (a sweep's members, a ladder, or any run directories): each
one's state (its job in the queue, else Slurm's accounting of its last job, else what its files say), the
step reached, the last loss, the best evaluation, the tokens read, the goodput with its largest loss, and the
config values that differ between them. `--plot` draws their loss curves on one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.commands.status import recorded_config, run_job
from hpc_train.launch.queue import queued_runs, read_manifest
from hpc_train.observe.goodput import account
from hpc_train.observe.metrics import read_records

IDENTITY = ("name", "run_dir", "checkpoint/dir", "slurm/log_dir", "slurm/job_name")  # differ by construction


def run_dirs(dirs: list[str]) -> list[Path]:
    """The run directories `dirs` stand for: a sweep's members (its sweep.json), or the directory itself."""
    out = []
    for given in map(Path, dirs):
        manifest = read_manifest(given)
        out += [Path(m["path"]) for m in manifest["members"]] if manifest else [given]
    return out


def run_row(path: Path, queued) -> dict[str, Any]:
    """The run's row: its job's state (in the queue, else Slurm's accounting of the last job that ran it), else
    what its files say; its step, losses, tokens and goodput; its config and records, for the table and a plot."""
    cfg, records = recorded_config(path), read_records(path)
    total = cfg.get("train", {}).get("steps")
    step = records[-1]["step"] if records else None
    if job := run_job(path, cfg, queued):
        state = f"{job[1]} (job {job[0]})"
    else:
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
    causes = ", ".join(f"{cause} {seconds:.{2 if seconds < 1 else 1}f}s" for cause, seconds in lost)
    return f"{100 * goodput['goodput']:.1f}%" + f" ({causes})" * bool(lost)


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
    rows = [run_row(path, queued) for path in run_dirs(dirs)]
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
