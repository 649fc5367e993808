"""optim.offload=nvme: the optimizer state in files on the node's disk, streamed through a bounded ring of host
buffers. At dp 2 it updates exactly as the state in memory does (ZeRO-1 and -2, fp32 and bf16), its host and
device bytes are the planner's, it resumes exactly, and a rank killed after the files were updated (a step
ahead of every checkpoint) restarts in the job on the same curve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessExitedException

from hpc_train.config import ConfigError
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.optim.nvme import padded
from hpc_train.planner import estimate
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, max_param_diff, read_final_model, read_metrics

BUFFER = "optim.offload_buffer_mb=0.05"  # 1024-element chunks: every update streams many of them
BF16_Z2 = ["optim.zero_stage=2", "train.precision=bf16", "train.grad_accum=2", "train.micro_batch_size=2"]
# fp16 from a loss scale its gradients overflow now and then (steps 1 and 3 dropped, decided on the device)
FP16_SKIPS = ["optim.zero_stage=1", "train.precision=fp16", "train.initial_loss_scale=262144",
              "train.micro_batch_size=4"]  # fmt: skip
# one bucket led by a large tied embedding: rank 0 owns none of the matrices, yet joins their gathers
MUON = ["optim.zero_stage=1", "optim.name=muon", "train.micro_batch_size=4", "checkpoint.interval=2",
        "model.tie_embeddings=true", "model.vocab_size=2048", "optim.bucket_mb=100"]  # fmt: skip
ZERO3 = ["optim.zero_stage=3", "train.micro_batch_size=2", "train.grad_accum=2", "checkpoint.interval=2"]
RUNS = {  # name: (overrides, nvme)
    "zero1_fp32": (["optim.zero_stage=1", "train.micro_batch_size=4", "checkpoint.interval=2"], False),
    "zero1_fp32_nvme": (["optim.zero_stage=1", "train.micro_batch_size=4", "checkpoint.interval=2"], True),
    "zero2_bf16": (BF16_Z2, False),
    "zero2_bf16_nvme": (BF16_Z2, True),
    "zero1_fp16": (FP16_SKIPS, False),
    "zero1_fp16_nvme": (FP16_SKIPS, True),
    "zero1_muon": (MUON, False),  # Muon's momentum in the files, its updates orthogonalized whole over dp
    "zero1_muon_nvme": (MUON, True),
    "zero3_muon": ([*ZERO3, "optim.name=muon"], False),
    "zero3_muon_nvme": ([*ZERO3, "optim.name=muon"], True),
    "zero3_fp32": (ZERO3, False),
    "zero3_fp32_nvme": (ZERO3, True),  # FSDP2's shards and their gradients (accumulated there) on the host
}
STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    base = tmp_path_factory.mktemp("nvme")

    def cfg(name: str, *extra: str):
        overrides, nvme = RUNS[name.removesuffix("_resumed").removesuffix("_killed")]
        offload = ["optim.offload=nvme", f"optim.offload_dir={base / name / 'offload'}", BUFFER] if nvme else []
        return load_config(None, [*TINY_MODEL, f"data.train_path={small_corpus}", "parallel.nproc=2",
                                  f"run_dir={base / name}", *overrides, *offload, *extra])  # fmt: skip

    configs = {name: cfg(name, f"train.steps={STEPS}") for name in RUNS}
    # saved at step 2 and resumed to the end, as a new process does: the files are written from the checkpoint
    # (ZeRO-3's saved asynchronously: from a snapshot of its files)
    first = {"zero1_fp32_nvme_resumed": (), "zero3_fp32_nvme_resumed": ("checkpoint.async_save=true",),
             "zero1_muon_nvme_resumed": ()}  # fmt: skip
    for name, extra in first.items():
        configs[name] = cfg(name, "train.steps=2", *extra)
    launch_sequence(run_training, 2, [(c,) for c in configs.values()])
    resumed = {name: cfg(name, f"train.steps={STEPS}") for name in first}
    launch_sequence(run_training, 2, [(c,) for c in resumed.values()])
    killed = {name: cfg(name, f"train.steps={STEPS}", "parallel.max_restarts=1")
              for name in ("zero1_fp32_nvme_killed", "zero3_fp32_nvme_killed")}  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # killed inside step 3's update, the files already written
        env.setenv("HPC_TRAIN_FAULT", "nvme_written@3@0")
        for run in killed.values():
            launch_local(run_training, 2, run, max_restarts=1)
    return {**configs, **resumed, **killed}


def losses(cfg) -> list[float]:
    return [m["loss"] for m in read_metrics(cfg.run_dir)]


@pytest.mark.parametrize(
    "reference", ["zero1_fp32", "zero2_bf16", "zero1_fp16", "zero3_fp32", "zero1_muon", "zero3_muon"]
)
def test_nvme_offload_updates_exactly_as_the_state_in_memory(runs, reference):
    """Same kernel, same elements: the losses and final weights equal the in-memory ZeRO run's, bit for bit;
    in fp16 the steps its loss scale drops change nothing on disk either."""
    nvme = runs[f"{reference}_nvme"]
    assert losses(nvme) == losses(runs[reference]) and len(losses(nvme)) == STEPS
    assert max_param_diff(read_final_model(nvme.run_dir), read_final_model(runs[reference].run_dir)) == 0.0
    skipped = [bool(m.get("skipped")) for m in read_metrics(nvme.run_dir)]
    assert skipped == [bool(m.get("skipped")) for m in read_metrics(runs[reference].run_dir)]
    assert (any(skipped) and not all(skipped)) if "fp16" in reference else losses(nvme)[-1] < losses(nvme)[0]


def test_nvme_under_zero3_keeps_the_shards_on_the_host_and_the_moments_on_disk(runs):
    """FSDP2's shards (the masters) and gradients in host memory with the ring, nothing of the state on the
    device, both moments on disk: each as the planner counts it."""
    cfg = runs["zero3_fp32_nvme"]
    plan = estimate(cfg, check_run(cfg, 2, check_paths=False))
    measured = read_metrics(cfg.run_dir)[0]["memory_bytes"]
    assert measured["host"] == plan.host and measured["disk"] == plan.disk > 0
    in_memory = read_metrics(runs["zero3_fp32"].run_dir)[0]["memory_bytes"]
    assert plan.disk == 2 * 4 * padded(in_memory["optimizer"] // 8)  # two fp32 moments of the shard


def test_nvme_state_lives_in_its_files_and_the_memory_is_the_planners(runs):
    """Host memory is the ring (not the state), the device keeps the owned slice's updated weights, and the
    files hold the masters and both moments of the owned slice: each as the planner counts it."""
    cfg = runs["zero2_bf16_nvme"]
    plan = estimate(cfg, check_run(cfg, 2, check_paths=False))
    measured = read_metrics(cfg.run_dir)[0]["memory_bytes"]
    assert measured["host"] == plan.host > 0
    assert measured["optimizer"] == plan.optimizer
    in_memory = read_metrics(runs["zero2_bf16"].run_dir)[0]["memory_bytes"]
    assert "host" not in in_memory and in_memory["optimizer"] == 6 * plan.optimizer  # fp32 master + 2 moments
    owned = plan.optimizer // 2  # bf16
    assert measured["disk"] == plan.disk == 3 * 4 * padded(owned) and "disk" not in in_memory
    # the files never had a name: nothing is in the directory, during the run or after it
    assert not any(Path(cfg.optim.offload_dir).iterdir())


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_nvme_offload_resumes_exactly_and_after_a_kill_in_the_update(runs, stage):
    """A resume writes the files from the checkpoint; a rank killed after its files took step 3 (the
    checkpoint is step 2's) restarts in the job from step 2 and ends on the uninterrupted curve."""
    whole = runs[f"{stage}_fp32"]
    for name in (f"{stage}_fp32_nvme_resumed", f"{stage}_fp32_nvme_killed"):
        run = runs[name]
        assert losses(run) == losses(whole), name
        assert [m["resumed_from"]["step"] for m in read_metrics(run.run_dir) if "resumed_from" in m] == [2], name
        assert max_param_diff(read_final_model(run.run_dir), read_final_model(whole.run_dir)) == 0, name
    (restart,) = [m["restart"] for m in read_metrics(runs[f"{stage}_fp32_nvme_killed"].run_dir) if "restart" in m]
    assert restart["attempt"] == 1


def test_nvme_files_go_with_a_run_killed_for_good(tmp_path, small_corpus, monkeypatch):
    """Both ranks killed with SIGKILL after step 1's update and not restarted (a node crash, a time limit past
    its grace): nothing of their masters and moments is left under optim.offload_dir, since no finalizer ran."""
    offload = tmp_path / "offload"
    cfg = load_config(None, [*TINY_MODEL, f"data.train_path={small_corpus}", "parallel.nproc=2", "train.steps=2",
                             f"run_dir={tmp_path / 'run'}", "optim.zero_stage=1", "train.micro_batch_size=4",
                             "optim.offload=nvme", f"optim.offload_dir={offload}", BUFFER])  # fmt: skip
    monkeypatch.setenv("HPC_TRAIN_FAULT", "nvme_written@1@0,nvme_written@1@1")
    with pytest.raises(ProcessExitedException):
        launch_local(run_training, 2, cfg)
    assert not list(offload.rglob("*"))


def test_nvme_muon_resumes_exactly(runs):
    """Muon's momentum, kept where AdamW's first moment would be, is saved under its own key and loaded back
    into its place (its second moment's place unused)."""
    run, whole = runs["zero1_muon_nvme_resumed"], runs["zero1_muon"]
    assert losses(run) == losses(whole) and losses(run)[-1] < losses(run)[0]
    assert max_param_diff(read_final_model(run.run_dir), read_final_model(whole.run_dir)) == 0


GUARDED = ["train.spike_guard.enabled=true", "checkpoint.interval=2", "optim.offload_dir=/tmp/x"]
LOCAL = ["checkpoint.local_dir=/tmp/local", "checkpoint.local_interval=1", "parallel.max_restarts=1",
         "checkpoint.interval=2", "optim.offload_dir=/tmp/x"]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (["optim.zero_stage=1"], "optim.offload=nvme needs optim.offload_dir"),
        (["optim.zero_stage=0", "optim.offload_dir=/tmp/x"], "set optim.zero_stage=1"),
        (["optim.zero_stage=1", "optim.name=adamw8bit", "optim.offload_dir=/tmp/x"], "use optim.name=adamw"),
    ],
)
def test_nvme_offload_refuses_what_it_does_not_support(overrides, refusal):
    cfg = load_config(None, [*TINY_MODEL, "optim.offload=nvme", *overrides])
    with pytest.raises(ConfigError, match=refusal.replace(".", r"\.")):
        check_run(cfg, 1, check_paths=False)


