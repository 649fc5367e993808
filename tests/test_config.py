import json
import subprocess
import sys

import pytest
import torch
import yaml

from hpc_train.cli import main
from hpc_train.config import ConfigError, to_yaml, validate
from hpc_train.job import check_run, load_config
from hpc_train.launch import local, slurm
from tests.conftest import ROOT, run_cli


def check(overrides: list[str], world_size: int = 1, path: str | None = None) -> None:
    cfg = load_config(path, overrides)
    check_run(cfg, world_size)


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["train.step=5"], 1, ["unknown config key 'train.step'", "did you mean 'train.steps'"]),
        (["trian.steps=5"], 1, ["unknown config key 'trian'", "did you mean 'train'"]),
        (["model.n_layer=5"], 1, ["'model.n_layer'", "'model.n_layers'"]),
        (["train.steps=abc"], 1, ["train.steps", "'abc'", "expected int"]),
        (["train.micro_batch_size=2.5"], 1, ["train.micro_batch_size", "2.5", "expected int"]),
        (["train.precision=fp8"], 1, ["train.precision='fp8'", "fp32, bf16, fp16"]),
        (["train.steps=0"], 1, ["train.steps=0 must be > 0"]),
        (["parallel.tp=2"], 3, ["world size 3 is not divisible by tp x pp x cp = 2 x 1 x 1"]),
        (["parallel.cp=2"], 3, ["world size 3 is not divisible by tp x pp x cp = 1 x 1 x 2"]),
        (["parallel.cp=4", "model.seq_len=36"], 4, ["model.seq_len=36 does not split into 8 chunks", "multiple of 8"]),
        (
            ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=36"],
            4,
            ["x tp for sequence parallelism", "multiple of 8"],
        ),
        (["parallel.cp=4", "parallel.cp_mode=ulysses", "parallel.tp=2"], 8, ["each tp rank's 2 heads", "cp_mode=ring"]),
        (["model.n_heads=4", "parallel.tp=3"], 3, ["model.n_heads=4 is not divisible by parallel.tp=3"]),
        (["model.n_layers=4", "parallel.pp=3"], 3, ["model.n_layers=4 is not divisible by parallel.pp"]),
        (["parallel.dp=4"], 2, ["parallel.dp=4", "gives dp=2"]),
        (["train.global_batch_size=64", "train.micro_batch_size=8"], 2, ["global_batch_size=64", "grad_accum=4"]),
        (["data.train_path=/nonexistent/corpus"], 1, ["data.train_path", "/nonexistent/corpus.bin' does not exist"]),
        (["model.d_model=100", "model.n_heads=3"], 1, ["model.d_model=100 is not divisible by model.n_heads=3"]),
        (["model.n_kv_heads=3"], 1, ["model.n_heads=4 is not divisible by model.n_kv_heads=3"]),
        (["optim.min_lr=1.0"], 1, ["optim.min_lr=1.0 is larger than optim.lr"]),
        (["parallel.pp=2"], 2, ["train.grad_accum=1 gives 1 micro-batches", "set train.grad_accum >= 2"]),
        (["parallel.pp=2", "train.grad_accum=2", "parallel.virtual_stages=2"], 2, ["schedule=interleaved_1f1b"]),
        (["parallel.pp=2", "train.grad_accum=3", "parallel.schedule=interleaved_1f1b"], 2, ["virtual_stages >= 2"]),
        (["model.ffn_hidden=100", "parallel.tp=8", "model.n_heads=8"], 8, ["MLP hidden size 100", "tp=8"]),
        (["model.arch=gpt3"], 1, ["model.arch='gpt3' is not one of llama, gpt2"]),
        (["model.arch=gpt2", "model.n_heads=3", "model.d_model=96", "parallel.tp=2"], 2, ["n_heads=3", "tp=2"]),
        (["train.freeze=[embeddings.*]"], 1, ["train.freeze pattern 'embeddings.*' matches no parameter of the llama"]),
        (["train.freeze=['*']"], 1, ["train.freeze holds every parameter fixed"]),
        (
            ["model.n_layers=2", "parallel.pp=2", "train.grad_accum=2", "train.freeze=[tok_*, layers.0.*]"],
            2,
            ["train.freeze holds every parameter of pipeline rank 0 fixed", "smaller parallel.pp"],
        ),
        (["optim.offload=cpu"], 2, ["optim.offload=cpu offloads the sharded optimizer state", "zero_stage=1"]),
        (["optim.zero_stage=4"], 2, ["optim.zero_stage=4 is not supported; use 0, 1, 2 or 3"]),
        (["steps"], 1, ["override 'steps' is not of the form key=value"]),
        (
            ["train.spike_guard.enabled=true"],
            1,
            ["train.spike_guard.enabled rolls a spike back", "checkpoint.interval"],
        ),
        (["train.spike_guard.window=0"], 1, ["train.spike_guard.window=0 must be > 0"]),  # a section's section
        (["checkpoint.local_dir=/tmp/x"], 1, ["checkpoint.local_interval=0: node-local checkpoints need both"]),
        (
            ["checkpoint.memory_interval=1", "checkpoint.local_dir=/tmp/x", "checkpoint.local_interval=1"],
            1,
            [
                "checkpoint.memory_interval=1 with checkpoint.local_dir/local_interval: both are node-local",
                "memory checkpoints are read by an in-job restart: set parallel.max_restarts",
            ],
        ),  # fmt: skip
        (["checkpoint.async_save=maybe"], 1, ["checkpoint.async_save='maybe' is not one of auto, true, false"]),
        (["name=.."], 1, ["name='..' may hold only letters, digits", "not only dots (it names directories)"]),
        (["train.spike_guard.skip=all"], 1, ["train.spike_guard.skip='all' is not one of step, since_checkpoint"]),
        (
            ["data.skip_samples=[[4,6]]", "train.micro_batch_size=4"],
            1,
            ["data.skip_samples=[[4, 6]]", "multiples of the global batch (4 samples), e.g. [[4, 8]]"],
        ),
    ],
)
def test_bad_input_names_the_problem(overrides, world, expected):
    with pytest.raises(ConfigError) as info:
        check(overrides, world)
    for text in expected:
        assert text in str(info.value)


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        load_config("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz' \(from .*bad.yaml\)"):
        load_config(bad)


