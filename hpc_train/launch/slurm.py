"""The Slurm submit path: config -> submitit executor -> sbatch job with one srun task per rank.

Every task runs `SlurmTask`, which bootstraps its rank from Slurm's environment (bootstrap.py)
and calls the entry point it was given (the CLI gives the train loop's). `executor_for` turns the
config's `slurm` section into submitit's parameters. The config is checked before (the CLI's `check_job`, the
CLI's one check): the layout for the job's world size (`slurm_world_size`), and every slurm value sbatch
would refuse or that would break the script (config/checks.py), such as a newline in a string, which
would end its `#SBATCH` line and run the rest as a shell command.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import submitit

from hpc_train.bootstrap import RankEnv, detect_rank_env
from hpc_train.config import JobConfig, time_limit_minutes, to_yaml
from hpc_train.launch.queue import run_comment, slurm_output
from hpc_train.resilience.bad_nodes import exclusion
from hpc_train.resilience.restart import FIRST_FAILURE, run_task


def slurm_world_size(cfg: JobConfig) -> int:
    """The job's ranks: nodes x tasks per node (one rank per task, and per GPU: config/checks.py)."""
    return cfg.slurm.nodes * cfg.slurm.tasks_per_node


MB_PER_UNIT = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}  # Slurm's sizes, in its MB (MiB)


def node_memory_mb(cfg: JobConfig) -> tuple[int, str] | None:
    """The memory a node gives the job, in Slurm's MB, and what says so: slurm.mem where the config asks for
    some (0 is all of a node's), else the smallest node of slurm.partition (or of the default partition), as
    sinfo reports it. None where nothing answers (no Slurm on this machine: a dry run on a laptop)."""
    mem = cfg.slurm.mem
    if mem and int(mem.rstrip("KMGTkmgt")):
        unit = mem[-1].upper() if mem[-1].isalpha() else "M"
        return int(int(mem.rstrip("KMGTkmgt")) * MB_PER_UNIT[unit]), f"slurm.mem={mem}"
    out = slurm_output(["sinfo", "-h", "-o", "%P %m", *(["-p", cfg.slurm.partition] if cfg.slurm.partition else [])])
    rows = [line.split() for line in (out or "").splitlines() if len(line.split()) == 2]
    if not cfg.slurm.partition:  # every partition is listed: the job goes to the default one, marked with a '*'
        rows = [row for row in rows if row[0].endswith("*")]
    sizes = [int(m.group()) for _, size in rows if (m := re.match(r"[0-9]+", size))]  # '8000+': nodes differ
    if not sizes:  # no sinfo here, none that answers, or no such partition
        return None
    return min(sizes), f"sinfo, partition {rows[0][0].rstrip('*')}"


def log_folder(cfg: JobConfig) -> Path:
    return Path(cfg.slurm.log_dir or f"{cfg.run_dir}/slurm").absolute()