@pytest.mark.parametrize(
    "overrides, refusal, fix",
    [
        (GUARDED, "set train.spike_guard.memory_copy=false", ["train.spike_guard.memory_copy=false"]),
        (
            [*GUARDED, "optim.zero_stage=3", "train.spike_guard.memory_copy=true"],
            "spike_guard.memory_copy=false",
            ["train.spike_guard.memory_copy=false"],
        ),
        (
            LOCAL,
            "leave checkpoint.local_dir, checkpoint.local_interval and checkpoint.memory_interval out",
            ["checkpoint.local_dir=null", "checkpoint.local_interval=0"],
        ),
    ],
)
def test_nvme_offload_refuses_a_copy_of_its_state_in_host_memory(overrides, refusal, fix):
    """The spike guard's memory copy (unset, it is kept where it fits) and local checkpoints' (written from
    it) would read the whole offloaded state into host memory: refused, and the fix the error names is
    accepted, as is the copy with cpu offload (the state is in host memory anyway)."""

    def cfg(*extra: str):
        return load_config(None, [*TINY_MODEL, "optim.offload=nvme", "optim.zero_stage=1", *overrides, *extra])

    with pytest.raises(ConfigError, match=refusal.replace(".", r"\.")):
        check_run(cfg(), 1, check_paths=False)
    check_run(cfg(*fix), 1, check_paths=False)
    check_run(cfg("optim.offload=cpu"), 1, check_paths=False)


