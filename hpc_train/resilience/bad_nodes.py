"""Nodes blamed for a failure (a rank on it hung, was killed, or computed far slower than its peers), kept
with the reasons in `run_dir/bad_nodes.json` and left out of the run's next allocation: a requeued job
and `hpc-train submit` of the same run directory exclude them. Only Slurm jobs blame nodes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from hpc_train.bootstrap import node_name

FILE = "bad_nodes.json"
KEEP = 5  # reasons kept per node, the latest


def blame(run_dir: str | Path, node: str, reason: str) -> None:
    """Record that `node` caused a failure of this Slurm job (atomically; no-op outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    path = Path(run_dir) / FILE
    nodes = blamed(run_dir)
    entry = {"reason": reason, "job": job, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    nodes[node] = [*nodes.get(node, []), entry][-KEEP:]
    tmp = path.with_name(f"{FILE}.{node_name()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(nodes, indent=1) + "\n")
    tmp.replace(path)


def blamed(run_dir: str | Path) -> dict[str, list[dict[str, str]]]:
    """The blamed nodes and why, {} when none (or the file is unreadable: it only ever narrows a job)."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return {}


def describe(nodes: dict[str, list[dict[str, str]]]) -> str:
    """'n2 (rank 1 was killed by SIGKILL, job 81)', one entry per node with its latest reason."""
    return ", ".join(f"{node} ({why[-1]['reason']}, job {why[-1]['job']})" for node, why in sorted(nodes.items()))


def exclusion(run_dir: str | Path, needed: int) -> tuple[list[str], str]:
    """The blamed nodes a job needing `needed` nodes can leave out, and the line that says so (or why not):
    only nodes the cluster knows (`sinfo`; all of them where Slurm cannot be asked, as in a dry run
    elsewhere), and none when fewer than `needed` would remain."""
    nodes = blamed(run_dir)
    if not nodes:
        return [], ""
    try:
        listed = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
        known = set(listed.stdout.split()) if listed.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        known = None
    names = sorted(n for n in nodes if known is None or n in known)
    remaining = len(known - set(names)) if known is not None else needed
    if remaining < needed:
        return [], (f"not excluding the node(s) blamed in {run_dir}/{FILE}: {describe(nodes)}; the job needs "
                    f"{needed} node(s) and only {remaining} would remain; edit the file to forgive")  # fmt: skip
    if not names:
        return [], ""
    return names, f"excluding node(s) blamed in {run_dir}/{FILE}: {describe({n: nodes[n] for n in names})}"
