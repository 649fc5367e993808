"""One command that checks every GPU path and measures it against its reference, made for the short loans of
a GPU (about 15 minutes, start-up included): nine checks, each in a process of its own with its own time
budget, all within 8 minutes on one H100 or H200. It writes gpu_check.json (every check's rows, targets and
status), gpu_check.md (the same as tables) and prints the tables, headed by the device and the torch, CUDA
and torchao versions.

    python tools/gpu_check.py --out OUT              # on a GPU machine, from the repository root
    python tools/gpu_check.py --only ring,moe        # some of the checks
    python tools/gpu_check.py --smoke --out OUT      # every check at tiny shapes on the CPU, in one process

The checks (tools/gpu_checks/<name>.py say what each measures, and how):
  dense          the plain PyTorch loop eager and compiled, hpc_train eager and compiled (gpt_1_3b shape)
  fp8            hpc_train compiled with train.fp8 tensorwise and rowwise against bf16 compiled
  planner        the planner's total against the measured peak, 6 layouts on one GPU
  qlora          configs/llama2_7b_qlora.yaml's step peak against the plan
  ring           context parallelism's per-block attention kernels against SDPA, cp 2 and 4 simulated
  moe            the routed experts' grouped GEMM against the loop, one Qwen3-30B-A3B layer
  zero3_offload  ZeRO-3 with CPU offload against without, one step at dp 2 on one GPU
  activation_offload  model.activation_offload=full against none: loss, step time, peak against the plan
  checkpoint     save and load GB/s of the 1.3B model's training state against the raw disk, async blocking

A check fails when it raises, gives a wrong result (parity) or runs out of its budget; the command then
exits with 1. A target missed (the issue's figures: speed-ups, memory, the planner's 5%) is reported in the
targets table, and does not fail the command. Under --smoke every check runs on the CPU (compile with the
aot_eager backend); what only CUDA can run is reported as `skipped: needs CUDA`. tests/test_gpu_check.py runs
the smoke.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> its budget on one H100, seconds (start-up, CUDA initialization and compiles included); estimates
# until a first run: every check's seconds are in gpu_check.json to size them again
CHECKS = {
    "dense": 125,
    "fp8": 85,
    "planner": 65,
    "qlora": 45,
    "ring": 25,
    "moe": 15,
    "zero3_offload": 35,
    "activation_offload": 40,
    "checkpoint": 75,  # last: a slow disk cannot hold up the others
}
TOTAL_BUDGET = 470  # seconds for the whole command: under 8 minutes whatever the checks take
SMOKE_BUDGET = 240  # the one smoke process's limit (it takes about 90 s on 2 CPU cores)
GRACE_S = 10  # a check past its budget: SIGTERM, then this long before SIGKILL
NO_CUDA = "no CUDA device here: the full checks are for a GPU (--smoke runs every check on the CPU)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="where gpu_check.json, gpu_check.md and checks/ go")
    parser.add_argument("--only", default=None, help=f"comma-separated checks (of: {', '.join(CHECKS)})")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, every check in one process")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="dense and fp8: this micro batch (default: the largest the planner fits)")  # fmt: skip
    parser.add_argument("--scratch", default=None, help="checkpoint: the directory it writes to (default: TMPDIR)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every budget (a slower GPU than an H100); the total too")  # fmt: skip
    parser.add_argument("--plant-crash", default=None, help=argparse.SUPPRESS)  # the suite's: a check that raises
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # checks to run in this process
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)  # where a child writes them
    args = parser.parse_args()
    names = list(CHECKS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(CHECKS)}")
    args.names = names
    return args


# ------------------------------------------------------------------------------------------ in a child process


def run_checks(args: argparse.Namespace) -> int:
    """Run the checks named by --child in this process, one after another, each into its result file; an
    exception fails its check only."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import gc

    import torch

    from tools.gpu_checks.common import Check, Options, PlantedCrash, smoke_stand_ins

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    options = Options(args.micro_batch, args.scratch)
    for name in args.child.split(","):
        print(f"== {name} on {device}", flush=True)
        check = Check(name, args.smoke, Path(args.results) / f"{name}.json", device, options)
        if device.type == "cpu" and not args.smoke:
            check.fail(NO_CUDA)
            check.finish()
            continue
        try:
            module = importlib.import_module(f"tools.gpu_checks.{name}")
            with smoke_stand_ins(args.smoke):
                module.run(check)
            if args.plant_crash == name:
                raise PlantedCrash(f"planted in {name} by --plant-crash")
        except Exception as err:  # noqa: BLE001 - recorded as the check's failure; the next check runs
            traceback.print_exc()
            check.finish(err)
        else:
            check.finish()
        record = check.record
        print(f"== {name}: {record.status} in {record.seconds:.1f} s ({record.cpu_seconds:.1f} s of CPU)", flush=True)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


# --------------------------------------------------------------------------------------------------- driver


def child_command(args: argparse.Namespace, names: list[str], results: Path) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(names), "--results", str(results)]
    for flag, value in (("--micro-batch", args.micro_batch), ("--scratch", args.scratch),
                        ("--plant-crash", args.plant_crash)):  # fmt: skip
        if value is not None:
            command += [flag, str(value)]
    return command + (["--smoke"] if args.smoke else [])


