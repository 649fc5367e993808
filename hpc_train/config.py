"""Configuration: the schema (dataclasses), loading YAML + `key=value` overrides, and validation.

Every section is a plain dataclass; omegaconf merges YAML files and command-line overrides over the
defaults and type-checks them. `validate` then checks what omegaconf cannot: choices, paths and the
quantities derived from the parallel layout. Every error is a `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from hpc_train.errors import UserError

BUILTIN_DATA = "stdlib"  # data path naming the embedded corpus (the interpreter's own standard library)


class ConfigError(UserError, ValueError):
    """A configuration problem, with a message that names the key and what to change."""


@dataclass
class ModelConfig:
    arch: str = "llama"  # model family: llama | gpt2 (hpc_train/models)
    vocab_size: int = 257  # byte-level tokenizer: 256 bytes + end-of-document
    vocab_multiple: int = 128  # embedding rows are padded to a multiple of this (x tp), as Megatron does
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    d_model: int = 128
    ffn_hidden: int | None = None  # None = the family's: llama 8/3 * d_model rounded up to ffn_multiple, gpt2 4x
    ffn_multiple: int = 64
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool | None = None  # output head shares the embedding; None = the family's (gpt2 ties)
    init_std: float = 0.02
    recompute: str = "none"  # none | selective (attention core) | full (whole layers)
    recompute_every: int = 1  # with a policy: recompute every k-th layer of each pipeline stage
    recompute_first: int | None = None  # with a policy: only the first M layers of each stage (None = all)
    # the head and loss run on this many tokens at a time, each chunk's logits recomputed in backward, so the
    # whole micro-batch's logits never exist at once (under sequence parallelism: whole sequences); 0 = one go
    loss_chunk_tokens: int = 2048
    # start from these weights (step 0, fresh optimizer): a Hugging Face folder (config.json + safetensors) or
    # an hpc_train checkpoint / run directory; the architecture keys above are taken from it
    init_from: str | None = None


@dataclass
class ParallelConfig:
    nproc: int = 1  # local processes when not started by Slurm or torchrun
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None = world_size / (tp * pp)
    virtual_stages: int = 1
    schedule: str = "1f1b"  # 1f1b | interleaved_1f1b
    sequence_parallel: bool = False
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout_s: int = 600  # collective timeout: a dead rank ends the job instead of hanging it
    rendezvous_timeout_s: int = 300  # every rank must have joined by then; the error names who did not
    hang_timeout_s: int = 300  # a step unfinished this long: every rank's stack to run_dir/hang, then stop; 0 = off
    max_restarts: int = 0  # a rank process that dies: restart every rank in the job from the newest checkpoint


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 8
    grad_accum: int = 1
    global_batch_size: int | None = None  # None = micro_batch_size * grad_accum * dp; if set it must match
    precision: str = "fp32"  # fp32 | bf16 | fp16
    initial_loss_scale: float = 65536.0  # fp16 only: dynamic loss scaling
    loss_scale_window: int = 1000  # fp16: clean steps before the scale doubles
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    eval_interval: int = 50  # 0 = never
    eval_batches: int = 4
    save_final_model: bool = True  # write run_dir/model_final.pt (consolidated weights) at the end
    freeze: list[str] = field(default_factory=list)  # parameter names (fnmatch patterns) held fixed
    skip_nonfinite: int = 0  # steps with a non-finite loss or gradient skipped before the run stops
    compile: bool = False  # torch.compile each block and, without tp, the loss chunk (regional compile)


@dataclass
class OptimConfig:
    # the update rule (optim/rules): adamw, or muon (hidden-layer matrices by Muon, everything else by AdamW)
    name: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    decay_steps: int | None = None  # None = train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping
    # 0 = plain data parallelism; sharded over dp: 1 = optimizer state, 2 = + gradients, 3 = + parameters (FSDP2)
    zero_stage: int = 0
    bucket_mb: float = 25.0  # gradient reduction bucket size (stages 0-2)
    offload: str = "none"  # none | cpu: the sharded optimizer state (stage 3: also the parameters) in host memory
    # stage 3: free each block's gathered parameters after its forward (and all-gather them again for its
    # backward); None = true without pipeline parallelism, false with it (torchtitan's default: a pipeline
    # stage runs several forwards per step, and torch's schedules keep its parameters gathered until the
    # step's last backward anyway)
    reshard_after_forward: bool | None = None
    overlap_grad_reduce: bool = False  # start each bucket's dp reduction from backward, as soon as it is ready
    # muon: momentum, Nesterov, Newton-Schulz iterations, and how its lr is scaled per matrix shape
    # (match_rms_adamw: Moonlight's 0.2 sqrt(max(rows, cols)), so optim.lr serves AdamW's parameters and
    # Muon's alike; original: Keller Jordan's sqrt(max(1, rows / cols)))
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"


@dataclass
class FinetuneConfig:
    """Which parameters train: all of them, or low-rank adapters on frozen base weights (LoRA; QLoRA keeps
    the frozen base in 4-bit NF4)."""

    method: str = "full"  # full | lora | qlora
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # on the adapter's input
    lora_targets: list[str] = field(default_factory=lambda: ["wq", "wv"])  # projections (e.g. wq wk wv wo w1 w2 w3)


@dataclass
class DataConfig:
    train_path: str = BUILTIN_DATA  # prefix of a .bin/.idx pair, or "stdlib" for the embedded corpus
    valid_path: str | None = None  # None with "stdlib" = its held-out split; None otherwise = no eval
    cache_dir: str = "${oc.env:HPC_TRAIN_CACHE,'~/.cache/hpc_train'}"  # where the embedded corpus is built


@dataclass
class CheckpointConfig:
    """Sharded, verified checkpoints. A run resumes from the newest one that verifies in `dir`."""

    dir: str = "${run_dir}/checkpoints"
    interval: int = 0  # save every N steps (and at the end); 0 = only when preempted
    keep_last: int = 3  # committed checkpoints kept (the newest complete one is never deleted)
    keep_every: int = 0  # also keep every K-th step forever; 0 = off
    async_save: bool = False  # write in the background while training continues
    verify: str = "full"  # full (sizes + checksums, every rank checking its share) | sizes
    resume: bool = True
    io_threads: int = 1  # per rank: files written, read and checksummed in parallel


@dataclass
class SlurmConfig:
    """The sbatch job `hpc-train submit` generates (through submitit): one task per rank (per GPU)."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0  # 0 = CPU job; otherwise must equal tasks_per_node
    gpu_mem_gb: float = 80.0  # per GPU (GiB): `submit` refuses a layout the planner says does not fit
    cpus_per_task: int | None = None
    mem: str | None = None  # e.g. 200G, or 0 for all of a node's memory
    time: str = "01:00:00"  # MM, HH:MM:SS or D-HH:MM:SS
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None  # None = name
    log_dir: str | None = None  # None = <run_dir>/slurm
    signal_delay_s: int = 120  # Slurm sends the preemption/time-limit warning signal this long before the end
    max_requeues: int = 3  # how often a preempted or timed-out job is requeued
    setup: list[str] = field(default_factory=list)  # shell lines before srun: module loads, exports
    extra: dict[str, str] = field(default_factory=dict)  # more #SBATCH directives, e.g. {mail-type: END}