def test_offload_dir_on_a_network_filesystem_or_an_unset_variable_is_refused(tmp_path, monkeypatch):
    """The mount a path is on, from /proc/mounts' text (a space written \\040); a network filesystem's is
    refused, and so, on the node, is a variable left unexpanded (before the job it is the node's to set)."""
    from hpc_train.optim.nvme import NETWORK_FILESYSTEMS, check_offload_dir, filesystem_of

    mounts = "/dev/vda / ext4 rw 0 0\nserver:/home /mnt/my\\040home nfs4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
    assert filesystem_of("/mnt/my home/offload", mounts) == "nfs4" in NETWORK_FILESYSTEMS
    assert filesystem_of("/mnt/my", mounts) == "ext4" and filesystem_of("/dev/shm/x", mounts) == "tmpfs"
    assert check_offload_dir(str(tmp_path)) == []  # this machine's disk
    monkeypatch.delenv("NVME_TEST_UNSET", raising=False)
    assert check_offload_dir("$NVME_TEST_UNSET/offload") == []
    (problem,) = check_offload_dir("$NVME_TEST_UNSET/offload", on_node=True)
    assert "holds a variable this node does not set" in problem


def test_state_files_stream_in_whole_blocks_and_read_back_any_range(tmp_path):
    """A pass that writes every element, then one that reads and changes them, then ranges read back across
    chunk and block boundaries. The files have no name: a second rank of the same name in the same directory
    has files of its own, and the directory stays empty."""
    import torch

    from hpc_train.optim.nvme import StateFiles

    numel = 5000  # not a whole number of blocks or of chunks (1024-element chunks)
    files = StateFiles(str(tmp_path), "rank00000", ("master", "exp_avg"), numel, 4 * 4 * 3 * 1024, pinned=False)
    values = torch.arange(numel, dtype=torch.float32)

    def fill(chunk):
        chunk.slot["master"].copy_(values[chunk.start : chunk.start + chunk.numel])
        chunk.slot["exp_avg"].fill_(1.0)

    def double(chunk):
        chunk.slot["master"].mul_(2)

    files.stream(fill, read=False)
    files.stream(double, keys=("master",))
    assert files.chunk == 1024 and files.buffer_bytes == 4 * 3 * 4 * 1024  # 4 slots of 2 keys and a gradient
    assert torch.equal(files.read_range("master", 1000, 3000), 2 * values[1000:4000])
    assert torch.equal(files.read_range("master", 4999, 1), 2 * values[4999:])
    assert torch.equal(files.read_range("exp_avg", 0, numel), torch.ones(numel))
    other = StateFiles(str(tmp_path), "rank00000", ("master",), numel, 4 * 4 * 2 * 1024, pinned=False)
    other.stream(lambda chunk: chunk.slot["master"].fill_(-1.0), read=False)
    assert torch.equal(files.read_range("master", 0, numel), 2 * values)
    assert not any(tmp_path.iterdir())
    files.close()
    other.close()


