"""Plot loss (and eval loss), tokens/s and memory of one or more runs to a PNG.

python tools/plot_run.py runs/tiny runs/other --out runs.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(run_dirs: list[Path], out: Path) -> Path:
    fig, (loss_ax, speed_ax, mem_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for i, run_dir in enumerate(run_dirs):
        records, color = read(run_dir), f"C{i}"  # one colour per run in every panel
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("run.png"))
    args = parser.parse_args()
    print(plot(args.run_dirs, args.out))


if __name__ == "__main__":
    main()