@dataclass
class LoggingConfig:
    log_interval: int = 1
    progress: str = "auto"  # auto (a bar on a terminal, lines otherwise) | bar | lines | none
    breakdown: bool = False  # per-step time of forward+backward, gradient reduction, optimizer, bubble estimate
    profile_steps: list[int] = field(default_factory=list)  # [a, b]: torch.profiler trace of steps a..b
    tensorboard: bool = False  # also write the metrics to <run_dir>/tensorboard
    straggler_interval: int = 50  # every N steps: name the ranks whose compute is slower than the median; 0 = off
    straggler_threshold: float = 0.2  # ... by more than this fraction
    straggler_blame: float = 0.0  # a straggler this many times the median has its node excluded next time; 0 = never


@dataclass
class JobConfig:
    name: str = "run"
    run_dir: str = "runs/${name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


CHOICES = {
    "model.recompute": ("none", "selective", "full"),
    "parallel.schedule": ("1f1b", "interleaved_1f1b"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "optim.offload": ("none", "cpu"),
    "optim.muon_adjust_lr": ("match_rms_adamw", "original"),
    "finetune.method": ("full", "lora", "qlora"),
    "logging.progress": ("auto", "bar", "lines", "none"),
    "checkpoint.verify": ("full", "sizes"),
}
POSITIVE = (
    "model.n_layers", "model.n_heads", "model.d_model", "model.seq_len", "model.vocab_size",
    "model.vocab_multiple", "model.ffn_multiple", "model.recompute_every", "model.rope_theta", "model.norm_eps",
    "model.init_std", "parallel.nproc", "parallel.tp", "parallel.pp", "parallel.virtual_stages",
    "parallel.timeout_s", "train.steps", "train.micro_batch_size", "train.grad_accum", "train.eval_batches",
    "train.initial_loss_scale", "train.loss_scale_window", "optim.eps", "slurm.nodes", "slurm.tasks_per_node",
    "slurm.gpu_mem_gb", "logging.log_interval", "checkpoint.io_threads", "parallel.rendezvous_timeout_s",
    "finetune.lora_rank", "finetune.lora_alpha", "optim.ns_steps",
)  # fmt: skip
NON_NEGATIVE = (
    "train.eval_interval", "train.skip_nonfinite", "optim.warmup_steps", "optim.grad_clip", "optim.weight_decay",
    "optim.lr", "optim.min_lr", "optim.bucket_mb", "checkpoint.interval", "checkpoint.keep_last",
    "checkpoint.keep_every", "slurm.gpus_per_node", "slurm.signal_delay_s", "slurm.max_requeues",
    "parallel.hang_timeout_s", "parallel.max_restarts", "logging.straggler_interval", "logging.straggler_threshold",
    "logging.straggler_blame", "model.loss_chunk_tokens",
)  # fmt: skip
POSITIVE_IF_SET = ("model.n_kv_heads", "model.ffn_hidden", "train.global_batch_size", "optim.decay_steps")
NON_NEGATIVE_IF_SET = ("model.recompute_first",)
FRACTIONS = ("optim.beta1", "optim.beta2", "optim.momentum", "finetune.lora_dropout")  # in [0, 1)


def _all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        full = f"{prefix}{key}"
        keys.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            keys.extend(_all_keys(child, f"{full}."))
    return keys


def _merge_error(err: OmegaConfBaseException, source: str) -> ConfigError:
    """Turn an omegaconf merge error into a message naming the key, the value and the fix."""
    key = err.full_key or err.key or "?"
    if isinstance(err, ConfigKeyError):
        valid = _all_keys(OmegaConf.structured(JobConfig))
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else "; `hpc-train config show` lists the valid keys"
        return ConfigError(f"unknown config key '{key}' (from {source}){hint}")
    if isinstance(err, ValidationError) and err.value is not None and key != "?":
        value = err.value._value() if hasattr(err.value, "_value") else err.value
        expected = JobConfig
        for part in str(key).split("."):
            expected = typing.get_type_hints(expected)[part]
        expected_name = getattr(expected, "__name__", str(expected))
        return ConfigError(
            f"config key '{key}' (from {source}) got {value!r} of type {type(value).__name__}, expected {expected_name}"
        )
    where = f"config key '{key}' " if key != "?" else "config "
    return ConfigError(f"invalid {where}(from {source}): {str(err.msg or err).splitlines()[0]}")


def _check_sections(layer: DictConfig, source: str) -> None:
    """A section given as a plain value (`model: 5`) is named before omegaconf reports it obscurely."""
    sections = {f.name for f in dataclasses.fields(JobConfig) if f.default_factory is not dataclasses.MISSING}
    for key in layer:
        if key in sections and not isinstance(layer._get_node(key), DictConfig):
            raise ConfigError(f"config section '{key}' (from {source}) must be a mapping of its keys "
                              f"(e.g. '{key}.<key>=...'), not {layer[key]!r}")  # fmt: skip


def parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=10)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        bad = next((item for item in overrides if not _parses(item.partition("=")[2])), "?")
        raise ConfigError(f"override '{bad}' is not valid YAML ({problem}); quote the value, e.g. \"['*']\"") from None