def test_state_files_leave_what_is_in_the_offload_dir_alone(tmp_path):
    """What the directory already holds is not the run's to delete: a symlink where a rank's directory would
    be (to data elsewhere) and a directory of that name with a file in it are left as they are, and the
    files' target is not reached through the symlink."""
    from hpc_train.optim.nvme import StateFiles

    elsewhere, offload = tmp_path / "elsewhere", tmp_path / "offload"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("kept")
    (offload / "rank00001").mkdir(parents=True)
    (offload / "rank00001" / "notes").write_text("kept")
    (offload / "rank00000").symlink_to(elsewhere)
    for name in ("rank00000", "rank00001"):
        StateFiles(str(offload), name, ("master",), 5000, 4 * 4 * 2 * 1024, pinned=False).close()
    assert (elsewhere / "precious").read_text() == (offload / "rank00001" / "notes").read_text() == "kept"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]
    assert sorted(str(p.relative_to(offload)) for p in offload.rglob("*")) == [
        "rank00000", "rank00001", "rank00001/notes"]  # fmt: skip


def test_state_files_are_opened_with_o_direct_where_the_filesystem_takes_it(tmp_path):
    """On a filesystem that takes O_DIRECT (ext4, xfs, btrfs), every state file is open with it, as the
    kernel reports the descriptor's flags: not whatever the probe concluded."""
    from hpc_train.optim.nvme import StateFiles, filesystem_of

    if filesystem_of(tmp_path) not in {"ext4", "xfs", "btrfs"}:
        pytest.skip(f"the test's directory is on {filesystem_of(tmp_path) or 'an unknown filesystem'}")
    files = StateFiles(str(tmp_path), "rank00000", ("master", "exp_avg"), 5000, 4 * 4 * 3 * 1024, pinned=False)
    for fd in files.fds.values():
        (flags,) = [line.split()[1] for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                    if line.startswith("flags:")]  # fmt: skip
        assert int(flags, 8) & os.O_DIRECT, flags
    assert files.direct  # what the start-up line reports
    files.close()


