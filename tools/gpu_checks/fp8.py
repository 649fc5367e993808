"""Check 2, FP8: hpc_train compiled with train.fp8=tensorwise and =rowwise against bf16 compiled, on the
dense check's shape and micro batch (tools/bench_gpu.py's rows; bf16 is measured again here, in this
process, so that the ratio compares like with like: inductor's cache makes its compile quick)."""

from __future__ import annotations

from hpc_train.job import load_config
from hpc_train.launch.local import single_process_group
from tools.bench_gpu import measure_rows, random_batch, row_builders, row_figures
from tools.gpu_checks.common import Check, fp8_problem
from tools.gpu_checks.dense import dense_keys, describe, steps

ROWS = {"hpc_train compile": "bf16 compiled", "hpc_train comp. fp8": "fp8 tensorwise compiled",
        "hpc_train comp. fp8r": "fp8 rowwise compiled"}  # fmt: skip
TARGET = 1.2  # x bf16 compiled tokens/s


def run(check: Check) -> None:
    keys = dense_keys(check, check.options.micro_batch)
    cfg = load_config(None, keys)
    warmup, timed = steps(check)
    check.setup(f"as dense: micro batch {cfg.train.micro_batch_size} x {cfg.model.seq_len}, {warmup} warm-up + "
                f"{timed} timed steps; MFU against the bf16 peak")  # fmt: skip
    problem = fp8_problem(check.device)
    with single_process_group(device=check.device) as rank_env:
        builders = row_builders(keys, check.device, rank_env, fp8=True)
        chosen = {row: builders[row] for row in ROWS if problem is None or row == "hpc_train compile"}
        rows = measure_rows(chosen, random_batch(cfg, check.device), check.device, warmup, timed)
    figures = row_figures(rows, cfg, check.device)
    base = figures.get("hpc_train compile")
    for row, label in ROWS.items():
        if row not in rows:
            check.skip(label, problem)
            continue
        if row not in figures:
            check.row(label, rows[row]["error"], status=f"failed: {rows[row]['error']}")
            check.fail(f"{label}: {rows[row]['error']}")
            continue
        f = figures[row]
        ratio = f["tokens_s"] / base["tokens_s"] if base else None
        fp8 = row != "hpc_train compile"
        versus = f"{ratio:.2f}x the tokens/s of bf16 compiled" if fp8 and ratio is not None else ""
        check.row(label, describe(f, check.cuda), versus, **f, x_bf16=ratio)
        if fp8:
            measured = check.cuda and ratio is not None
            value = f"{ratio:.2f}x" if measured else "not measured"
            check.target(f"{label} >= {TARGET}x bf16 compiled tokens/s", value, ratio >= TARGET if measured else None)