def _parses(value: str) -> bool:
    try:
        yaml.safe_load(value)
        return True
    except yaml.YAMLError:
        return False


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None, saved: str | None = None
) -> JobConfig:
    """Defaults <- YAML file (or `saved`, the YAML text a checkpoint recorded) <- `key=value` overrides,
    type-checked and interpolations resolved."""
    merged = OmegaConf.structured(JobConfig)
    layers: list[tuple[str, DictConfig]] = []
    if saved is not None:
        layers.append(("a checkpoint's recorded config", OmegaConf.create(saved)))
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file '{path}' does not exist; the presets live in configs/")
        try:
            loaded = OmegaConf.load(path)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(f"config file '{path}' is not valid YAML{line}: {problem}") from None
        except (UnicodeDecodeError, OSError) as err:
            raise ConfigError(f"config file '{path}' cannot be read: {err}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, not a list")
        layers.append((str(path), loaded))
    layers.append(("command line", parse_overrides(overrides or [])))
    for source, layer in layers:
        _check_sections(layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _merge_error(err, source) from None
    try:
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"could not resolve config: {err.msg}") from None


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _get(cfg: JobConfig, key: str):
    """The value of a dotted key (`name`, `optim.lr`)."""
    return functools.reduce(getattr, key.split("."), cfg)


