import os

import pytest
import torch

from hpc_train.bootstrap import bound_device, cpu_threads, detect_rank_env, expand_nodelist, slurm_master_port


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[8-11],cpu3", ["gpu8", "gpu9", "gpu10", "gpu11", "cpu3"]),
        ("a[098-101]-ib", ["a098-ib", "a099-ib", "a100-ib", "a101-ib"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("n[1-2],m[5],x", ["n1", "n2", "m5", "x"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


SRUN_ENV = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[03-04,09-10]",
    "SLURM_STEP_NODELIST": "gpu[03-04,09-10]",
    "SLURM_TASKS_PER_NODE": "2(x4)",
}


def test_rank_env_from_slurm():
    env = detect_rank_env(SRUN_ENV)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 2, 1)
    assert env.master_addr == "gpu03" and env.source == "slurm"
    assert env.master_port == slurm_master_port("123456") == 20000 + 123456 % 12000
    assert detect_rank_env({**SRUN_ENV, "MASTER_PORT": "4242"}).master_port == 4242


def test_rank_env_torchrun_batch_script_and_alone():
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "host",
        "MASTER_PORT": "29400",
    }
    env = detect_rank_env({**SRUN_ENV, **torchrun})  # torchrun inside a Slurm job wins
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (3, 4, 1, "host", "torchrun")
    batch_script = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_ID"}
    assert detect_rank_env(batch_script) is None  # the batch shell is not a rank: it launches them
    assert detect_rank_env({}) is None


def _where_and_what(rank_env, out_dir):
    """What a local rank was started from and with: its parent, whether torch was imported before it started
    (it was, by the fork server), the launcher's variable; and a line on its stdout."""
    import os
    import sys

    print(f"rank {rank_env.rank} writes here", flush=True)
    preloaded = "torch.distributed.tensor" in sys.modules and "hpc_train.train.loop" in sys.modules
    (out_dir / f"{rank_env.rank}.txt").write_text(f"{os.getppid()} {preloaded} {os.environ.get('HPC_TRAIN_PROBE')}")


def test_local_ranks_fork_from_one_server_with_the_launchers_environment_and_streams(tmp_path, monkeypatch, capfd):
    """Two launches of 2 ranks: every rank is a fork of the same server (not a child of the launcher, which
    spawn would make it), which had imported the training code; each launch's ranks see the environment
    and write to the stdout the launcher has at that launch, not the server's from its start."""
    import os

    from hpc_train.launch.local import launch_local

    parents = set()
    for launch in ("first", "second"):
        monkeypatch.setenv("HPC_TRAIN_PROBE", launch)
        out = tmp_path / launch
        out.mkdir()
        launch_local(_where_and_what, 2, out)
        for rank in range(2):
            parent, preloaded, seen = (out / f"{rank}.txt").read_text().split()
            parents.add(int(parent))
            assert (preloaded, seen) == ("True", launch)
        assert capfd.readouterr().out.count("writes here") == 2
    assert len(parents) == 1 and os.getpid() not in parents


CUDA_PROBE = """
import torch
asked = []
for name in ("is_available", "device_count", "get_device_capability", "get_device_properties", "_lazy_init",
             "current_device", "init", "set_device"):
    setattr(torch.cuda, name, lambda *a, _name=name, **k: asked.append(_name))
from hpc_train.resilience.restart import RANK_IMPORTS
for module in RANK_IMPORTS:
    __import__(module)
print(asked)
"""


def test_the_fork_servers_imports_ask_nothing_of_cuda():
    """The fork server imports RANK_IMPORTS and its ranks are forks of it: a CUDA query there (a device count,
    a capability) would initialise the driver in the server, and CUDA does not survive a fork. Every torch.cuda
    entry point a module could call on import is replaced by a recorder before the imports."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-c", CUDA_PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_only_nccl_is_bound_to_a_device_and_with_its_index():
    """init_process_group's device_id: an indexed CUDA device for NCCL (torch 2.11 refuses a bare "cuda"),
    none for gloo even with CUDA tensors (a bound gloo group breaks DeviceMesh's split on an H200), none on
    the CPU. (A bare "cuda" under NCCL takes the current device: that needs a GPU.)"""
    assert bound_device(torch.device("cuda", 1), "nccl") == torch.device("cuda", 1)
    assert bound_device(torch.device("cuda", 1), "gloo") is None
    assert bound_device(torch.device("cuda"), "gloo") is None
    assert bound_device(torch.device("cpu"), "gloo") is None


def test_cpu_ranks_share_the_cores_slurm_allocated_unless_omp_num_threads_says():
    """A CPU rank's threads: its node's cores over its ranks; under Slurm no more cores than the job holds on
    the node (task/none leaves every core in the affinity mask); OMP_NUM_THREADS, where set, wins."""
    cores = len(os.sched_getaffinity(0))
    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}  # fmt: skip
    slurm_rank = detect_rank_env(step)
    assert slurm_rank.local_world_size == 2
    assert cpu_threads(slurm_rank, step) == max(1, cores // 2)
    assert cpu_threads(slurm_rank, {**step, "SLURM_CPUS_ON_NODE": "1"}) == 1
    assert cpu_threads(slurm_rank, {**step, "SLURM_CPUS_ON_NODE": str(4 * cores)}) == max(1, cores // 2)
    assert cpu_threads(slurm_rank, {**step, "SLURM_CPUS_ON_NODE": "1", "OMP_NUM_THREADS": "3"}) == 3
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert cpu_threads(detect_rank_env(torchrun), torchrun) == max(1, cores // 2)
    assert cpu_threads(detect_rank_env(torchrun), {**torchrun, "SLURM_CPUS_ON_NODE": "1"}) == 1  # in a job too