def test_layering_and_derived_values():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.steps=7", "optim.lr=0.01"])
    assert (cfg.name, cfg.run_dir, cfg.train.steps, cfg.optim.lr) == ("tiny", "runs/tiny", 7, 0.01)
    assert cfg.model.d_model == 128  # from the YAML, over the default
    assert validate(cfg, 2, check_paths=False) == 2  # dp derived from the world size
    cfg = load_config(None, ["train.micro_batch_size=4", "train.grad_accum=2", "train.global_batch_size=16"])
    assert validate(cfg, 2) == 2


@pytest.mark.parametrize("preset", ["gpt_125m", "gpt_1_3b", "gpt_7b", "gpt_70b", "gpt2_124m", "gpt2_1_5b"])
def test_presets_have_consistent_layouts(preset):
    cfg = load_config(ROOT / f"configs/{preset}.yaml")
    world = cfg.slurm.nodes * cfg.slurm.tasks_per_node
    assert cfg.slurm.gpus_per_node == cfg.slurm.tasks_per_node
    dp = validate(cfg, world, check_paths=False)
    assert dp * cfg.parallel.tp * cfg.parallel.pp == world
    assert check_run(cfg, world, check_paths=False).dp == dp


def test_the_recorded_config_reads_back_as_the_same_config():
    """What a run records (config.yaml, each checkpoint's manifest: `to_yaml`) loads back to the same config
    for every preset, with strings that other types' syntax would claim (a float, a bool, a time, quotes,
    non-ASCII) kept strings."""
    tricky = ["slurm.job_name='1e3'", "slurm.partition=on", "slurm.account=Zürich",
              "slurm.setup=[\"export A='x'\", 'yes', '12:30']"]  # fmt: skip
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(preset, tricky)
        assert load_config(None, saved=to_yaml(cfg)) == cfg, preset.name
    assert cfg.slurm.job_name == "1e3" and cfg.slurm.setup[1:] == ["yes", "12:30"]


def test_config_show_cli():
    out = run_cli("config", "show", "configs/tiny.yaml", "train.steps=3")
    assert out.returncode == 0, out.stderr
    assert "steps: 3" in out.stdout and "run_dir: 'runs/tiny'" in out.stdout
    assert "valid for world size 2: pp=1 dp=2 cp=1 tp=1" in out.stderr
    bad = run_cli("train", "configs/tiny.yaml", "train.stpes=3")
    assert bad.returncode == 2
    assert "did you mean 'train.steps'" in bad.stderr and "Traceback" not in bad.stderr
    layout = run_cli("train", "configs/tiny.yaml", "parallel.tp=4")
    assert layout.returncode == 2 and "world size 2 is not divisible by tp x pp x cp = 4 x 1 x 1" in layout.stderr
    assert "hpc_train:" not in layout.stdout  # refused before any rank or process group started


