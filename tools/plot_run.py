"""Plot loss (and eval loss), tokens/s and memory of one or more runs to a PNG; for runs on a blend of
sources (data.sources) each source's share of the training tokens and its eval loss (data.valid_sources);
and for each run with a straggler report (logging.straggler_interval) a heat strip of every rank's compute
time over the median.

python tools/plot_run.py runs/tiny runs/other --out runs.png

A RUN is a run's directory (its run_dir) from where you stand, or a run's name for the default run_dir,
runs/<name> there (`tiny`); the script runs from any directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def run_dir_of(run: str) -> Path:
    """The directory RUN names: a run directory from here, else runs/<RUN> (the default run_dir of a run
    named RUN); SystemExit naming where it looked otherwise."""
    candidates = [Path(run), Path("runs") / run] if len(Path(run).parts) == 1 else [Path(run)]
    for candidate in candidates:
        if (candidate / "metrics.jsonl").is_file():
            return candidate
    looked = " nor ".join(str((candidate / "metrics.jsonl").absolute()) for candidate in candidates)
    sys.exit(f"plot_run.py: error: no run '{run}': there is no {looked}; give a run's directory (its run_dir)")


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(run_dirs: list[Path], out: Path) -> Path:
    runs = {run_dir: read(run_dir) for run_dir in run_dirs}
    strips = {d: [r for r in records if "rank_compute_s" in r] for d, records in runs.items()}
    strips = {
        d: [r for r in reports if len(r["rank_compute_s"]) == len(reports[-1]["rank_compute_s"])]
        for d, reports in strips.items()
        if reports
    }  # the last layout's world size, if it changed
    blended = any(k.startswith("train_tokens/") for records in runs.values() for k in records[-1])
    panels = 3 + blended
    fig, axes = plt.subplots(1, panels + len(strips), figsize=(5 * (panels + len(strips)), 4))
    loss_ax, speed_ax, mem_ax = axes[:3]
    for ax, (run_dir, reports) in zip(axes[panels:], strips.items(), strict=True):
        heat_strip(fig, ax, run_dir.name, reports)
    if blended:
        per_source(axes[3], loss_ax, runs)
    for i, (run_dir, records) in enumerate(runs.items()):
        color = f"C{i}"  # one colour per run in every panel
        steps = [r["step"] for r in records]
        loss_ax.plot(steps, [r["loss"] for r in records], color=color, label=f"{run_dir.name} train")
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if evals:
            loss_ax.plot(*zip(*evals, strict=True), "o--", color=color, alpha=0.6, label=f"{run_dir.name} eval")
        speed_ax.plot(steps, [r["tokens_per_s"] for r in records], color=color, label=run_dir.name)
        mem_ax.plot(steps, [r["memory_gb"] for r in records], color=color, label=run_dir.name)
    for ax, title in ((loss_ax, "loss"), (speed_ax, "tokens/s"), (mem_ax, "peak memory (GB, max over ranks)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def per_source(share_ax, loss_ax, runs: dict[Path, list[dict]]) -> None:
    """Each source's share of the tokens trained so far (a line per source and run), and its eval loss."""
    for i, (run_dir, records) in enumerate(runs.items()):
        sources = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("train_tokens/")})
        for j, name in enumerate(sources):
            rows = [(r["step"], r.get(f"train_tokens/{name}", 0) / sum(v for k, v in r.items()
                     if k.startswith("train_tokens/"))) for r in records if f"train_tokens/{name}" in r]  # fmt: skip
            share_ax.plot(*zip(*rows, strict=True), color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4],
                          label=f"{run_dir.name} {name}")  # fmt: skip
        evals = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("eval_loss/")})
        for j, name in enumerate(evals):
            rows = [(r["step"], r[f"eval_loss/{name}"]) for r in records if f"eval_loss/{name}" in r]
            loss_ax.plot(*zip(*rows, strict=True), marker="osv^D"[j % 5], linestyle=":", color=f"C{i}", alpha=0.6,
                         label=f"{run_dir.name} eval {name}")  # fmt: skip
    share_ax.set_title("share of the training tokens, per source")
    share_ax.set_xlabel("step")
    share_ax.grid(alpha=0.3)
    share_ax.legend()


def heat_strip(fig, ax, name: str, reports: list[dict]) -> None:
    """Ranks down, reports across: each rank's compute time over the median of its report (1 = typical)."""
    ratios = [[c / max(statistics.median(r["rank_compute_s"]), 1e-12) for c in r["rank_compute_s"]] for r in reports]
    image = ax.imshow(list(zip(*ratios, strict=True)), aspect="auto", cmap="magma_r", vmin=1.0,
                      vmax=max(1.5, max(map(max, ratios))), interpolation="nearest")  # fmt: skip
    ax.set_xticks(range(len(reports)), [str(r["step"]) for r in reports])
    ax.set_title(f"{name}: compute time / median, per rank")
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    fig.colorbar(image, ax=ax)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run directory, or a run's name (runs/<name>)")
    parser.add_argument("--out", type=Path, default=Path("run.png"))
    args = parser.parse_args()
    print(plot([run_dir_of(run) for run in args.runs], args.out).absolute())


if __name__ == "__main__":
    main()
