"""The Slurm submit path: config -> submitit executor -> sbatch job with one srun task per rank.

Every task runs `SlurmTask`, which bootstraps its rank from Slurm's environment (launch/bootstrap.py)
and calls the entry point it was given (the CLI gives the train loop's). `executor_for` turns the
config's `slurm` section into submitit's parameters; the CLI checks the whole layout for the job's
world size (`slurm_world_size`) first, so a bad layout is refused before anything reaches the scheduler.
Every config string submitit writes into the sbatch script is checked there too (`check_sbatch_fields`):
a newline in one would end its `#SBATCH` line and run the rest as a shell command.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from hpc_train.config import ConfigError, JobConfig, has_control_chars, to_yaml
from hpc_train.launch.bootstrap import RankEnv, detect_rank_env
from hpc_train.resilience.bad_nodes import exclusion
from hpc_train.resilience.restart import run_task

# Slurm's --time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME_FORMATS = (
    r"(?P<m>\d+)",
    r"(?P<m>\d+):(?P<s>\d+)",
    r"(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)",
)
TIME_PROBLEM = "slurm.time={value!r} is not a Slurm time limit; use MM, HH:MM:SS or D-HH:MM:SS (e.g. 04:00:00)"


def time_limit_seconds(value: str) -> int | None:
    """Slurm time limit -> seconds; None when it is not one of Slurm's formats (or not positive)."""
    for pattern in TIME_FORMATS:
        match = re.fullmatch(pattern, value.strip(), flags=re.ASCII)
        if match:
            parts = {k: int(v) for k, v in match.groupdict().items() if v is not None}
            seconds = ((parts.get("d", 0) * 24 + parts.get("h", 0)) * 60 + parts.get("m", 0)) * 60 + parts.get("s", 0)
            return seconds if seconds > 0 else None
    return None


def time_limit_minutes(value: str) -> int:
    """Slurm time limit -> whole minutes (rounded up), or a ConfigError naming the accepted formats."""
    seconds = time_limit_seconds(value)
    if seconds is None:
        raise ConfigError(TIME_PROBLEM.format(value=value))
    return math.ceil(seconds / 60)


# Slurm sizes: a number with an optional unit (K, M, G, T); 0 asks for all of a node's memory
MEM_PATTERN = re.compile(r"[0-9]+[KMGTkmgt]?")
EXTRA_KEY_PATTERN = re.compile(r"[a-z][a-z0-9-]*")


def directive_problem(key: str, value: str) -> str | None:
    """Directive values are single sbatch words: no control characters, whitespace, quotes or backslashes."""
    if has_control_chars(value) or any(c.isspace() or c in "'\"\\" for c in value):
        return (f"{key}={value!r} must be a single word for its #SBATCH line: remove the newlines, other control "
                f"characters, spaces, quotes and backslashes")  # fmt: skip
    return None


def path_problem(key: str, value: str, in_log_paths: bool) -> str | None:
    """Paths are quoted by submitit, so spaces are fine; a newline is not, nor (in the log folder) Slurm's
    filename patterns: sbatch/srun expand % and drop backslashes, so the logs would land elsewhere."""
    if has_control_chars(value):
        return f"{key}={value!r} contains a newline or another control character; use a plain path"
    if in_log_paths and any(c in "%\\" for c in value):
        return (f"{key}={value!r} holds the Slurm log folder, where sbatch reads '%' as a filename pattern and "
                f"'\\' as an escape; choose a path without them")  # fmt: skip
    return None


def directive_fields(cfg: JobConfig) -> dict[str, str]:
    """The config strings written as #SBATCH values, by the key they come from (slurm.mem has its own check)."""
    s = cfg.slurm
    fields = {"slurm.job_name" if s.job_name else "name": s.job_name or cfg.name}
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key) is not None:
            fields[f"slurm.{key}"] = getattr(s, key)
    fields.update({f"slurm.extra[{key!r}]": str(value) for key, value in s.extra.items()})
    return fields


def check_sbatch_fields(cfg: JobConfig) -> list[str]:
    """One line per config value that would break (or inject into) the sbatch script, naming key and fix."""
    s = cfg.slurm
    problems = [directive_problem(key, value) for key, value in directive_fields(cfg).items()]
    problems += [
        f"slurm.extra key {key!r} is not an sbatch option name; use lowercase letters, digits and '-' (e.g. mail-type)"
        for key in s.extra
        if not EXTRA_KEY_PATTERN.fullmatch(key)
    ]
    if s.mem is not None and not MEM_PATTERN.fullmatch(s.mem):
        problems.append(f"slurm.mem={s.mem!r} is not a Slurm size; use a number with an optional unit K, M, G "
                        f"or T (e.g. 200G, or 0 for all of a node's memory)")  # fmt: skip
    problems.append(path_problem("run_dir", cfg.run_dir, in_log_paths=not s.log_dir))
    if s.log_dir:
        problems.append(path_problem("slurm.log_dir", s.log_dir, in_log_paths=True))
    problems += [
        f"slurm.setup[{i}]={line!r} contains a newline or another control character; give each shell line "
        f"as its own list entry"
        for i, line in enumerate(s.setup)
        if has_control_chars(line)
    ]
    problems += limit_problems(cfg)
    return [p for p in problems if p]