def test_a_save_writes_the_state_from_its_files_and_an_async_one_from_a_snapshot(tmp_path):
    """A region of a state file reads back the elements it names, a piece at a time, as DCP's plan describes
    them; a snapshot (an async save's) keeps the values it was taken with after the files change, and leaves
    no file behind: like the state files, it has no name."""
    import torch

    from hpc_train.optim.nvme import Scratch, StateFiles, snapshot

    numel, shape = 5000, (30, 100)  # a 30 x 100 tensor's elements from element 1000, across chunks and blocks
    files = StateFiles(str(tmp_path), "rank00000", ("exp_avg",), numel, 4 * 4 * 2 * 1024, pinned=False)
    values = torch.arange(numel, dtype=torch.float32)

    def write(scale):
        def fill(chunk):
            chunk.slot["exp_avg"].copy_(scale * values[chunk.start : chunk.start + chunk.numel])

        files.stream(fill, read=False)

    write(1.0)
    live = files.region("exp_avg", 1000, torch.empty(shape))
    (item,) = live.__create_write_items__("w.exp_avg", live)
    assert tuple(item.tensor_data.chunk.sizes) == shape and live.nbytes == 12000
    assert torch.equal(live.read(), values[1000:4000].view(shape))
    assert b"".join(bytes(p) for p in live.pieces(bytearray(4096 * 3 + 4))) == live.read().numpy().tobytes()
    taken = snapshot({"w.exp_avg": live, "other": 1})
    scratch = Scratch(files.dir).append(values[:7], torch.empty(7))
    write(2.0)  # the next update
    assert torch.equal(live.read(), 2 * values[1000:4000].view(shape))
    assert taken["w.exp_avg"].stable and taken["other"] == 1
    assert torch.equal(taken["w.exp_avg"].read(), values[1000:4000].view(shape))
    assert torch.equal(scratch.read(), values[:7])
    assert os.listdir(files.dir) == []
    files.close()
    with pytest.raises(OSError, match="let go"):  # not whatever file took its descriptor's number
        live.read()
    assert torch.equal(taken["w.exp_avg"].read(), values[1000:4000].view(shape))  # the snapshot outlives them


