"""What train.spike_guard's rollback costs, from the in-memory copy against a read from disk: one process,
the ~86M GPT of bench_checkpoint (14 layers, d_model 768, AdamW), a poisoned batch at step 7 (loss and
gradients x 1000, HPC_TRAIN_FAULT), checkpoints every 4 steps. Prints, for each source, the rollback's
time (from the spike's read to the restored state, `rollback_s`) and each save's cost: the sync save's
`blocked_s` and, with the copy, its `memory_copy_s` and bytes.

    python tools/bench_rollback.py [--layers 14 --d-model 768] [--dir /path/on/the/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training


def rollback_run(run_dir: Path, model: list[str], memory_copy: bool) -> dict:
    cfg = load_config(None, [*model, f"run_dir={run_dir}", "train.steps=10", "train.micro_batch_size=2",
                             "checkpoint.interval=4", "logging.log_interval=4", "logging.progress=none",
                             "train.eval_interval=0", "train.save_final_model=false", "train.spike_guard.enabled=true",
                             "train.spike_guard.window=4", f"train.spike_guard.memory_copy={memory_copy}"])  # fmt: skip
    launch_local(run_training, 1, cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (rollback,) = next(r["rollback"] for r in records if "rollback" in r)
    saves = [r["checkpoint"] for r in records if "checkpoint" in r]
    return {"rollback_s": rollback["rollback_s"], "from": rollback["from"],
            "save_s": statistics.median(s["blocked_s"] for s in saves),
            "copy_s": statistics.median(s.get("memory_copy_s", 0.0) for s in saves),
            "copy_gb": saves[0].get("memory_copy_bytes", 0) / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--d-model", type=int, default=768)
    args = parser.parse_args()
    model = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
             f"model.n_heads={max(1, args.d_model // 128)}", "model.seq_len=32"]  # fmt: skip
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_rollback_"))
    os.environ.update(HPC_TRAIN_TESTING="1", HPC_TRAIN_FAULT="batch@7@0@spike")  # faults need the test switch
    try:
        rows = {source: rollback_run(root / source, model, source == "memory") for source in ("memory", "disk")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for source, row in rows.items():
        print(
            f"{source:>6}: rollback {row['rollback_s']:.3f}s (from {row['from']}); a save blocks "
            f"{row['save_s']:.3f}s, of which the copy {row['copy_s']:.3f}s ({row['copy_gb']:.2f} GB)"
        )
    print(f"rollback from memory / from disk: {rows['memory']['rollback_s'] / rows['disk']['rollback_s']:.2f}")


if __name__ == "__main__":
    main()