def limit_problems(cfg: JobConfig) -> list[str]:
    """The numbers sbatch would refuse (or that would make the warning signal never come in time)."""
    s = cfg.slurm
    problems = []
    if s.cpus_per_task is not None and s.cpus_per_task <= 0:
        problems.append(f"slurm.cpus_per_task={s.cpus_per_task} must be positive (or unset for Slurm's default)")
    seconds = time_limit_seconds(s.time)
    if seconds is None:
        problems.append(TIME_PROBLEM.format(value=s.time))
    elif not 0 <= s.signal_delay_s < seconds:
        problems.append(f"slurm.signal_delay_s={s.signal_delay_s} must be at least 0 and less than slurm.time "
                        f"({seconds}s): the warning signal comes that long before the end")  # fmt: skip
    return problems


def slurm_world_size(cfg: JobConfig) -> int:
    """The Slurm-only checks, all problems in one ConfigError; returns the world size, nodes x tasks per node."""
    s = cfg.slurm
    problems = []
    if s.gpus_per_node and s.gpus_per_node != s.tasks_per_node:
        problems.append(
            f"slurm.gpus_per_node={s.gpus_per_node} but slurm.tasks_per_node={s.tasks_per_node}: hpc_train runs "
            f"one rank per GPU; set slurm.tasks_per_node={s.gpus_per_node}"
        )
    problems += check_sbatch_fields(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    return s.nodes * s.tasks_per_node


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


def sbatch_script(cfg: JobConfig) -> str:
    """The exact script `submit` hands to sbatch (submitit fills the pickle folder at submission)."""
    executor = executor_for(cfg, ScriptOnlyExecutor)
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def excluded_nodes(cfg: JobConfig) -> str:
    """The line saying which blamed nodes the job leaves out, and why (or why not); '' when none."""
    line = exclusion(cfg.run_dir, cfg.slurm.nodes)[1]
    return f"{line}\n" if line else ""


def dry_run(cfg: JobConfig, layout: str) -> str:
    """The exact job, for a config already checked; `layout` describes the ranks' mesh."""
    excluded = f"# {excluded}" if (excluded := excluded_nodes(cfg)) else ""
    return (
        f"# hpc_train dry run: nothing submitted. {cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} task(s) "
        f"= {cfg.slurm.nodes * cfg.slurm.tasks_per_node} ranks as ({layout})\n{excluded}"
        f"# ---- sbatch script ----\n{sbatch_script(cfg)}\n# ---- resolved config ----\n{to_yaml(cfg)}"
    )


def submit(cfg: JobConfig, entry: Callable[[RankEnv, JobConfig], Any]):
    """Submit a config already checked; every task runs `entry(rank_env, cfg)`."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    return executor_for(cfg).submit(SlurmTask(cfg, entry))


def task_logs(job, task: int) -> tuple[Path, Path]:
    paths = job.task(task).paths
    return paths.stdout, paths.stderr


def failure_report(job, num_tasks: int, lines: int = 12) -> str:
    """The end of the stderr of the first rank whose log holds a Python error (else of rank 0)."""
    chosen = 0
    for task in range(num_tasks):
        err = task_logs(job, task)[1]
        if err.is_file() and "Traceback" in err.read_text(errors="replace"):
            chosen = task
            break
    err = task_logs(job, chosen)[1]
    text = err.read_text(errors="replace").splitlines()[-lines:] if err.is_file() else ["(no stderr log)"]
    return f"rank {chosen} ({err}):\n" + "\n".join(f"  {line}" for line in text)


TERMINAL_STATES = (
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
)  # fmt: skip


def final_state(job) -> str | None:
    """The job's Slurm state from accounting once it has ended, else None (`done()` alone turns true as
    soon as the result files exist, before Slurm has recorded the end)."""
    state = job.get_info(mode="force").get("State", "")
    return state.split()[0] if state.startswith(TERMINAL_STATES) else None


def follow(job, poll_s: float = 1.0, out=sys.stdout) -> str:
    """Stream rank 0's stdout until the job ends; return its final Slurm state."""
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


def submission_summary(cfg: JobConfig, job) -> str:
    stdout, stderr = task_logs(job, 0)
    return excluded_nodes(cfg) + (
        f"submitted job {job.job_id}: {cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} task(s), run dir "
        f"{cfg.run_dir}\n  rank 0 logs: {stdout}\n              {stderr}\n"
        f"  follow: tail -f {shlex.quote(str(stdout))}   |   squeue -j {job.job_id}   |   "
        f"sacct -j {job.job_id}"
    )
