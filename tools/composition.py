"""Which pairs of features a run accepts, from the checks every command runs before anything starts (`check_job`
as `hpc-train plan` and `submit` run it: every key's rule and the layout, for the cluster, without this
machine's process limit or the data files). Each pair is laid over a small Llama (4 layers, 4 heads, d_model
128, seq_len 256) at dp 2. The table goes into docs/parallelism.md between its `composition` markers; a test
fails when the page's table is not what this prints.

    python tools/composition.py            # print the table
    python tools/composition.py --write    # put it into docs/parallelism.md

Accepted is not proven: which accepted pairs are compared with one process is the page's tests' list.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

from hpc_train.cli import check_job
from hpc_train.config import ConfigError
from hpc_train.job import load_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "parallelism.md"
START, END = "<!-- composition:start -->", "<!-- composition:end -->"
BASE = [
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_model=128",
    "model.seq_len=256",
    "train.micro_batch_size=2",
    "train.grad_accum=4",
]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
# name: (its own overrides, what it needs set, which the other feature of a pair may set otherwise)
FEATURES: dict[str, tuple[list[str], list[str]]] = {
    "tp2+sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], []),
    "pp2": (["parallel.pp=2"], []),
    "zbv": (["parallel.schedule=zbv", "parallel.virtual_stages=2"], ["parallel.pp=2"]),
    "cp2 ring": (["parallel.cp=2", "parallel.cp_mode=ring"], []),
    "cp2 ulysses": (["parallel.cp=2", "parallel.cp_mode=ulysses"], []),
    "zero1": (["optim.zero_stage=1"], []),
    "zero2": (["optim.zero_stage=2"], []),
    "zero3": (["optim.zero_stage=3"], []),
    "cpu offload": (["optim.offload=cpu"], ["optim.zero_stage=1"]),
    "nvme offload": (["optim.offload=nvme", "optim.offload_dir=$SLURM_TMPDIR/offload"], ["optim.zero_stage=1"]),
    "moe": (MOE, []),
    "ep2": (["parallel.ep=2"], MOE),
    "fp8": (["train.fp8=tensorwise"], ["train.precision=bf16"]),
    "fp16": (["train.precision=fp16"], []),
    "compile": (["train.compile=true"], []),
    "recompute": (["model.recompute=selective"], []),
    "act. offload": (["model.activation_offload=full"], []),
    "documents": (["data.document_mask=true", "data.reset_position_ids=true"], []),
    "muon": (["optim.name=muon"], []),
    "adamw8bit": (["optim.name=adamw8bit"], []),
    "lora": (["finetune.method=lora"], []),
    "qlora": (["finetune.method=qlora"], ["train.precision=bf16"]),
    "spike guard": (["train.spike_guard.enabled=true"], ["checkpoint.interval=100"]),
    "local ckpt": (
        ["checkpoint.local_dir=$SLURM_TMPDIR/ckpt", "checkpoint.local_interval=10"],
        ["parallel.max_restarts=1", "checkpoint.interval=100"],
    ),
}


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def merged(a: str, b: str) -> tuple[list[str], int] | None:
    """The pair's overrides and world (dp 2 times tp x pp x cp), or None where it is not a pair of features:
    the two set one of their own keys two ways (two cp modes), or one is what the other needs (pp2 and zbv)."""
    (own_a, needs_a), (own_b, needs_b) = (map(_pairs, FEATURES[a]), map(_pairs, FEATURES[b]))
    if any(own_b.get(k, v) != v for k, v in own_a.items()):
        return None
    if own_a.items() <= needs_b.items() or own_b.items() <= needs_a.items():
        return None
    keys = {**needs_a, **needs_b, **own_a, **own_b}  # a feature's own value over what the other needs
    dims = {name: int(keys.get(f"parallel.{name}", 1)) for name in ("tp", "pp", "cp")}
    return [f"{k}={v}" for k, v in keys.items()], 2 * dims["tp"] * dims["pp"] * dims["cp"]


def verdict(a: str, b: str) -> str | None:
    """'' where the checks accept the pair, else the first line of their error; None: not a pair."""
    pair = merged(a, b)
    if pair is None:
        return None
    overrides, world = pair
    try:
        check_job(load_config(None, [*BASE, *overrides]), world, starts_here=False, check_paths=False)
    except ConfigError as err:
        return str(err).splitlines()[0]
    return ""


def render() -> str:
    names = list(FEATURES)
    results = {(a, b): verdict(a, b) for a, b in itertools.combinations(names, 2)}
    reasons: list[str] = []
    code = {n: chr(ord("A") + i) for i, n in enumerate(names)}
    lines = [
        "| | " + " | ".join(code[n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for a in names:
        cells = []
        for b in names:
            result = results.get((a, b), results.get((b, a))) if a != b else None
            if a == b or result is None:
                cells.append("")
            elif result == "":
                cells.append("yes")
            else:
                reason = re.sub(r"\s+", " ", result)
                if reason not in reasons:
                    reasons.append(reason)
                cells.append(f"no{reasons.index(reason) + 1}")
        lines.append(f"| {code[a]} {a} | " + " | ".join(cells) + " |")
    pairs = [r for r in results.values() if r is not None]
    lines += ["", f"{sum(r == '' for r in pairs)} of {len(pairs)} pairs accepted. Why a pair is refused:", ""]
    lines += [f"{i}. {reason}" for i, reason in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


def page_with(table: str, page: str) -> str:
    head, rest = page.split(START + "\n", 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"put the table into {PAGE.name}")
    table = render()
    if parser.parse_args().write:
        PAGE.write_text(page_with(table, PAGE.read_text()))
    else:
        print(table, end="")


if __name__ == "__main__":
    main()
