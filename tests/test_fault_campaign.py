"""The fault campaign CI runs (tools/fault_campaign.py --short): real runs of 1 or 2 ranks, each with a drawn layout
and drawn faults, must end on their uninterrupted run's losses, read nothing of another run and leave nothing
in their node-local or NVMe directories, within 60 s. Its seed draws, among others, another run of the same
name killed on the node before a rank of this one is killed, which fails where node-local checkpoints carry no
run identity (the restart then resumes the other run's state), and a kill right after a node-local save."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

from tests.conftest import ROOT

BUDGET_S = 60  # what CI allows the short campaign


def test_short_campaign_loses_mixes_and_leaves_nothing(tmp_path):
    out = tmp_path / "campaign"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "tools/fault_campaign.py", "--short", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=10 * BUDGET_S)  # fmt: skip
    elapsed = time.monotonic() - start
    report = done.stdout + done.stderr[-4000:]
    faults = [f for run in json.loads((out / "summary.json").read_text())["run_list"] for f in run["faults"]]
    statuses = Counter(f["status"] for f in faults)
    survived = {(f["kind"], f["phase"]) for f in faults if f["status"] == "survived"}
    assert done.returncode == 0, report
    assert statuses["lost"] == statuses["mixed"] == statuses["left over"] == 0, report
    total = next(line for line in done.stdout.splitlines() if line.startswith("total")).split()
    assert total[2:6] == [str(statuses["survived"]), "0", "0", "0"], report  # the printed table: faults, then each
    assert statuses["survived"] >= 8 and len(survived) >= 6, report
    assert {("same name", "other run"), ("kill -9 rank", "local_saved")} <= survived, report
    assert elapsed < BUDGET_S, f"the short campaign took {elapsed:.0f} s, CI allows {BUDGET_S} s\n{report}"
