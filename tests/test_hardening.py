"""Bad input through the real CLI, in-process: every row exits with code 2 and one `hpc-train: error:` line
per problem naming it (no traceback), before any process starts; legitimate rows succeed. Files that would
be unpickled are planted with payloads and must be refused, not run."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from hpc_train.checkpoint.ownership import DirectoryLock
from hpc_train.checkpoint.safe_load import CheckpointError, load_rank_file, read_dcp_metadata
from hpc_train.cli import main
from hpc_train.data.indexed import MAGIC, IndexedDatasetWriter
from hpc_train.observe.metrics import MetricsLog
from tests.conftest import ROOT

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, small_corpus):
    """Bad files of every kind the CLI reads, in one directory: {name: path}."""
    d = tmp_path_factory.mktemp("bad_inputs")
    files = {"corpus": small_corpus}
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "broken.yaml").write_text("train:\n  steps: [1\n")
    (d / "section.yaml").write_text("model: 5\n")
    (d / "newline.yaml").write_text('run_dir: "runs/a\\ntouch x"\n')
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    (d / "binary.txt").write_bytes(b"text\x00\x01\x02")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "ok.txt").write_text("hello world\n")
    for name in ("bad_magic", "truncated", "big_ids", "bad_header", "big_vocab"):
        writer = IndexedDatasetWriter(d / name, 65536 if name == "big_vocab" else 257, "byte")
        writer.add_document(np.arange(200))
        writer.close()
        files[name] = str(d / name)
    (d / "bad_magic.idx").write_bytes(b"NOTMAGIC" + (d / "bad_magic.idx").read_bytes()[len(MAGIC) :])
    with open(d / "truncated.bin", "r+b") as f:
        f.truncate(101)
    (np.arange(200, dtype=np.uint16) + 100).tofile(d / "big_ids.bin")  # ids up to 299 under a 257 header
    header = b"{not json" + b" " * 10
    (d / "bad_header.idx").write_bytes(MAGIC + struct.pack("<Q", len(header)) + header)
    names = (
        "list.yaml",
        "newline.yaml",
        "broken.yaml",
        "section.yaml",
        "binary.yaml",
        "binary.txt",
        "latin1.txt",
        "empty.txt",
        "ok.txt",
    )
    files.update({n.replace(".", "_"): str(d / n) for n in names})
    files["dir"] = str(d)
    return files


# (argv after the command, expected text); {name} is filled from the `inputs` fixture
SHOW_BAD = [
    ("train.steps=0", "train.steps=0 must be > 0"),
    ("train.steps=-1", "train.steps=-1 must be > 0"),
    ("train.steps=abc", "expected int"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0 must be > 0"),
    ("train.grad_accum=0", "train.grad_accum=0 must be > 0"),
    ("train.precision=fp8", "train.precision='fp8' is not one of"),
    ("train.device=tpu", "train.device='tpu' is not one of"),
    ("train.eval_batches=0", "train.eval_batches=0 must be > 0"),
    ("train.eval_interval=-1", "train.eval_interval=-1 must be >= 0"),
    ("train.initial_loss_scale=0", "train.initial_loss_scale=0.0 must be > 0"),
    ("train.initial_loss_scale=inf", "train.initial_loss_scale=inf must be a finite number"),
    ("train.loss_scale_window=0", "train.loss_scale_window=0 must be > 0"),
    ("train.skip_nonfinite=-1", "train.skip_nonfinite=-1 must be >= 0"),
    ("train.global_batch_size=0", "train.global_batch_size=0 must be > 0"),
    ("train.global_batch_size=7", "train.global_batch_size=7 != micro_batch_size"),
    ("train.freeze=abc", "config key 'train.freeze' (from command line) got 'abc'"),
    ("train.freeze=[nope.*]", "train.freeze pattern 'nope.*' matches no parameter"),
    (["train.freeze=['*']"], "train.freeze holds every parameter fixed"),
    (["train.freeze=[*]"], "override 'train.freeze=[*]' is not valid YAML"),
    ("train.seed=x", "expected int"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=-1", "optim.lr=-1.0 must be >= 0"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number"),
    ("optim.min_lr=1.0", "optim.min_lr=1.0 is larger than optim.lr"),
    ("optim.min_lr=-1", "optim.min_lr=-1.0 must be >= 0"),
    ("optim.beta1=1.0", "optim.beta1=1.0 must be in [0, 1)"),
    ("optim.beta2=-0.1", "optim.beta2=-0.1 must be in [0, 1)"),
    ("optim.beta1=nan", "optim.beta1=nan must be a finite number"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("optim.eps=-1e-8", "optim.eps=-1e-08 must be > 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1.0 must be >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
    ("optim.decay_steps=-3", "optim.decay_steps=-3 must be > 0 (or left out)"),
    ("optim.decay_steps=0", "optim.decay_steps=0 must be > 0 (or left out)"),
    ("optim.zero_stage=4", "optim.zero_stage=4 is not supported"),
    ("optim.offload=gpu", "optim.offload='gpu' is not one of"),
    ("optim.bucket_mb=-1", "optim.bucket_mb=-1.0 must be >= 0"),
    ("model.n_layers=0", "model.n_layers=0 must be > 0"),
    ("model.n_heads=0", "model.n_heads=0 must be > 0"),
    ("model.d_model=0", "model.d_model=0 must be > 0"),
    ("model.d_model=100 model.n_heads=3", "model.d_model=100 is not divisible by model.n_heads=3"),
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be > 0 (or left out)"),
    ("model.n_kv_heads=-2", "model.n_kv_heads=-2 must be > 0 (or left out)"),
    ("model.n_kv_heads=3", "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    ("model.norm_eps=-1", "model.norm_eps=-1.0 must be > 0"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be > 0"),
    ("model.init_std=0", "model.init_std=0.0 must be > 0"),
    ("model.init_std=nan", "model.init_std=nan must be a finite number"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be > 0"),
    ("model.vocab_size=0", "model.vocab_size=0 must be > 0"),
    ("model.seq_len=0", "model.seq_len=0 must be > 0"),
    ("model.ffn_hidden=0", "model.ffn_hidden=0 must be > 0 (or left out)"),
    ("model.recompute=always", "model.recompute='always' is not one of"),
    ("model.recompute_every=0", "model.recompute_every=0 must be > 0"),
    ("model.recompute_first=-1", "model.recompute_first=-1 must be >= 0 (or left out)"),
    ("model.arch=gpt3", "model.arch='gpt3' is not one of llama, gpt2"),
    ("model.vocab_multiple=0", "model.vocab_multiple=0 must be > 0"),
    ("model.tie_embeddings=maybe", "config key 'model.tie_embeddings'"),
    ("parallel.tp=0", "parallel.tp=0 must be > 0"),
    ("parallel.pp=0", "parallel.pp=0 must be > 0"),
    ("parallel.tp=3", "world size 2 is not divisible by tp x pp x cp = 3 x 1 x 1"),
    ("parallel.dp=4", "parallel.dp=4 but world size 2"),
    ("parallel.schedule=gpipe", "parallel.schedule='gpipe' is not one of"),
    ("parallel.backend=mpi", "parallel.backend='mpi' is not one of"),
    ("parallel.virtual_stages=0", "parallel.virtual_stages=0 must be > 0"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0 must be > 0"),
    ("parallel.nproc=0", "parallel.nproc=0 must be > 0"),
    ("parallel.pp=2", "train.grad_accum=1 gives 1 micro-batches"),
    ("checkpoint.interval=-1", "checkpoint.interval=-1 must be >= 0"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0"),
    ("checkpoint.keep_every=-1", "checkpoint.keep_every=-1 must be >= 0"),
    ("checkpoint.verify=none", "checkpoint.verify='none' is not one of"),
    ("checkpoint.async_save=sometimes", "checkpoint.async_save='sometimes' is not one of auto, true, false"),
    ("logging.log_interval=0", "logging.log_interval=0 must be > 0"),
    ("logging.progress=fancy", "logging.progress='fancy' is not one of"),
    (
        "parallel.max_restarts=2",
        "parallel.max_restarts=2 restarts the ranks from the newest checkpoint: set checkpoint.interval",
    ),
    ("parallel.max_restarts=-1", "parallel.max_restarts=-1 must be >= 0"),
    ("parallel.hang_timeout_s=-5", "parallel.hang_timeout_s=-5 must be >= 0"),
    ("parallel.rendezvous_timeout_s=0", "parallel.rendezvous_timeout_s=0 must be > 0"),
    ("logging.straggler_threshold=-0.5", "logging.straggler_threshold=-0.5 must be >= 0"),
    ("logging.profile_steps=[5]", "logging.profile_steps=[5] must be [first, last]"),
    ("logging.profile_steps=[5,2]", "logging.profile_steps=[5, 2] must be [first, last]"),
    ("logging.profile_steps=[1,3] logging.measure_peak_step=2", "logging.measure_peak_step=2 profiles a step inside"),
    ("name='a b'", "name='a b' may hold only"),
    ("name=a/b", "name='a/b' may hold only"),
    ("train.step=5", "did you mean 'train.steps'"),
    ("trian.steps=5", "unknown config key 'trian'"),
    ("model=5", "config section 'model' (from command line) must be a mapping"),
    ("steps", "override 'steps' is not of the form key=value"),
    ("=5", "override '=5' is not of the form key=value"),
    ("slurm.gpu_mem_gb=0", "slurm.gpu_mem_gb=0.0 must be > 0"),
    ("slurm.nodes=0", "slurm.nodes=0 must be > 0"),
    ("slurm.max_requeues=-1", "slurm.max_requeues=-1 must be >= 0"),
    ("optim.lr=nan optim.beta1=2 model.norm_eps=-1", "model.norm_eps=-1.0 must be > 0"),  # all reported at once
]
FILE_BAD = [
    (["config", "show", "nope.yaml"], "config file 'nope.yaml' does not exist"),
    (["config", "show", "{list_yaml}"], "must hold a mapping of sections, not a list"),
    (["config", "show", "{broken_yaml}"], "is not valid YAML at line 3"),
    (["config", "show", "{section_yaml}"], "config section 'model'"),
    (["config", "show", "{binary_yaml}"], "config file"),
    (["config", "show", "{newline_yaml}"], "run_dir='runs/a\\ntouch x' holds a control character (a newline?)"),
    (["plan", TINY, "--world", "-3"], "--world -3 must be a positive number"),
    (["plan", TINY, "--world", "0"], "--world 0 must be a positive number"),
    (["plan", TINY, "--gpu-mem", "-1"], "--gpu-mem -1.0 must be a positive number"),
    (["plan", TINY, "--peak-tflops", "0"], "--peak-tflops 0.0 must be a positive number"),
    (["plan", TINY, "--world", "4", "parallel.tp=3"], "world size 4 is not divisible by tp x pp x cp = 3 x 1 x 1"),
    (["plan", TINY, "--search", "optim.lr=nan"], "optim.lr=nan must be a finite number"),
    (["train", TINY, "train.device=cuda"], "train.device=cuda but this machine has no CUDA device"),
    (["train", TINY, "parallel.nproc=500"], "parallel.nproc=500 local processes exceed 4 per CPU core"),
    (["train", TINY, "data.train_path=/nonexistent/x"], "'/nonexistent/x.bin' does not exist"),
    (["train", TINY, "data.valid_path=/nonexistent/v"], "data.valid_path='/nonexistent/v'"),
    (["train", TINY, "data.train_path={bad_magic}"], "is not an hpc_train index (bad magic)"),
    (["train", TINY, "data.train_path={truncated}"], "not a whole number of uint16 tokens"),
    (["train", TINY, "data.train_path={big_ids}"], "holds token id 299, beyond the vocabulary of 257"),
    (["train", TINY, "data.train_path={bad_header}"], "has a damaged header"),
    (["train", TINY, "data.train_path={big_vocab}"], "has vocabulary size 65536 but model.vocab_size=257"),
    (["train", TINY, "optim.lr=-1", "data.train_path={corpus}"], "optim.lr=-1.0 must be >= 0"),
    (["prepare-data", "{binary_txt}", "--output", "{dir}/out1"], "is binary (it holds NUL bytes)"),
    (["prepare-data", "{latin1_txt}", "--output", "{dir}/out2"], "is not UTF-8 text (byte 3)"),
    (["prepare-data", "{empty_txt}", "--output", "{dir}/out3"], "hold no text"),
    (["prepare-data", "{dir}/*.nothing", "--output", "{dir}/out4"], "matches no file"),
    (["prepare-data", "{ok_txt}", "--output", "{dir}/out5", "--valid-every", "5"], "holds out none"),
    (["prepare-data", "{ok_txt}", "--output", "{dir}/out6", "--valid-every", "-1"], "holds out none"),
    (["ckpt", "list", "/nonexistent/run"], "no checkpoints under /nonexistent/run"),
    (["ckpt", "inspect", "{dir}"], "no checkpoints under"),
    (["submit", TINY, "slurm.time=2h", "--dry-run"], "slurm.time='2h' is not a Slurm time limit"),
    (["submit", TINY, "slurm.gpus_per_node=4", "--dry-run"], "slurm.gpus_per_node=4 but slurm.tasks_per_node=1"),
    (["submit", TINY, "data.train_path={big_ids}", "--dry-run"], "holds token id 299"),
]
GOOD = [
    ["config", "show", TINY, "optim.lr=1e-3"],
    ["plan", TINY, "--search", "parallel.tp=2"],  # an override after a flag
    ["plan", TINY, "--world", "4", "--json"],
    ["submit", TINY, "--dry-run", "slurm.nodes=2"],
    ["prepare-data", "{ok_txt}", "--output", "{dir}/good"],
]


def _fill(argv: list[str], inputs: dict[str, str]) -> list[str]:
    return [a.format(**inputs) if "{" in a else a for a in argv]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    return code, capsys.readouterr().err


TABLE = [
    (["config", "show", TINY, *(overrides if isinstance(overrides, list) else shlex.split(overrides))], expected)
    for overrides, expected in SHOW_BAD
] + FILE_BAD


@pytest.mark.parametrize("argv, expected", TABLE, ids=[" ".join(a[1:])[:60] for a, _ in TABLE])
def test_bad_input_is_one_clear_line_per_problem(argv, expected, inputs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = _fill(argv, inputs) + ([f"run_dir={tmp_path}/run"] if argv[0] in ("train", "submit") else [])
    code, err = _run(argv, capsys)
    assert code == 2, err
    assert expected in err, err
    assert "Traceback" not in err
    assert all(line.startswith(("hpc-train: error: ", "usage: ")) for line in err.splitlines() if line), err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_table_has_over_100_rows():
    assert len(TABLE) >= 100


@pytest.mark.parametrize("argv", GOOD, ids=[" ".join(a)[:50] for a in GOOD])
def test_legitimate_input_succeeds(argv, inputs, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    argv = _fill(argv, inputs) + ([f"run_dir={tmp_path}/run"] if argv[0] == "submit" else [])
    code, err = _run(argv, capsys)
    assert code == 0, err


def test_all_problems_are_reported_at_once(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, err = _run(["config", "show", TINY, "optim.lr=nan", "optim.beta1=2", "model.norm_eps=-1",
                      "train.steps=0"], capsys)  # fmt: skip
    assert code == 2 and len(err.splitlines()) == 4, err


class Payload:
    """Unpickling this runs a shell command: what an attacker plants in a checkpoint file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_metrics_log_survives_a_partial_last_line(tmp_path):
    """A kill (or a full disk) mid-write leaves half a line; resume drops it and appends on a fresh line."""
    good = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 4, "lo')
    log = MetricsLog(tmp_path, 10, "none")
    log.load_state_dict({"step": 3})
    log.write({"step": 4, "loss": 2.0}, show=False)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_local_rendezvous_store_listens_on_loopback_only():
    from hpc_train.launch.local import serve_store

    store = serve_store()
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{store.port}"], capture_output=True, text=True).stdout
    assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{store.port}"]


def test_payload_in_a_rank_file_is_refused(tmp_path):
    import torch

    path, marker = tmp_path / "rank00000.pt", tmp_path / "pwned"
    torch.save({"step": 1, "rng": Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="holds something other than tensors"):
        load_rank_file(path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="refused to load posix.system"):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


def test_lock_is_exclusive_and_taken_over_from_a_dead_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from hpc_train.checkpoint.ownership import DirectoryLock; "
         "DirectoryLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"in use by a live run \\(pid {holder.pid} on "):
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = DirectoryLock(tmp_path)
    assert f"from a run that is gone (pid {holder.pid} on " in lock.acquire()
    lock.release()
    shutil.rmtree(tmp_path)