def run_child(command: list[str], label: str, budget: float, smoke: bool) -> tuple[int | None, list[str]]:
    """Run a child process (its own session: a check's own subprocesses die with it), its output shown
    prefixed with `label`; past `budget` seconds it is stopped. Returns (exit code or None if stopped, its
    last lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is the CPU's, even on a GPU machine
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def relay() -> None:
        for line in process.stdout:
            tail.append(line.rstrip())
            sys.stderr.write(f"[{label}] {line}")
            sys.stderr.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        code = None
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    reader.join(timeout=5)
    return code, list(tail)


def settle(name: str, results: Path, code: int | None, tail: list[str], budget: float) -> dict:
    """The check's record as the child left it, its status settled: a check still `running` when its process
    ended was killed by its budget (timeout) or crashed the process (failed)."""
    path = results / f"{name}.json"
    record = json.loads(path.read_text()) if path.exists() else {"name": name, "status": "running", "rows": [],
                                                                   "targets": [], "notes": []}  # fmt: skip
    record["budget_s"] = round(budget, 1)
    if record["status"] == "running":
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        if code is None:
            record.update(status="timeout", reason=f"stopped after its budget of {budget:.0f} s (last: {last[:200]})")
        else:
            record.update(status="failed", reason=f"its process exited with {code} (last: {last[:200]})")
    return record


def drive(args: argparse.Namespace) -> int:
    out = Path(args.out)
    results = out / "checks"
    results.mkdir(parents=True, exist_ok=True)
    for stale in results.glob("*.json"):
        stale.unlink()
    start = time.perf_counter()
    total = SMOKE_BUDGET if args.smoke else TOTAL_BUDGET * args.budget_scale
    groups = [args.names] if args.smoke else [[name] for name in args.names]  # the smoke: one process
    records = []
    for group in groups:
        left = total - (time.perf_counter() - start)
        budget = left if args.smoke else min(CHECKS[group[0]] * args.budget_scale, left)
        if budget < 5:
            records += [{"name": n, "status": "timeout", "reason": "no time left of the command's budget",
                         "budget_s": 0, "rows": [], "targets": [], "notes": []} for n in group]  # fmt: skip
            continue
        if records and records[-1].get("reason") == NO_CUDA:
            records += [{**records[-1], "name": n, "rows": [], "targets": [], "budget_s": 0} for n in group]
            continue
        label = "smoke" if args.smoke else group[0]
        code, tail = run_child(child_command(args, group, results), label, budget, args.smoke)
        records += [settle(name, results, code, tail, budget) for name in group]
    report = {"smoke": args.smoke, "env": next((r["env"] for r in records if r.get("env")), {}),
              "seconds": round(time.perf_counter() - start, 1), "budget_s": total, "checks": records}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    table = markdown(report)
    (out / "gpu_check.md").write_text(table)
    print(table)
    failed = [r["name"] for r in records if r["status"] in ("failed", "timeout")]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    """gpu_check.json as markdown: the device and versions, the checks, every row, the targets."""
    env, checks = report["env"], report["checks"]
    device = env.get("device", "unknown device")
    if "capability" in env:
        device += f" (compute capability {env['capability']}, {env['memory_gib']} GiB)"
    versions = f"torch {env.get('torch')}, CUDA {env.get('cuda')}, torchao {env.get('torchao', 'not installed')}, " \
               f"Python {env.get('python')}"  # fmt: skip
    kind = "smoke (tiny shapes on the CPU)" if report["smoke"] else "full"
    lines = [f"### GPU check, {kind}: {device}", "", versions, "",
             f"{len(checks)} checks in {report['seconds']:.0f} s (budget {report['budget_s']:.0f} s): "
             + ", ".join(f"{sum(r['status'] == s for r in checks)} {s}" for s in ("ok", "failed", "timeout")
                         if any(r["status"] == s for r in checks)), "",
             "| check | status | seconds (budget) | setup | reason |", "|---|---|---|---|---|"]  # fmt: skip
    for r in checks:
        lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', 0):.0f} ({r.get('budget_s', 0):.0f}) | "
                     f"{cell(r.get('setup', ''))} | {cell(r.get('reason') or '')} |")  # fmt: skip
    lines += ["", "| check | row | measured | against the reference | status |", "|---|---|---|---|---|"]
    for r in checks:
        for row in r["rows"]:
            lines.append(f"| {r['name']} | {cell(row['row'])} | {cell(row['measured'])} | {cell(row['versus'])} | "
                         f"{cell(row['status'])} |")  # fmt: skip
    targets = [(r["name"], t) for r in checks for t in r["targets"]]
    if targets:
        lines += ["", "| check | target | value | met |", "|---|---|---|---|"]
        met = {True: "yes", False: "**no**", None: "not measured"}
        lines += [f"| {name} | {cell(t['target'])} | {cell(t['value'])} | {met[t['met']]} |" for name, t in targets]
    notes = [(r["name"], n) for r in checks for n in r.get("notes", [])]
    lines += ["", *(f"- {name}: {note}" for name, note in notes)] if notes else []
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    return run_checks(args) if args.child is not None else drive(args)


if __name__ == "__main__":
    sys.exit(main())
