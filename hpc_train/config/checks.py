"""Checks on a loaded config that omegaconf's types cannot express: each field's own rule (declared beside
it in schema.py), finiteness, paths, what sbatch accepts in the slurm section, and the quantities derived
from the parallel layout. Every problem is reported at once, one line each."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import unicodedata
from pathlib import Path
from typing import Any

from hpc_train.config.fields import RANGES, ConfigError, LayoutError
from hpc_train.config.schema import BUILTIN_DATA, BYTE_VOCAB, SPLIT_BACKWARD, V_SHAPED, JobConfig


def expand_on_node(key: str, path: str) -> str:
    """`path` (the value of `key`, a directory on each node's own disk) with this process's environment
    variables expanded, as each rank does on its node ($SLURM_TMPDIR, $SLURMD_NODENAME); one the node does
    not set is a ConfigError, not a directory named after it."""
    expanded = os.path.expandvars(path)
    if "$" in expanded:
        raise ConfigError(f"{key}={path}: {expanded} holds a variable this node does not set; set it, or give the "
                          "directory itself")  # fmt: skip
    return expanded


def _get(cfg: JobConfig, key: str):
    """The value of a dotted key (`name`, `optim.lr`)."""
    return functools.reduce(getattr, key.split("."), cfg)


def has_control_chars(value: str) -> bool:
    """A newline (or any control character) would end the line of a script or log the value is written into."""
    return any(unicodedata.category(c) == "Cc" for c in value)


def derive_dp(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel size: world / (tp * pp * cp), checked against `parallel.dp` when that is given."""
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise LayoutError(
            f"world size {world_size} is not divisible by tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {model_parallel}; "
            f"use a world size that is a multiple of {model_parallel} or change parallel.tp / parallel.pp / parallel.cp"
        )
    dp = world_size // model_parallel
    if p.dp is not None and p.dp != dp:
        raise LayoutError(
            f"parallel.dp={p.dp} but world size {world_size} / (tp x pp x cp = {model_parallel}) gives dp={dp}; "
            f"set parallel.dp={dp}, leave it out to derive it, or change the number of processes"
        )
    return dp


def _fields(cfg: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every section's fields, by dotted key, those of sections within sections (train.spike_guard) too."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _fields(value, f"{prefix}{f.name}.")
        elif prefix:
            out.append((f"{prefix}{f.name}", f))
    return out


def _choice(value: Any) -> Any:
    """A choice's value as its options spell it: omegaconf turns a YAML or command-line true/false given to a
    string key into "True"/"False"."""
    return {"True": "true", "False": "false"}.get(value, value)


def _value_problems(cfg: JobConfig) -> list[str]:
    """Every key's own rule (schema.py, beside the field): choices, signs, fractions; finiteness; and what
    sbatch accepts in the slurm section. One line per problem."""
    fields = _fields(cfg)
    choices = {key: f.metadata["choices"] for key, f in fields if "choices" in f.metadata}
    problems = [f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}"
                for key, allowed in choices.items() if _choice(_get(cfg, key)) not in allowed]  # fmt: skip
    floats = [key for key, _ in fields if isinstance(_get(cfg, key), float)]
    nonfinite = {key for key in floats if not math.isfinite(_get(cfg, key))}
    problems += [f"{key}={_get(cfg, key)} must be a finite number" for key in floats if key in nonfinite]
    for key, f in fields:
        value = _get(cfg, key)
        if "range" not in f.metadata or value is None or key in nonfinite:
            continue
        ok, rule = RANGES[f.metadata["range"]]
        if not ok(value):
            problems.append(f"{key}={value} must be {rule}{' (or left out)' if f.default is None else ''}")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", cfg.name) or not cfg.name.strip("."):  # also all sbatch wants
        problems.append(f"name={cfg.name!r} may hold only letters, digits, '.', '_' and '-', and not only dots "
                        "(it names directories)")  # fmt: skip
    if not problems and cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is larger than optim.lr={cfg.optim.lr}")
    if not problems and cfg.model.seq_len > cfg.model.context_len:
        problems.append(_context_problem(cfg))
    if cfg.parallel.max_restarts and not (cfg.checkpoint.interval and cfg.checkpoint.resume):
        problems.append(f"parallel.max_restarts={cfg.parallel.max_restarts} restarts the ranks from the newest "
                        "checkpoint: set checkpoint.interval (e.g. 100) and checkpoint.resume=true, or "
                        "parallel.max_restarts=0")  # fmt: skip
    c = cfg.checkpoint
    if c.interval != "auto" and (not isinstance(c.interval, int) or c.interval < 0):
        problems.append(f"checkpoint.interval={c.interval!r} must be >= 0 (steps between saves; 0: only when "
                        "stopped) or auto (Daly's interval for checkpoint.mtbf_hours)")  # fmt: skip
    if (c.interval == "auto") != (c.mtbf_hours is not None):
        problems.append(f"checkpoint.interval={c.interval} and checkpoint.mtbf_hours={c.mtbf_hours}: auto saves at "
                        "the interval a failure rate calls for, and only it reads the MTBF: give both (a node's MTBF "
                        "in hours: checkpoint.interval=auto checkpoint.mtbf_hours=5000) or neither")  # fmt: skip
    if c.memory_interval and (c.local_dir or c.local_interval):
        problems.append(f"checkpoint.memory_interval={c.memory_interval} with checkpoint.local_dir/local_interval: "
                        "both are node-local checkpoints, one in host memory, one on local disk: keep one")  # fmt: skip
    if c.memory_interval and not cfg.parallel.max_restarts:
        problems.append(f"checkpoint.memory_interval={c.memory_interval}: memory checkpoints are read by an "
                        "in-job restart: set parallel.max_restarts too (or leave it out)")  # fmt: skip
    if bool(c.local_dir) != bool(c.local_interval) or (c.local_dir and not cfg.parallel.max_restarts):
        problems.append(f"checkpoint.local_dir={c.local_dir!r} and checkpoint.local_interval={c.local_interval}: "
                        "node-local checkpoints need both, and are read by an in-job restart only: set "
                        "parallel.max_restarts too (or leave both out)")  # fmt: skip
    if cfg.train.spike_guard.enabled and not cfg.checkpoint.interval:
        problems.append("train.spike_guard.enabled rolls a spike back to the newest checkpoint: set "
                        "checkpoint.interval (e.g. 100), or train.spike_guard.enabled=false")  # fmt: skip
    problems += _host_copy_problems(cfg)
    steps = cfg.logging.profile_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        problems.append(f"logging.profile_steps={list(steps)} must be [first, last] steps, e.g. [10, 12]")
    elif steps and steps[0] <= cfg.logging.measure_peak_step <= steps[1]:  # one profiler at a time
        problems.append(f"logging.measure_peak_step={cfg.logging.measure_peak_step} profiles a step inside "
                        f"logging.profile_steps={list(steps)}: pick another step")  # fmt: skip
    # a path joined from a bad one (run_dir=runs/${name}, checkpoint.dir=${run_dir}/checkpoints) is not
    # reported again: its source is
    bad = [cfg.name] if has_control_chars(cfg.name) else []
    paths = ("run_dir", "checkpoint.dir", "data.train_path", "data.valid_path", "data.cache_dir", "model.init_from",
             "slurm.log_dir")  # fmt: skip
    for key in paths:
        value = _get(cfg, key)
        if value is None or not has_control_chars(value):
            continue
        if not any(value.startswith(f"{source}/") or value.endswith(f"/{source}") for source in bad):
            problems.append(f"{key}={value!r} holds a control character (a newline?); remove it")
        bad.append(value)
    return problems + _source_problems(cfg) + _embedded_corpus_problems(cfg) + _slurm_problems(cfg)


def _host_copy_problems(cfg: JobConfig) -> list[str]:
    """optim.offload=nvme is chosen where the optimizer state does not fit in host memory, and a state copy
    (checkpoint/memory_copy.py) reads all of it there: the spike guard's (unless it rolls back from disk) and
    node-local checkpoints' (written from that copy, so they cannot go without it)."""
    if cfg.optim.offload != "nvme":
        return []
    problems = []
    if cfg.train.spike_guard.enabled and cfg.train.spike_guard.memory_copy is not False:
        problems.append("train.spike_guard.enabled with optim.offload=nvme keeps a copy of the whole offloaded "
                        "optimizer state in host memory at each save (train.spike_guard.memory_copy), the memory "
                        "nvme offload saves: set train.spike_guard.memory_copy=false (a rollback reads the "
                        "checkpoint from disk)")  # fmt: skip
    if cfg.checkpoint.saves_locally:
        keys = "checkpoint.memory_interval" if cfg.checkpoint.memory_interval else "checkpoint.local_dir"
        given = cfg.checkpoint.memory_interval or repr(cfg.checkpoint.local_dir)
        problems.append(f"{keys}={given} with optim.offload=nvme: node-local "
                        "checkpoints are written from a copy of the whole offloaded optimizer state in host "
                        "memory, the memory nvme offload saves: leave checkpoint.local_dir, "
                        "checkpoint.local_interval and checkpoint.memory_interval out (an in-job restart reads the "
                        "shared checkpoint)")  # fmt: skip
    return problems


def _source_problems(cfg: JobConfig) -> list[str]:
    """data.sources / data.valid_sources: a path each, finite positive weights, distinct names."""
    d, problems = cfg.data, []
    if d.sources and d.train_path != BUILTIN_DATA:
        problems.append(f"data.train_path={d.train_path!r} and data.sources are both set: a blend replaces "
                        "train_path; give the dataset as one of data.sources (or drop data.sources)")  # fmt: skip
    for key, sources in (("data.sources", d.sources), ("data.valid_sources", d.valid_sources)):
        for i, src in enumerate(sources):
            if not src.path:
                problems.append(f"{key}[{i}] has no path: give the prefix of a dataset made by prepare-data")
            if key == "data.sources" and not (math.isfinite(src.weight) and src.weight > 0):
                problems.append(f"{key}[{i}].weight={src.weight} must be a finite number > 0 (its share of the "
                                "samples before normalising; leave a source out to drop it)")  # fmt: skip
            if has_control_chars(src.path):
                problems.append(f"{key}[{i}].path={src.path!r} holds a control character (a newline?); remove it")
        labels = [src.label for src in sources]
        if twice := sorted({label for label in labels if labels.count(label) > 1}):
            problems.append(f"{key} name {', '.join(twice)} more than once: give each source its own `name`")
    return problems


def _embedded_corpus_problems(cfg: JobConfig) -> list[str]:
    """The embedded corpus is byte-level: a model's vocabulary holds its tokens. Checked here, with the keys,
    since only the ranks open that corpus (the checks of the datasets before they start skip it)."""
    d = cfg.data
    keys = [f"data.sources[{i}].path" for i, src in enumerate(d.sources) if src.path == BUILTIN_DATA]
    keys += [f"data.valid_sources[{i}].path" for i, src in enumerate(d.valid_sources) if src.path == BUILTIN_DATA]
    keys += [key for key in ("data.train_path", "data.valid_path") if _get(cfg, key) == BUILTIN_DATA]
    if d.sources and d.train_path == BUILTIN_DATA:  # the default: a blend replaces it
        keys.remove("data.train_path")
    if not keys or cfg.model.vocab_size >= BYTE_VOCAB:
        return []
    return [f"model.vocab_size={cfg.model.vocab_size} is smaller than the {BYTE_VOCAB} byte-level tokens of the "
            f"embedded corpus ({keys[0]}={BUILTIN_DATA}): set model.vocab_size={BYTE_VOCAB} or more, or give a "
            "dataset made by `hpc-train prepare-data`"]  # fmt: skip


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
# Slurm sizes: a number with an optional unit (K, M, G, T); 0 asks for all of a node's memory
MEM_PATTERN = re.compile(r"[0-9]+[KMGTkmgt]?")
EXTRA_KEY_PATTERN = re.compile(r"[a-z][a-z0-9-]*")


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


def _directive_problem(key: str, value: str) -> str | None:
    """Directive values are single sbatch words: no control characters, whitespace, quotes or backslashes."""
    if has_control_chars(value) or any(c.isspace() or c in "'\"\\" for c in value):
        return (f"{key}={value!r} must be a single word for its #SBATCH line: remove the newlines, other control "
                f"characters, spaces, quotes and backslashes")  # fmt: skip
    return None


# sbatch options slurm.extra may not set, and why
RESERVED_EXTRA = {
    "array": "an array's tasks would all run one run, in one run directory; use `hpc-train sweep CONFIG "
    "key=v1,v2`, which gives each member its own run",
    "comment": "hpc_train sets the job's comment to its run directory (how submit, stop and status find a run's "
    "job); remove it",
}


def _slurm_problems(cfg: JobConfig) -> list[str]:
    """What sbatch would refuse, or what would break (or inject into) the script `submit` writes, one line
    each. Checked for every command, not only `submit`: a config is one document, and the one a local run
    records in run_dir/config.yaml may be submitted later. The name's rule, control characters in paths and
    each field's own rule (cpus_per_task > 0, signal_delay_s >= 0...) are checked with the other keys'."""
    s = cfg.slurm
    problems = []
    if s.gpus_per_node and s.gpus_per_node != s.tasks_per_node:
        problems.append(
            f"slurm.gpus_per_node={s.gpus_per_node} but slurm.tasks_per_node={s.tasks_per_node}: hpc_train runs "
            f"one rank per GPU; set slurm.tasks_per_node={s.gpus_per_node}"
        )
    directives = {f"slurm.{key}": getattr(s, key) for key in ("job_name", "partition", "account", "qos", "constraint")}
    directives.update({f"slurm.extra[{key!r}]": str(value) for key, value in s.extra.items()})
    problems += [_directive_problem(key, value) for key, value in directives.items() if value is not None]
    problems += [
        f"slurm.extra key {key!r} is not an sbatch option name; use lowercase letters, digits and '-' (e.g. mail-type)"
        for key in s.extra
        if not EXTRA_KEY_PATTERN.fullmatch(key)
    ]
    problems += [f"slurm.extra key {key!r}: {why}" for key, why in RESERVED_EXTRA.items() if key in s.extra]
    if s.mem is not None and not MEM_PATTERN.fullmatch(s.mem):
        problems.append(f"slurm.mem={s.mem!r} is not a Slurm size; use a number with an optional unit K, M, G "
                        f"or T (e.g. 200G, or 0 for all of a node's memory)")  # fmt: skip
    # submitit quotes the log folder, so spaces are fine; but sbatch and srun expand '%' in it and drop
    # backslashes, so the logs would land elsewhere
    key, folder = ("slurm.log_dir", s.log_dir) if s.log_dir else ("run_dir", cfg.run_dir)
    if any(c in "%\\" for c in folder):
        problems.append(f"{key}={folder!r} holds the Slurm log folder, where sbatch reads '%' as a filename pattern "
                        f"and '\\' as an escape; choose a path without them")  # fmt: skip
    problems += [
        f"slurm.setup[{i}]={line!r} contains a newline or another control character; give each shell line "
        f"as its own list entry"
        for i, line in enumerate(s.setup)
        if has_control_chars(line)
    ]
    seconds = time_limit_seconds(s.time)
    if seconds is None:
        problems.append(TIME_PROBLEM.format(value=s.time))
    elif s.signal_delay_s >= seconds:
        problems.append(f"slurm.signal_delay_s={s.signal_delay_s} must be less than slurm.time={s.time!r} "
                        f"({seconds} s): the warning signal comes that long before the end; lower it or raise "
                        "slurm.time")  # fmt: skip
    return [p for p in problems if p]


def _context_problem(cfg: JobConfig) -> str:
    """Training past the model's context: GPT-2 has no learned position for it, and an export would claim
    less context than was trained. From model.init_from the context is the source's, not the config's."""
    m = cfg.model
    whose = f"that of model.init_from={m.init_from}" if m.init_from else "the context the model is made for"
    fix = f"set model.seq_len={m.max_position_embeddings} or less"
    if not m.init_from:
        fix += ", or raise model.max_position_embeddings (left out, it is model.seq_len)"
    context = f"model.max_position_embeddings={m.max_position_embeddings}"
    return f"model.seq_len={m.seq_len} is longer than {context}, {whose}: {fix}"


def check_values(cfg: JobConfig) -> None:
    """Every key's own rule, the slurm section's included, whatever the layout or the machine; one ConfigError
    holding all problems."""
    if problems := _value_problems(cfg):
        raise ConfigError("\n".join(problems))


def validate(cfg: JobConfig, world_size: int, check_paths: bool = True) -> int:
    """Check choices, ranges, paths and the parallel layout; return the data-parallel size. Every problem
    is reported at once, one line each. What depends on the model family or the optimizer is checked with
    them (`hpc_train.job.check_run` runs everything)."""
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
            raise LayoutError(
                f"train.global_batch_size={t.global_batch_size} != micro_batch_size x grad_accum x dp = "
                f"{t.micro_batch_size} x {t.grad_accum} x {dp} = {derived_gbs}; "
                f"set train.grad_accum={t.global_batch_size // (t.micro_batch_size * dp) or 1} or leave "
                "global_batch_size out"
            )
        check_skip_samples(cfg.data.skip_samples, derived_gbs)

    checks = [layout, lambda: check_pipeline(cfg)]
    if check_paths:
        data_keys = ("data.train_path", "data.valid_path")
        checks += [lambda key=key: check_data_path(key, _get(cfg, key)) for key in data_keys]
        for key in ("sources", "valid_sources"):
            checks += [lambda key=f"data.{key}[{i}].path", p=src.path: check_data_path(key, p)
                       for i, src in enumerate(getattr(cfg.data, key))]  # fmt: skip
    raise_all(checks)
    return dp


def raise_all(checks) -> None:
    """Run every check; raise one ConfigError holding all their messages, one per line (the layout's lines
    still known as such)."""
    problems, layout = [], []
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
            layout += err.layout
    if problems:
        raise ConfigError("\n".join(problems), layout)


def check_skip_samples(ranges: list[list[int]], global_batch: int) -> None:
    """data.skip_samples: [start, end) ranges of whole global batches (a sampler skips a batch, not a part)."""
    for start, end in (r if len(r) == 2 else (-1, -1) for r in ranges):
        if not 0 <= start < end or start % global_batch or end % global_batch:
            raise LayoutError(
                f"data.skip_samples={[list(r) for r in ranges]}: each range is [start, end) with 0 <= start < end, "
                f"both multiples of the global batch ({global_batch} samples), e.g. [[{global_batch}, "
                f"{2 * global_batch}]] skips the second step's batch"
            )


def check_pipeline(cfg: JobConfig) -> None:
    """Each schedule's stages per rank and micro-batches (train.grad_accum), and what torch's schedules with a
    split backward cannot run with."""
    p, ga = cfg.parallel, cfg.train.grad_accum
    if p.pp == 1 and p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} places several pipeline stages on each rank of a "
            "pipeline: set parallel.pp > 1, or parallel.virtual_stages=1"
        )
    if p.schedule == "1f1b" and p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved_1f1b, "
            "interleaved_zb, zbv or dualpipev (1f1b runs one stage per rank)"
        )
    if p.pp == 1:
        return
    if p.schedule in ("interleaved_1f1b", "interleaved_zb") and p.virtual_stages < 2:
        raise ConfigError(f"parallel.schedule={p.schedule} needs parallel.virtual_stages >= 2")
    if p.schedule in V_SHAPED and p.virtual_stages != 2:
        raise ConfigError(
            f"parallel.schedule={p.schedule} places exactly two stages per rank, in a V: set "
            f"parallel.virtual_stages=2 (not {p.virtual_stages})"
        )
    if ga < p.pp:
        raise ConfigError(
            f"train.grad_accum={ga} gives {ga} micro-batches per step, fewer than parallel.pp={p.pp} pipeline "
            f"stages; set train.grad_accum >= {p.pp} (more micro-batches also shrink the pipeline bubble)"
        )
    if p.schedule == "interleaved_1f1b" and ga % p.pp:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum={ga} to be a multiple of parallel.pp={p.pp}")
    rounds = ga // p.pp
    if p.schedule == "interleaved_zb" and ga % rounds:
        raise ConfigError(
            f"interleaved zero bubble runs train.grad_accum={ga} micro-batches in {rounds} rounds of parallel.pp="
            f"{p.pp}: set train.grad_accum to a multiple of {rounds} (a multiple of {p.pp} always is)"
        )
    if p.schedule == "dualpipev" and ga < 2 * p.pp:
        raise ConfigError(
            f"parallel.schedule=dualpipev needs at least as many micro-batches as its {2 * p.pp} stages: set "
            f"train.grad_accum >= {2 * p.pp} (now {ga})"
        )
    if p.schedule in SPLIT_BACKWARD and cfg.train.compile:
        raise ConfigError(
            f"parallel.schedule={p.schedule} splits each backward into its input and weight halves, which "
            "torch's pipelining does not support under torch.compile: set train.compile=false or "
            "parallel.schedule=1f1b / interleaved_1f1b"
        )


def check_data_path(key: str, prefix: str | None) -> None:
    if not prefix or prefix == BUILTIN_DATA:
        return
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(
                f"{key}={prefix!r}: '{prefix}{suffix}' does not exist; give the prefix of a dataset made by "
                f"`hpc-train prepare-data` (or Megatron-LM's preprocess_data.py), or {key}={BUILTIN_DATA} for the "
                "embedded corpus"
            )
