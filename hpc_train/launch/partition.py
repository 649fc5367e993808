"""The cluster's limits, read before a job is submitted: a job that asks a partition for more nodes, time or
GPUs than it has would sit pending forever (sbatch accepts it, squeue says `PartitionNodeLimit`), and an
unknown partition or account makes sbatch fail after the script is written. Each problem is one line that
names the key and the limit. Where Slurm does not answer (a dry run on a laptop) nothing is checked."""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable

from hpc_train.config import ConfigError, JobConfig
from hpc_train.config.checks import time_limit_seconds
from hpc_train.launch.queue import slurm_output


def partitions() -> dict[str, dict[str, str]] | None:
    """Every partition's fields (`scontrol show partition --all`: hidden ones too), by name; None where Slurm
    does not answer."""
    out = slurm_output(["scontrol", "show", "partition", "--all", "-o"])
    if out is None:
        return None
    found = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" in fields:
            found[fields["PartitionName"]] = fields
    return found


def node_gpus(partition: str) -> list[int] | None:
    """The GPUs (gres gpu) of each node of a partition; None where sinfo does not answer."""
    out = slurm_output(["sinfo", "-h", "-N", "-p", partition, "-o", "%G"])
    if out is None:
        return None
    return [sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,()]+)?:(\d+)", gres)) for gres in out.split()]


def user_accounts() -> list[str] | None:
    """The accounts this user may charge (Slurm accounting's associations); None without accounting."""
    out = slurm_output(["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account"])
    return None if out is None else sorted(set(out.split()))


def check_partition(cfg: JobConfig, limits: bool = True) -> None:
    """Raise a ConfigError naming an unknown partition, an account the user cannot charge, and (`limits`)
    every limit of slurm.partition (or the default partition) the job exceeds."""
    s = cfg.slurm
    over = (lambda name, fields: _limits(cfg, name, fields)) if limits else None
    if problems := partition_problems(s.partition, s.account, "slurm.partition", "slurm.account", over):
        raise ConfigError("\n".join(problems))


def partition_problems(
    partition: str | None,
    account: str | None,
    partition_key: str,
    account_key: str,
    limits: Callable[[str, dict[str, str]], list[str]] | None = None,
) -> list[str]:
    """An unknown partition, an account the user cannot charge (each named by the key that gave it), and what
    `limits` finds over each partition's (name, sinfo fields); none where Slurm does not answer."""
    known = partitions()
    problems = []
    if known is not None:  # sbatch takes a list of partitions (the job runs in the first that can start it)
        default = [n for n, f in known.items() if f.get("Default") == "YES"]
        for name in partition.split(",") if partition else default:
            if name not in known:
                problems.append(f"{partition_key}={partition}: no partition {name} on this cluster; use one of "
                                f"{', '.join(sorted(known))} (sinfo lists them)")  # fmt: skip
            elif limits is not None:
                problems += limits(name, known[name])
    accounts = user_accounts() if account else None
    if accounts and account.lower() not in accounts:  # Slurm keeps account names in lower case
        problems.append(f"{account_key}={account}: not an account {getpass.getuser()} may charge; use one of "
                        f"{', '.join(accounts)} (sacctmgr show assoc user=$USER)")  # fmt: skip
    return problems


def _limits(cfg: JobConfig, name: str, fields: dict[str, str]) -> list[str]:
    s, problems = cfg.slurm, []
    nodes = int(fields.get("TotalNodes", "0") or 0)
    max_nodes = fields.get("MaxNodes", "UNLIMITED")
    limit = min(nodes, int(max_nodes)) if max_nodes.isdigit() else nodes
    if nodes and s.nodes > limit:
        what = f"{nodes} nodes" + (f", at most {max_nodes} a job" if max_nodes.isdigit() else "")
        problems.append(f"slurm.nodes={s.nodes} but partition {name} has {what}: the job would wait forever; "
                        f"use slurm.nodes <= {limit} (more slurm.tasks_per_node) or another partition")  # fmt: skip
    max_time = fields.get("MaxTime", "UNLIMITED")
    allowed, asked = time_limit_seconds(max_time), time_limit_seconds(s.time)
    if allowed is not None and asked is not None and asked > allowed:
        problems.append(f"slurm.time={s.time} exceeds partition {name}'s limit of {max_time}; use slurm.time <= "
                        f"{max_time} (the job requeues itself at its time limit and resumes)")  # fmt: skip
    gpus = node_gpus(name) if s.gpus_per_node else None
    if gpus is not None and s.gpus_per_node > max(gpus, default=0):
        most = max(gpus, default=0)
        have, fix = (f"at most {most} GPUs", f"<= {most}") if most else ("no GPUs", "=0 (a CPU job) or a GPU partition")
        problems.append(f"slurm.gpus_per_node={s.gpus_per_node} but partition {name}'s nodes have {have}; use "
                        f"slurm.gpus_per_node{fix}")  # fmt: skip
    return problems