def _async_save_and_in_place_resume_checks(rank_env, cfg, other_stage):
    """One rank, ZeRO-1 or -3: the start-up line prices an update's disk traffic at the measured speed; an
    async save whose write waits until the next update changed the files still commits the state of its step
    (it writes from a snapshot), and a resume reads it straight into the files' mapped pages, no template of
    its own (the vocabulary's too, its padding rows left out); a state copy reads it into memory, and restores
    it through the ring (Muon's momentum back into its place). A resume at
    the other ZeRO stage (`other_stage`) keeps the moments it loaded into the files, and ZeRO-1's masters,
    which ZeRO-3 does not save, are filled in from the loaded weights through the ring (a pass that reads the
    chunks first)."""
    import torch

    from hpc_train.bootstrap import distributed
    from hpc_train.builder import build_run
    from hpc_train.train.step import StepOptions, train_step

    cpu = torch.device("cpu")
    with distributed(rank_env, cpu, "gloo", 120):
        run = build_run(cfg, rank_env, cpu)
        moved = run.optimizer.disk_bytes() * (4 / 3 if cfg.optim.name == "muon" and cfg.optim.zero_stage < 3 else 1)
        disk_s = 2 * moved / 1e9 / run.optimizer.write_gbps  # the start-up line's step cost (Muon: masters again)
        assert f"an update reads and writes it, {disk_s:.2f} s a step at that speed" in run.optimizer.describe()
        batch = lambda: [run.train_set.batch(run.sampler.next_micro_batches()[0])]  # noqa: E731
        train_step(run.model, run.optimizer, batch(), 1e-3)
        at_save = [{key: region.read() for key, region in state.items()} for state in run.optimizer.param_states()]
        run.checkpointer.save(1)
        train_step(run.model, run.optimizer, batch(), 1e-3, StepOptions(before_update=run.checkpointer.staged))
        changed = [{key: region.read() for key, region in state.items()} for state in run.optimizer.param_states()]
        assert all(any(not torch.equal(a[k], b[k]) for k in a if k != "master")
                   for a, b in zip(at_save, changed, strict=True))  # fmt: skip
        run.checkpointer.wait()
        run.optimizer.close()

        fresh = build_run(cfg, rank_env, cpu)
        part, optimizer, given, loaded_into = fresh.checkpointer.sharded["optim"], fresh.optimizer, [], []
        targets, template = optimizer.load_targets, part.template
        optimizer.load_targets = lambda: given.append(targets()) or given[-1]
        part.template = lambda stored: loaded_into.append(template(stored)) or loaded_into[-1]
        assert fresh.checkpointer.resume().step == 1
        into = {f"{name}.{key}": t for name, ts in zip(part.names, given[0], strict=True) for key, t in ts.items()}
        assert len(loaded_into[0]) == len(into) > 4 and all(loaded_into[0][k].values is t for k, t in into.items())
        copy = optimizer.local_states()  # a state copy's (the spike guard's): read into host memory, flat
        assert all(torch.equal(c[k], a[k].view(-1)) for c, a in zip(copy, at_save, strict=True) for k in a)
        loaded = [{key: region.read() for key, region in state.items()} for state in optimizer.param_states()]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(at_save, loaded, strict=True) for k in a)
        train_step(fresh.model, optimizer, [fresh.train_set.batch(fresh.sampler.next_micro_batches()[0])], 1e-3)
        optimizer.load_param_states(copy, 1)  # the copy restored (train.spike_guard's rollback): through the ring
        restored = [{key: region.read() for key, region in state.items()} for state in optimizer.param_states()]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(at_save, restored, strict=True) for k in a)
        optimizer.close()

        other = build_run(other_stage, rank_env, cpu)  # resharded: ZeRO-1's masters are not in ZeRO-3's checkpoint
        assert other.checkpointer.resume().step == 1
        for state, saved, p in zip(other.optimizer.local_states(), at_save, other.optimizer.params, strict=True):
            assert all(torch.equal(state[k], saved[k].view(-1)) for k in saved if k != "master")
            assert "master" not in state or torch.equal(state["master"], p.detach().view(-1))  # the loaded weights
        other.optimizer.close()