def has_control_chars(value: str) -> bool:
    """A newline (or any control character) would end the line of a script or log the value is written into."""
    return any(unicodedata.category(c) == "Cc" for c in value)


def derive_dp(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel size: world / (tp * pp), checked against `parallel.dp` when that is given."""
    p = cfg.parallel
    model_parallel = p.tp * p.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp x pp = {p.tp} x {p.pp} = {model_parallel}; "
            f"use a world size that is a multiple of {model_parallel} or change parallel.tp / parallel.pp"
        )
    dp = world_size // model_parallel
    if p.dp is not None and p.dp != dp:
        raise ConfigError(
            f"parallel.dp={p.dp} but world size {world_size} / (tp x pp = {model_parallel}) gives dp={dp}; "
            f"set parallel.dp={dp}, leave it out to derive it, or change the number of processes"
        )
    return dp


def _value_problems(cfg: JobConfig) -> list[str]:
    """Every key's own range: choices, signs, finiteness, fractions; one line per problem."""
    problems = [f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}"
                for key, allowed in CHOICES.items() if _get(cfg, key) not in allowed]  # fmt: skip
    floats = [f"{section}.{k}" for section in ("model", "train", "optim", "slurm", "finetune")
              for k, v in vars(getattr(cfg, section)).items() if isinstance(v, float)]  # fmt: skip
    nonfinite = {key for key in floats if not math.isfinite(_get(cfg, key))}
    problems += [f"{key}={_get(cfg, key)} must be a finite number" for key in floats if key in nonfinite]

    def check(keys: tuple[str, ...], ok, rule: str, optional: bool = False) -> None:
        for key in keys:
            value = _get(cfg, key)
            if (optional and value is None) or key in nonfinite:
                continue
            if not ok(value):
                problems.append(f"{key}={value} must be {rule}")

    check(POSITIVE, lambda v: v > 0, "> 0")
    check(NON_NEGATIVE, lambda v: v >= 0, ">= 0")
    check(POSITIVE_IF_SET, lambda v: v > 0, "> 0 (or left out)", optional=True)
    check(NON_NEGATIVE_IF_SET, lambda v: v >= 0, ">= 0 (or left out)", optional=True)
    check(FRACTIONS, lambda v: 0 <= v < 1, "in [0, 1), e.g. 0.9 or 0.95")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", cfg.name):
        problems.append(f"name={cfg.name!r} may hold only letters, digits, '.', '_' and '-'")
    if not problems and cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is larger than optim.lr={cfg.optim.lr}")
    if cfg.parallel.max_restarts and not (cfg.checkpoint.interval and cfg.checkpoint.resume):
        problems.append(f"parallel.max_restarts={cfg.parallel.max_restarts} restarts the ranks from the newest "
                        "checkpoint: set checkpoint.interval (e.g. 100) and checkpoint.resume=true, or "
                        "parallel.max_restarts=0")  # fmt: skip
    steps = cfg.logging.profile_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        problems.append(f"logging.profile_steps={list(steps)} must be [first, last] steps, e.g. [10, 12]")
    for key in (
        "name",
        "run_dir",
        "checkpoint.dir",
        "data.train_path",
        "data.valid_path",
        "data.cache_dir",
        "model.init_from",
    ):
        value = _get(cfg, key)
        if value is not None and has_control_chars(value):
            problems.append(f"{key}={value!r} holds a control character (a newline?); remove it")
    return problems