# (overrides, text of the one error line, whether only a run launched on this machine is refused)
BAD_JOB_INPUTS = [
    (["slurm.cpus_per_task=-1"], "slurm.cpus_per_task=-1 must be > 0 (or left out)", False),
    (["slurm.mem=abc"], "slurm.mem='abc' is not a Slurm size; use a number with an optional unit", False),
    (["slurm.time=00:10:00", "slurm.signal_delay_s=900"], "slurm.signal_delay_s=900 must be less than slurm.time",
     False),
    (["parallel.nproc=100000"], "parallel.nproc=100000 local processes exceed", True),
]  # fmt: skip


class Started(Exception):
    """What a command does once its checks have passed: ranks started here, or a job handed to Slurm."""


def outcome(argv: list[str], capsys) -> str:
    """The command's error output if it refused (exit code 2), else what it went on to do."""
    try:
        main(argv)
    except SystemExit as done:
        err = capsys.readouterr().err
        return err if done.code == 2 else f"exit {done.code}: {err}"
    except Started as what:
        capsys.readouterr()
        return str(what)
    capsys.readouterr()
    return "accepted"


@pytest.fixture
def hf_folder(tmp_path):
    """The smallest folder import-hf resolves a config from: a Llama config.json and a safetensors file."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "vocab_size": 257,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "rms_norm_eps": 1e-5}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(257, 64)}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("overrides, expected, local_only", BAD_JOB_INPUTS, ids=[o[0] for o, _, _ in BAD_JOB_INPUTS])
def test_every_command_refuses_the_same_bad_input(overrides, expected, local_only, hf_folder, tmp_path, capsys,
                                                  monkeypatch):  # fmt: skip
    """Every command that resolves a config runs one set of checks: the same bad input gets the same error
    from each, before any rank starts or any job is submitted. A limit of this machine applies where ranks
    are launched here, and in `config show`, which reports what `train` here would refuse."""
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID"):  # as if started alone, not as a rank
        monkeypatch.delenv(var, raising=False)

    def started(what: str):
        def refuse(*args, **kwargs):
            raise Started(what)

        return refuse

    monkeypatch.setattr(local, "launch_local", started("started ranks here"))
    monkeypatch.setattr(slurm, "submit", started("submitted a Slurm job"))
    tiny = ["configs/tiny.yaml", f"run_dir={tmp_path / 'run'}"]
    here = {
        "config show": ["config", "show", *tiny],
        "train": ["train", *tiny],
        "doctor --local": ["doctor", *tiny, "--local"],
        "import-hf": ["import-hf", hf_folder, str(tmp_path / "imported")],
    }
    cluster = {
        "submit --dry-run": ["submit", *tiny, "--dry-run"],
        "submit": ["submit", *tiny],
        "doctor": ["doctor", *tiny],
        "plan": ["plan", *tiny],
        "plan --search": ["plan", *tiny, "--search"],
    }
    commands = here if local_only else {**here, **cluster}
    outcomes = {name: outcome([*argv, *overrides], capsys) for name, argv in commands.items()}
    report = "\n".join(f"{name}: {text!r}" for name, text in outcomes.items())
    error = outcomes["config show"]
    assert error.startswith(f"hpc-train: error: {expected}") and error.count("\n") == 1, report
    assert all(text == error for text in outcomes.values()), report
    if local_only:  # the cluster's nodes, not this machine, bound a submitted job
        assert outcome([*cluster["submit --dry-run"], *overrides], capsys) == "accepted"


def test_configs_and_runs_are_found_from_any_directory(tmp_path, capsys, monkeypatch):
    """From another directory than the repository's: a preset by name or by its path in the repository, but a
    file where the user stands first (a configs/tiny.yaml of theirs); a name that is neither gets the presets'
    folder and names. tools/plot_run.py takes a run's directory or name from there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/tiny.yaml").write_text("name: mine\n")
    names = {}
    spellings = ("tiny", "moe_tiny.yaml", "configs/moe_tiny.yaml", "configs/tiny.yaml", str(ROOT / "configs/tiny.yaml"))
    for spelled in spellings:
        main(["config", "show", spelled])
        names[spelled] = yaml.safe_load(capsys.readouterr().out)["name"]
    assert list(names.values()) == ["tiny", "moe_tiny", "moe_tiny", "mine", "tiny"]
    error = outcome(["plan", "nope"], capsys)
    assert error.startswith(f"hpc-train: error: config file 'nope' does not exist (from {tmp_path}), nor is it a ")
    assert f"are gpt2_124m, gpt2_1_5b, gpt_125m, gpt_130b, gpt_1_3b, gpt_70b, gpt_7b, llama2_7b_qlora, " \
           f"moe_qwen3_30b_a3b, moe_tiny, tiny (in {ROOT / 'configs'})" in error and error.count("\n") == 1  # fmt: skip
    run = tmp_path / "runs/demo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 5.0 / step, "tokens_per_s": 1e3,
                                                           "memory_gb": 0.1}) + "\n" for step in (1, 2)))  # fmt: skip
    plot = [sys.executable, str(ROOT / "tools/plot_run.py")]
    drawn = subprocess.run([*plot, "demo", "runs/demo", "--out", "p.png"], capture_output=True, text=True)
    assert drawn.returncode == 0 and drawn.stdout == f"{tmp_path / 'p.png'}\n", drawn.stderr
    gone = subprocess.run([*plot, "gone"], capture_output=True, text=True)
    assert gone.returncode == 1 and gone.stderr == (
        f"plot_run.py: error: no run 'gone': there is no {tmp_path}/gone/metrics.jsonl nor {tmp_path}/runs/gone/"
        "metrics.jsonl; give a run's directory (its run_dir)\n"
    )


