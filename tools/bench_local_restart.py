"""What an in-job restart costs from node-local checkpoints against the shared checkpoint: the ~86M GPT of
bench_checkpoint (14 layers, d_model 768, AdamW, fp32) at dp2 on this machine, shared checkpoints every 4
steps, with node-local ones every step or none; rank 1 is killed inside step 6 (HPC_TRAIN_FAULT) and
parallel.max_restarts=1 starts both ranks again. Prints, per run: the local saves' and the shared saves'
time (`local_s`, `blocked_s`), the time from the failure to training again (`restart_s`), the training
redone since the checkpoint restored (`redone_s`) and where it came from. On one machine both directories
are on the same disk, and one node keeps no partner copy.

    python tools/bench_local_restart.py [--rounds 2] [--dir /path/on/the/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.n_layers=14", "model.d_model=768", "model.n_heads=6", "model.seq_len=32"]


def restarted_run(root: Path, local: bool) -> dict:
    """One run killed inside step 6 and restarted in place: its figures."""
    shutil.rmtree(root, ignore_errors=True)
    where = [f"checkpoint.local_dir={root / 'local'}", "checkpoint.local_interval=1"] if local else []
    cmd = [sys.executable, "-m", "hpc_train.cli", "train", "configs/tiny.yaml", *MODEL, "train.steps=7",
           "train.micro_batch_size=2", "train.precision=fp32", "parallel.nproc=2", "parallel.max_restarts=1",
           "checkpoint.interval=4", "checkpoint.verify=full", "train.eval_interval=0", "logging.progress=none",
           "train.save_final_model=false", f"run_dir={root / 'run'}", *where]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
                   env={**os.environ, "HPC_TRAIN_TESTING": "1", "HPC_TRAIN_FAULT": "mid_step@6@1"})  # fmt: skip
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    restarted = next(r for r in records if "restart" in r)
    figures = {"local_s": [round(r["local_checkpoint"]["local_s"], 2) for r in records if "local_checkpoint" in r],
               "blocked_s": [round(r["checkpoint"]["blocked_s"], 2) for r in records if "checkpoint" in r],
               "restart_s": restarted["restart"]["restart_s"], "redone_s": restarted["restart"].get("redone_s"),
               "from": f"{restarted['resumed_from']['source']} step {restarted['resumed_from']['step']}"}  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)  # GBs a run
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each kind")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_local_"))
    try:
        for _ in range(args.rounds):
            for local in (True, False):
                print(f"{'local every step' if local else 'shared only':>16}: {restarted_run(root / 'r', local)}",
                      flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