def executor_parameters(cfg: JobConfig) -> dict[str, Any]:
    s = cfg.slurm
    params: dict[str, Any] = {
        "job_name": s.job_name or cfg.name,
        "nodes": s.nodes,
        "ntasks_per_node": s.tasks_per_node,
        "time": time_limit_minutes(s.time),
        "signal_delay_s": s.signal_delay_s,
        # one failing rank ends the whole step instead of leaving the others blocked in a collective
        "srun_args": ["--kill-on-bad-exit=1"],
        "comment": run_comment(cfg.run_dir),  # launch/queue.py: one job a run, stop and status find it
    }
    optional = {
        "gpus_per_node": s.gpus_per_node or None,
        "cpus_per_task": s.cpus_per_task,
        "mem": s.mem,
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "exclusive": s.exclusive or None,
        "setup": list(s.setup) or None,
        "additional_parameters": dict(s.extra) or None,
        "exclude": ",".join(exclusion(cfg.run_dir, s.nodes)[0]) or None,  # resilience/bad_nodes.py
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


class ScriptOnlyExecutor(submitit.SlurmExecutor):
    """SlurmExecutor for writing the script only (`sbatch_script`): the same text, without submitit's
    srun-on-PATH check, so a dry run works on a machine without Slurm. Never used to submit."""

    @classmethod
    def affinity(cls) -> int:
        return 2


def executor_for(cfg: JobConfig, executor_class: type[submitit.SlurmExecutor] = submitit.SlurmExecutor):
    executor = executor_class(folder=log_folder(cfg), max_num_timeout=cfg.slurm.max_requeues)
    executor.update_parameters(**executor_parameters(cfg))
    return executor


@dataclass
class SlurmTask:
    """What every srun task runs (pickled by submitit): `entry(rank_env, cfg)` as one of the job's ranks."""

    cfg: JobConfig
    entry: Callable[[RankEnv, JobConfig], Any]

    def __call__(self) -> None:
        rank_env = detect_rank_env()
        if rank_env is None:
            raise RuntimeError("SlurmTask runs inside an srun step; no SLURM_PROCID/SLURM_STEP_ID found")
        run_task(self.entry, rank_env, self.cfg)


def sbatch_script(cfg: JobConfig, **parameters: Any) -> str:
    """The exact script `submit` hands to sbatch (submitit fills the pickle folder at submission); `parameters`:
    submitit's, over the config's (a sweep's array)."""
    executor = executor_for(cfg, ScriptOnlyExecutor)
    executor.parameters.update(parameters)
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def excluded_nodes(cfg: JobConfig) -> str:
    """The line saying which blamed nodes the job leaves out, and why (or why not); '' when none."""
    line = exclusion(cfg.run_dir, cfg.slurm.nodes)[1]
    return f"{line}\n" if line else ""


def by_hand_script(cfg: JobConfig, train_args: list[str]) -> str:
    """The job as a script to hand to sbatch yourself: submit's own (its #SBATCH lines, the setup, srun's
    options), with each task running `hpc-train train TRAIN_ARGS` (the config and its overrides) from this
    directory instead of unpickling submitit's call; each rank then bootstraps from srun's environment,
    as submit's do."""
    lines, command = [], shlex.join([sys.executable, "-u", "-m", "hpc_train.cli", "train", *train_args])
    for line in sbatch_script(cfg).splitlines():
        if line == "#SBATCH --wckey=submitit" or line.startswith("export SUBMITIT_"):
            continue
        if line.startswith("srun "):
            line = line.split(f" {shlex.quote(sys.executable)} -u -m submitit.core._submit ")[0] + f" {command}"
        lines.append(line)
    lines.insert(lines.index("# Parameters") + 1, f"#SBATCH --chdir={shlex.quote(str(Path.cwd()))}")
    return "\n".join(lines) + "\n"


def dry_run(cfg: JobConfig, layout: str, train_args: list[str]) -> str:
    """The exact job, for a config already checked; `layout` describes the ranks' mesh; `train_args` (the
    config and its overrides, as given) make the by-hand script's command."""
    excluded = f"# {excluded}" if (excluded := excluded_nodes(cfg)) else ""
    return (
        f"# hpc_train dry run: nothing submitted. {cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} task(s) "
        f"= {cfg.slurm.nodes * cfg.slurm.tasks_per_node} ranks as ({layout})\n{excluded}"
        f"# ---- sbatch script (submit writes submitit's pickle of the job beside it) ----\n{sbatch_script(cfg)}\n"
        f"# ---- the same job by hand: `mkdir -p {shlex.quote(str(log_folder(cfg)))}`, save this part as a file "
        "and `sbatch` it ----\n"
        f"{by_hand_script(cfg, train_args)}"
        f"# ---- resolved config ----\n{to_yaml(cfg)}"
    )


def submit(cfg: JobConfig, entry: Callable[[RankEnv, JobConfig], Any]):
    """Submit a config already checked; every task runs `entry(rank_env, cfg)`."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    return executor_for(cfg).submit(SlurmTask(cfg, entry))


def task_logs(job, task: int) -> tuple[Path, Path]:
    paths = job.task(task).paths
    return paths.stdout, paths.stderr


SUPERVISOR_ERROR = "Submitted job triggered an exception"  # submitit's line before a task's traceback
# srun's line for a task that ended badly, in the batch step's stderr (rank 0's log): `srun: error: n2: task 3:
# Killed`, `... task 1: Exited with exit code 1`; `tasks 0-1: ...`, `tasks 0,2: ...` for several at once
SRUN_TASK_END = re.compile(r"^srun: error: (\S+): tasks? (\d+)[\d,-]*: (.+)$", re.MULTILINE)


def first_failure(texts: list[str]) -> tuple[int, str, bool] | None:
    """The first rank to fail, how (a line) and whether it was supervised, from the ranks' stderr: the line
    every rank's supervisor agreed on where they were supervised (parallel.max_restarts, resilience/
    restart.py), else srun's first report of a task that ended badly (it reports them as their processes
    end: a rank killed outright comes before the peers that fail on the connection it closed, which srun
    then ends). None: no rank failed (a job that failed before its ranks started)."""
    agreed = re.compile(re.escape(FIRST_FAILURE) + r"rank (\d+) on (.*)")
    if match := next(filter(None, map(agreed.search, texts)), None):
        return int(match.group(1)), match.group(0), True
    if match := SRUN_TASK_END.search(texts[0]):
        node, rank, how = match.groups()
        how = "was killed by SIGKILL" if how == "Killed" else how[0].lower() + how[1:]
        return int(rank), f"{FIRST_FAILURE}rank {rank} on {node} {how}", False
    return None


def failure_report(job, num_tasks: int, lines: int = 12) -> str:
    """Which rank failed first, its node and how it ended (`first_failure`), then the end of that rank's
    own stderr (before its supervisor's traceback, where it had one): its Python error, or nothing where it
    was killed outright. Without a failed rank, the first rank whose log holds a Python error, else rank 0."""
    logs = [task_logs(job, task)[1] for task in range(num_tasks)]
    texts = [log.read_text(errors="replace") if log.is_file() else "" for log in logs]
    if (first := first_failure(texts)) is not None:
        chosen, headline, supervised = first
        own = (texts[chosen].split(SUPERVISOR_ERROR)[0] if supervised else texts[chosen]).splitlines()
        own = [line for line in own if not line.startswith(("submitit ", "srun: ", "slurmstepd"))][-lines:]
        own = own or ["(nothing: the process was killed from outside it)"]
        return f"{headline}\nrank {chosen}'s stderr ({logs[chosen]}):\n" + "\n".join(f"  {line}" for line in own)
    chosen = next((task for task, text in enumerate(texts) if "Traceback" in text), 0)
    tail = texts[chosen].splitlines()[-lines:] if logs[chosen].is_file() else ["(no stderr log)"]
    return f"rank {chosen} ({logs[chosen]}):\n" + "\n".join(f"  {line}" for line in tail)


TERMINAL_STATES = (
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
)  # fmt: skip


def final_state(job) -> str | None:
    """The job's Slurm state from accounting once it has ended, else None (`done()` alone turns true as
    soon as the result files exist, before Slurm has recorded the end)."""
    state = job.get_info(mode="force").get("State", "")
    return state.split()[0] if state.startswith(TERMINAL_STATES) else None


def wait_for_jobs(jobs: dict[str, Any], poll_s: float = 1.0) -> dict[str, str]:
    """Each job's final Slurm state, by its name in `jobs`, a line printed as each ends (`NAME (job ID): STATE`):
    a sweep's members, a preparation's parts and merge."""
    states: dict[str, str] = {}
    while len(states) < len(jobs):
        for name, job in jobs.items():
            if name not in states and (state := final_state(job)) is not None:
                states[name] = state
                print(f"{name} (job {job.job_id}): {state}", flush=True)
        if len(states) < len(jobs):
            time.sleep(poll_s)
    return states


def follow(job, poll_s: float = 1.0, out: TextIO | None = None) -> str:
    """Stream rank 0's stdout (to `out`, or sys.stdout as it is at the call) until the job ends; return its
    final Slurm state."""
    out = sys.stdout if out is None else out
    stdout = task_logs(job, 0)[0]
    offset = 0
    while True:
        done = final_state(job)
        if stdout.is_file():
            with open(stdout, errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            if chunk:
                out.write(chunk)
                out.flush()
        if done:
            return done
        time.sleep(poll_s)


def stopped_at(job) -> int | None:
    """The step a job saved and stopped at on a user's stop (train/loop.py's line in rank 0's output), else
    None (it finished, failed, or was requeued)."""
    stdout = task_logs(job, 0)[0]
    text = stdout.read_text(errors="replace") if stdout.is_file() else ""
    steps = re.findall(r"^stopped on request at step (\d+): ", text, re.MULTILINE)
    return int(steps[-1]) if steps else None


def submission_summary(cfg: JobConfig, job) -> str:
    stdout, stderr = task_logs(job, 0)
    return excluded_nodes(cfg) + (
        f"submitted job {job.job_id}: {cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} task(s), run dir "
        f"{cfg.run_dir}\n  rank 0 logs: {stdout}\n              {stderr}\n"
        f"  follow: tail -f {shlex.quote(str(stdout))}   |   squeue -j {job.job_id}   |   "
        f"sacct -j {job.job_id}"
    )