def test_every_problem_is_one_line_where_it_belongs(tmp_path, capsys, monkeypatch):
    """Every unknown key is named (one under another section pointed to it there), the embedded corpus's
    vocabulary is refused once before any rank starts, and the world size's source stands beside a layout
    problem only, not beside a missing dataset."""
    monkeypatch.chdir(ROOT)

    def launched(*args, **kwargs):
        raise Started("started ranks here")

    monkeypatch.setattr(local, "launch_local", launched)
    bad_keys = ["train.lr=1e-3", "model.n_layer=2", "parallel.bar=2"]
    error = outcome(["config", "show", "configs/tiny.yaml", *bad_keys], capsys)
    assert error.splitlines() == [
        "hpc-train: error: unknown config key 'train.lr' (from command line); did you mean 'optim.lr'?",
        "hpc-train: error: unknown config key 'model.n_layer' (from command line); did you mean 'model.n_layers'?",
        "hpc-train: error: unknown config key 'parallel.bar' (from command line); did you mean 'parallel.backend'?",
    ]
    error = outcome(["train", "configs/tiny.yaml", "model.vocab_size=100", f"run_dir={tmp_path / 'run'}"], capsys)
    assert error == ("hpc-train: error: model.vocab_size=100 is smaller than the 257 byte-level tokens of the embedded "
                     "corpus (data.train_path=stdlib): set model.vocab_size=257 or more, or give a dataset made by "
                     "`hpc-train prepare-data`\n")  # fmt: skip
    error = outcome(["submit", "configs/tiny.yaml", "parallel.tp=3", "data.train_path=/nonexistent/x", "--dry-run",
                     f"run_dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    layout, data = error.splitlines()
    assert layout.startswith("hpc-train: error: world size 1 is not divisible by tp x pp x cp = 3 x 1 x 1")
    assert layout.endswith("(world size = slurm.nodes x slurm.tasks_per_node = 1)")
    assert data.startswith("hpc-train: error: data.train_path='/nonexistent/x'") and "world size" not in data


def test_the_configuration_reference_is_the_schemas_and_current():
    """docs/configuration.md is what `python -m hpc_train.commands.config_reference` prints from the composed schema:
    every key a config can set (features' included), its default, its rule and the schema's comment."""
    from omegaconf import OmegaConf

    from hpc_train.commands.config_reference import render
    from hpc_train.job import JobConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), "stale: run python -m hpc_train.commands.config_reference > docs/configuration.md"

    def keys(tree: dict, prefix: str = "") -> list[str]:
        return [k for name, v in tree.items()
                for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict) else [f"{prefix}{name}"])]  # fmt: skip

    every = keys(OmegaConf.to_container(OmegaConf.structured(JobConfig())))
    assert len(every) > 140 and all(f"| `{key}` |" in page for key in every)
    assert "| `model.vocab_multiple` | `128` | > 0 | embedding rows are padded to a multiple of this" in page
    assert (
        "| `train.fp8` | `'off'` | one of `off`, `tensorwise`, `rowwise` | float8 matmuls" in page
    )  # a feature's key, in its section