@pytest.mark.parametrize("stage, rule, other", [(1, "adamw", 3), (3, "adamw", 1), (2, "muon", 3), (3, "muon", 2)])
def test_nvme_async_save_writes_its_step_and_a_resume_loads_into_the_files(stage, rule, other, tmp_path,
                                                                          small_corpus, monkeypatch):  # fmt: skip
    def cfg(*extra: str):
        return load_config(None, [*TINY_MODEL, f"data.train_path={small_corpus}", "parallel.nproc=1",
                                  f"run_dir={tmp_path}", f"optim.zero_stage={stage}", "optim.offload=nvme",
                                  f"optim.name={rule}", f"optim.offload_dir={tmp_path / 'o'}", BUFFER,
                                  "checkpoint.async_save=true", *extra])  # fmt: skip

    monkeypatch.setenv("HPC_TRAIN_FAULT", "staged@1@0@slow")  # the write waits SLOW_S: the next update goes first
    launch_local(_async_save_and_in_place_resume_checks, 1, cfg(), cfg(f"optim.zero_stage={other}"))


BIG = ["model.d_model=1024", "model.n_layers=5", "model.n_heads=8", "train.micro_batch_size=1"]  # 64M params
FROZEN = "train.freeze=['layers.*','tok_embeddings.weight','output.weight']"  # the weights, next to no state


@pytest.fixture(scope="module")
def big_runs(tmp_path_factory, small_corpus):
    """One rank, ZeRO-1, fp32, a 64M-parameter model (AdamW state: 0.77 GB, 1.02 GB with cpu offload's
    gradient copy), 2 steps: its weights alone (all but the final norm frozen) and nvme, each step saved, and
    cpu offload."""
    base = tmp_path_factory.mktemp("nvme_rss")
    common = [*TINY_MODEL, *BIG, f"data.train_path={small_corpus}", "train.steps=2", "parallel.nproc=1",
              "optim.zero_stage=1", "train.save_final_model=false", "checkpoint.async_save=false"]  # fmt: skip
    runs = {  # the weights' run and nvme's saved at each step (cpu offload exceeds the bound without a save)
        "weights": [FROZEN, "checkpoint.interval=1"],
        "nvme": [
            "optim.offload=nvme",
            f"optim.offload_dir={base / 'offload'}",
            "optim.offload_buffer_mb=64",
            "checkpoint.interval=1",
        ],  # fmt: skip
        "cpu": ["optim.offload=cpu"],
    }
    configs = {name: load_config(None, [*common, f"run_dir={base / name}", *extra]) for name, extra in runs.items()}
    # and at dp 1 for the update in place: the tiny model with and without nvme, saved and consolidated
    tiny = [*TINY_MODEL, f"data.train_path={small_corpus}", "train.steps=3", "parallel.nproc=1", "optim.zero_stage=1"]
    nvme = ["optim.offload=nvme", BUFFER]
    for name, extra in (
        ("dp1", []),
        ("dp1_nvme", [*nvme, f"optim.offload_dir={base / 'o1'}"]),
        ("dp1_zero3_nvme", [*nvme, f"optim.offload_dir={base / 'o3'}", "optim.zero_stage=3"]),
        ("dp1_zero3_cpu", ["optim.offload=cpu", "optim.zero_stage=3"]),
    ):
        configs[name] = load_config(None, [*tiny, f"run_dir={base / name}", *extra])
    launch_sequence(run_training, 1, [(c,) for c in configs.values()])
    return {name: (c, read_metrics(c.run_dir)) for name, c in configs.items()}


