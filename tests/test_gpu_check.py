"""tools/gpu_check.py, the command a lent GPU runs, kept from rotting between loans: its smoke mode runs every
check's code at tiny shapes on the CPU (one launch, one process for the checks), and a check that raises
(planted with the hidden --plant-crash) fails the command and is named, while the others still report."""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from tools.gpu_check import CHECKS, run_child, settle

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "moe"  # a cheap check; the crash comes after its rows, so they are checked too
NEEDS_CUDA = "skipped: needs CUDA"


def test_smoke_runs_every_check_and_a_crash_fails_the_command(tmp_path):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--smoke", "--out", str(tmp_path), "--plant-crash",
                           PLANTED], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    wall = time.perf_counter() - start
    assert done.returncode == 1, done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = {r["name"]: r for r in report["checks"]}
    assert list(checks) == list(CHECKS)
    assert report["smoke"] and report["env"]["torch"] == torch.__version__
    for name, record in checks.items():
        assert record["rows"], name
        for row in record["rows"]:  # every row ran, or is one only CUDA can run
            assert row["status"] in ("ok", NEEDS_CUDA), (name, row)
        if name == PLANTED:
            assert record["status"] == "failed" and "PlantedCrash" in record["reason"], record
        else:
            assert record["status"] == "ok", (name, record.get("reason"), done.stderr[-4000:])
    assert f"FAILED: {PLANTED}" in done.stderr
    table = done.stdout
    assert table == (tmp_path / "gpu_check.md").read_text() + "\n"
    assert f"| {PLANTED} | failed |" in table and f"torch {torch.__version__}" in table
    for name, record in checks.items():  # every row is in the table by name, CUDA-only ones said so
        for row in record["rows"]:
            line = next(line for line in table.splitlines() if line.startswith(f"| {name} | {row['row']} |"))
            assert line.endswith(f"| {row['status']} |"), line
    print(f"smoke: {wall:.0f} s in all, checks {report['seconds']:.0f} s")


def test_a_check_past_its_budget_is_stopped_and_reported(tmp_path):
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    code, tail = run_child(command, "slow", 1.0, smoke=True)
    assert code is None and time.perf_counter() - start < 15
    assert tail == ["started"]
    record = settle("slow", tmp_path, code, tail, 1.0)
    assert record["status"] == "timeout" and "budget of 1 s" in record["reason"] and "started" in record["reason"]
    crashed = settle("crashed", tmp_path, 3, ["Traceback", "ValueError: bad"], 1.0)
    assert crashed["status"] == "failed" and "exited with 3" in crashed["reason"] and "ValueError" in crashed["reason"]