def check_values(cfg: JobConfig) -> None:
    """Every key's own range, whatever the layout; one ConfigError holding all problems."""
    if problems := _value_problems(cfg):
        raise ConfigError("\n".join(problems))


def validate(cfg: JobConfig, world_size: int, check_paths: bool = True) -> int:
    """Check choices, ranges, paths and the parallel layout; return the data-parallel size. Every problem
    is reported at once, one line each. What depends on the model family or the optimizer is checked with
    them (`layout.check_run` runs everything)."""
    check_values(cfg)  # the layout checks below assume sane values
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = 1

    def layout() -> None:
        nonlocal dp
        if m.n_layers % (p.pp * p.virtual_stages):
            raise ConfigError(
                f"model.n_layers={m.n_layers} is not divisible by parallel.pp x parallel.virtual_stages = "
                f"{p.pp} x {p.virtual_stages}; pick a layout whose stage count divides the layers"
            )
        dp = derive_dp(cfg, world_size)
        derived_gbs = t.micro_batch_size * t.grad_accum * dp
        if t.global_batch_size is not None and t.global_batch_size != derived_gbs:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} != micro_batch_size x grad_accum x dp = "
                f"{t.micro_batch_size} x {t.grad_accum} x {dp} = {derived_gbs}; "
                f"set train.grad_accum={t.global_batch_size // (t.micro_batch_size * dp) or 1} or leave "
                "global_batch_size out"
            )

    checks = [layout, lambda: check_pipeline(cfg)]
    if check_paths:
        data_keys = ("data.train_path", "data.valid_path")
        checks += [lambda key=key: check_data_path(key, _get(cfg, key)) for key in data_keys]
    raise_all(checks)
    return dp


def raise_all(checks) -> None:
    """Run every check; raise one ConfigError holding all their messages, one per line."""
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("\n".join(problems))


def check_pipeline(cfg: JobConfig) -> None:
    """Schedules need at least as many micro-batches (train.grad_accum) as pipeline stages."""
    p, ga = cfg.parallel, cfg.train.grad_accum
    if p.schedule == "1f1b" and p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved_1f1b "
            "(1f1b runs one stage per rank)"
        )
    if p.schedule == "interleaved_1f1b" and p.pp > 1 and p.virtual_stages < 2:
        raise ConfigError("parallel.schedule=interleaved_1f1b needs parallel.virtual_stages >= 2")
    if p.pp > 1 and ga < p.pp:
        raise ConfigError(
            f"train.grad_accum={ga} gives {ga} micro-batches per step, fewer than parallel.pp={p.pp} pipeline "
            f"stages; set train.grad_accum >= {p.pp} (more micro-batches also shrink the pipeline bubble)"
        )
    if p.schedule == "interleaved_1f1b" and p.pp > 1 and ga % p.pp:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum={ga} to be a multiple of parallel.pp={p.pp}")


def check_data_path(key: str, prefix: str | None) -> None:
    if prefix is None or prefix == BUILTIN_DATA:
        return
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(
                f"{key}={prefix!r}: '{prefix}{suffix}' does not exist; give the prefix of a dataset made by "
                f"`hpc-train prepare-data`, or {key}={BUILTIN_DATA} for the embedded corpus"
            )