@pytest.mark.parametrize("name", ["dp1_nvme", "dp1_zero3_nvme", "dp1_zero3_cpu"])
def test_nvme_offload_at_dp_1_updates_exactly(big_runs, name):
    """One rank: ZeRO-1's spans are whole parameters, updated in place from the ring; ZeRO-3 (FSDP2 over one
    rank, its shards on the host: the one-GPU case) updates them there. Both as the state in memory."""
    (plain, plain_metrics), (nvme, nvme_metrics) = big_runs["dp1"], big_runs[name]
    assert [m["loss"] for m in nvme_metrics] == [m["loss"] for m in plain_metrics]
    assert max_param_diff(read_final_model(nvme.run_dir), read_final_model(plain.run_dir)) == 0.0


def test_nvme_offload_keeps_host_memory_at_the_model_and_its_buffers(big_runs):
    """Peak RSS (metrics' host_memory_gb, step 2's after step 1's save) of the nvme run stays within the
    model's own run (its weights, saved too) plus 130% of what the nvme run holds besides: gradients, the
    updated weights, the ring, activations, and the save's one buffer (it writes the state from its files,
    never read whole into memory). The same bound fails with optim.offload=cpu, whose state is in host memory."""
    from hpc_train.checkpoint.dcp_io import REGION_PIECE

    held = big_runs["nvme"][1][0]["memory_bytes"]
    beside = held["grads"] + held["optimizer"] + held["host"] + held["activations_peak"] + REGION_PIECE
    bound = max(m["host_memory_gb"] for m in big_runs["weights"][1]) * 1e9 + 1.3 * beside
    peak = {name: max(m["host_memory_gb"] for m in big_runs[name][1]) * 1e9 for name in ("nvme", "cpu")}
    assert held["host"] <= 64 * 2**20 and held["optimizer"] == 0  # the ring; at dp 1 the update writes in place
    assert peak["nvme"] <= bound, (peak, bound)
    assert peak["cpu"] > bound + 0.5e9, (peak, bound)  # its 1.02 GB of state and gradient copy


def test_plan_search_offers_nvme_where_cpu_offload_does_not_fit_the_host():
    """With --host-mem below what cpu offload keeps in host memory, its rows do not fit and the same layout
    with nvme offload does (its ring and, on disk, the state); without a limit cpu offload is the faster."""
    from hpc_train.planner import search

    cfg = load_config(None, [*TINY_MODEL, "model.d_model=256", "model.n_layers=4", "parallel.nproc=2", BUFFER])
    layout = ("tp", "pp", "vp", "schedule", "mbs", "recompute", "zero", "cp")

    def rows(host_mem):
        found = {}
        for row in search(cfg, 2, 2**40, 1e12, host_mem):
            if row["zero"] < 3:  # ZeRO-3's shards and gradients are in host memory either way
                found.setdefault(tuple(row[k] for k in layout), {})[row["offload"]] = row
        return {key: by for key, by in found.items() if {"cpu", "nvme"} <= by.keys()}

    unbounded = rows(None)
    assert unbounded and all(by["cpu"]["step_s"] < by["nvme"]["step_s"] for by in unbounded.values())
    cpu_host = min(by["cpu"]["host_gib"] for by in unbounded.values()) * 2**30 * 2  # the node's 2 ranks
    bounded = rows(cpu_host / 2)
    assert bounded and all(not by["cpu"]["fits"] and by["nvme"]["fits"] and by["nvme"]["disk_gib"] > 0
                           for by in bounded.values())  # fmt: skip


def test_zero3_at_dp_1_runs_with_an_offload_only():
    """ZeRO-3 over one rank shards nothing: refused as it was, unless its shards are offloaded (one GPU)."""
    with pytest.raises(ConfigError, match="optim.offload=cpu or nvme"):
        check_run(load_config(None, [*TINY_MODEL, "optim.zero_stage=3"]), 1, check_paths=False)
    check_run(load_config(None, [*TINY_MODEL, "optim.zero_stage=3", "optim.offload=cpu"]), 1, check_paths=False)
