"""The config schema: one dataclass per section, each field with its default and, beside it, the rule its
value must follow (`choice`, `positive`, `non_negative`, `fraction`; checks.py applies them all). What
depends on the model family, the optimizer or the layout is checked by them (`hpc_train.job.check_run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_train.config.fields import choice, fraction, non_negative, positive

BUILTIN_DATA = "stdlib"  # data path naming the embedded corpus (the interpreter's own standard library)
BYTE_VOCAB = 257  # the byte-level tokenizer's vocabulary (256 bytes + end-of-document): the embedded corpus's


@dataclass(unsafe_hash=True)
class MoEConfig:
    """Mixture of experts in the feed-forward of every block from `first_dense_layers` on (models/common/moe.py).
    num_experts=0: a dense model. Checked in models/common/moe.py `validate_moe`."""

    num_experts: int = 0  # routed experts per MoE layer; 0 = dense
    top_k: int = 2  # routed experts per token
    num_shared_experts: int = 0  # experts every token goes through (DeepSeek), as one SwiGLU of this many widths
    expert_ffn_hidden: int | None = None  # each expert's hidden width; None = the dense MLP's
    first_dense_layers: int = 0  # the first N blocks keep the dense MLP (DeepSeek-V3: 3)
    score_func: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    # the chosen top_k scores renormalized to sum to 1 as gates (Mixtral, Qwen3-MoE, DeepSeek-V3); false: the
    # raw scores (Qwen2-MoE); None = true when top_k > 1, and false at top_k=1 (Switch), where a renormalized
    # single gate is 1 and the language-model loss gives the router no gradient
    norm_topk_prob: bool | None = None
    aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss weight; 0 = off
    # auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by this
    # rate towards the mean load (sign of the difference); 0 = off
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0  # 0 = dropless; else each expert takes ceil(cf * tokens * top_k / experts)
    grouped_mm: bool = True  # torch._grouped_mm for the experts where it runs; false: a loop over experts


@dataclass
class ModelConfig:
    arch: str = "llama"  # model family: llama | gpt2 (hpc_train/models)
    vocab_size: int = positive(BYTE_VOCAB)  # byte-level tokenizer: 256 bytes + end-of-document
    vocab_multiple: int = positive(128)  # embedding rows are padded to a multiple of this (x tp), as Megatron does
    n_layers: int = positive(4)
    n_heads: int = positive(4)
    n_kv_heads: int | None = positive(None)  # grouped-query attention; None = n_heads
    d_model: int = positive(128)
    # None = the family's: llama 8/3 * d_model rounded up to ffn_multiple, gpt2 4x
    ffn_hidden: int | None = positive(None)
    ffn_multiple: int = positive(64)
    seq_len: int = positive(128)  # the length trained on
    # the context the model is made for (GPT-2: its learned positions' count), which export-hf writes as the
    # source's max_position_embeddings / n_positions; None = seq_len. model.init_from sets it from the source,
    # so a model fine-tuned on shorter sequences keeps its context. seq_len may not exceed it
    max_position_embeddings: int | None = positive(None)
    rope_theta: float = positive(10000.0)
    norm_eps: float = positive(1e-5)
    tie_embeddings: bool | None = None  # output head shares the embedding; None = the family's (gpt2 ties)
    init_std: float = positive(0.02)
    # the head and loss run on this many tokens at a time, each chunk's logits recomputed in backward, so the
    # whole micro-batch's logits never exist at once (under sequence parallelism: whole sequences); 0 = one go
    loss_chunk_tokens: int = non_negative(2048)
    # start from these weights (step 0, fresh optimizer): a Hugging Face folder (config.json + safetensors) or
    # an hpc_train checkpoint / run directory; the architecture keys above are taken from it
    init_from: str | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts (models/common/moe.py)

    @property
    def context_len(self) -> int:
        """Positions the model serves: `max_position_embeddings`, or the trained length when unset."""
        return self.max_position_embeddings or self.seq_len


# parallel.schedule's schedules that place two stages per rank in a V, and those that split each backward into
# its input and weight halves (distributed/pipeline.py)
V_SHAPED = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


@dataclass
class ParallelConfig:
    nproc: int = positive(1)  # local processes when not started by Slurm or torchrun
    tp: int = positive(1)
    pp: int = positive(1)
    dp: int | None = None  # None = world_size / (tp * pp * cp)
    # context parallelism: each sample's sequence split over cp ranks (parallel.cp_mode: how attention
    # exchanges keys and values between them, features/context_parallel)
    cp: int = positive(1)
    # expert parallelism: each MoE layer's routed experts split over ep ranks carved from dp (ep divides dp)
    ep: int = positive(1)
    virtual_stages: int = positive(1)
    # 1f1b | interleaved_1f1b (virtual_stages >= 2) | interleaved_zb (zero bubble: backward split into its input
    # and weight halves) | zbv, dualpipev (V-shaped: virtual_stages = 2, rank r holds stages r and 2pp-1-r)
    schedule: str = choice("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
    sequence_parallel: bool = False
    backend: str = choice("auto", "nccl", "gloo")  # auto: nccl on CUDA, gloo on CPU
    timeout_s: int = positive(600)  # collective timeout: a dead rank ends the job instead of hanging it
    rendezvous_timeout_s: int = positive(300)  # every rank must have joined by then; the error names who did not
    # a step unfinished this long: every rank's stack to run_dir/hang, then stop; 0 = off
    hang_timeout_s: int = non_negative(300)
    # a rank process that dies: restart every rank in the job from the newest checkpoint
    max_restarts: int = non_negative(0)


@dataclass
class SpikeGuardConfig:
    """A finite loss spike rolled back (resilience/spikes.py): a step whose loss or gradient norm exceeds its
    ratio times the median of the last `window` clean steps makes every rank reload the newest checkpoint and
    read on past the data that led to it. Decided on the device, agreed at the loop's read of the figures."""

    enabled: bool = False
    window: int = positive(50)  # clean steps in the running medians; the guard watches once it is full
    loss_ratio: float = non_negative(1.5)  # a loss above this x its median is a spike; 0 = the loss not watched
    grad_norm_ratio: float = non_negative(10.0)  # likewise the gradient norm (before clipping); 0 = not watched
    # the samples skipped after a rollback: the spiking step's global batch, or every batch read since the
    # checkpoint rolled back to
    skip: str = choice("step", "since_checkpoint")
    max_rollbacks: int = positive(3)  # more rollbacks than this within `rollback_window` steps stop the run
    rollback_window: int = positive(1000)
    # a copy of the state in host memory at each save, so a rollback reads nothing back from disk; None = where
    # the planner's copy (parameters and optimizer state per rank) x the node's ranks fits in half of the
    # node's available memory
    memory_copy: bool | None = None


@dataclass
class TrainConfig:
    steps: int = positive(100)
    micro_batch_size: int = positive(8)
    grad_accum: int = positive(1)
    global_batch_size: int | None = positive(None)  # None = micro_batch_size * grad_accum * dp; if set it must match
    precision: str = choice("fp32", "bf16", "fp16")
    initial_loss_scale: float = positive(65536.0)  # fp16 only: dynamic loss scaling
    loss_scale_window: int = positive(1000)  # fp16: clean steps before the scale doubles
    seed: int = 1234
    device: str = choice("auto", "cpu", "cuda")
    eval_interval: int = non_negative(50)  # 0 = never
    eval_batches: int = positive(4)
    save_final_model: bool = True  # write run_dir/model_final.pt (consolidated weights) at the end
    freeze: list[str] = field(default_factory=list)  # parameter names (fnmatch patterns) held fixed
    skip_nonfinite: int = non_negative(0)  # steps with a non-finite loss or gradient skipped before the run stops
    spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)


@dataclass
class OptimConfig:
    # the update rule (optim/rules): adamw, muon (hidden-layer matrices by Muon, everything else by AdamW), or
    # adamw8bit / adamw4bit (AdamW with torchao's blockwise 8- or 4-bit moments: 2.03 / 1.06 bytes per element)
    name: str = "adamw"
    # resume a checkpoint of another update rule: its state is dropped and this rule's starts at zero (ZeRO's
    # fp32 master weights are kept). Without it such a resume is refused; with the same rule it does nothing
    reset_state: bool = False
    lr: float = non_negative(3e-4)
    min_lr: float = non_negative(3e-5)
    warmup_steps: int = non_negative(10)
    decay_steps: int | None = positive(None)  # None = train.steps
    weight_decay: float = non_negative(0.1)
    beta1: float = fraction(0.9)
    beta2: float = fraction(0.95)
    eps: float = positive(1e-8)
    grad_clip: float = non_negative(1.0)  # 0 = no clipping
    # 0 = plain data parallelism; sharded over dp: 1 = optimizer state, 2 = + gradients, 3 = + parameters (FSDP2)
    zero_stage: int = 0
    bucket_mb: float = non_negative(25.0)  # gradient reduction bucket size (stages 0-2)
    # cpu: the sharded optimizer state (stage 3: also the parameters) in host memory; nvme (AdamW, Muon): the fp32
    # master weights and the moments (stage 3: the moments; the parameters in host memory) in files under
    # offload_dir, streamed through offload_buffer_mb of host buffers at each update
    offload: str = choice("none", "cpu", "nvme")
    offload_dir: str | None = None  # nvme: a directory on each node's own disk ($VARS expanded on the node)
    offload_buffer_mb: float = positive(256.0)  # nvme: the host buffers the state streams through, in all
    # stage 3: free each block's gathered parameters after its forward (and all-gather them again for its
    # backward); None = true without pipeline parallelism, false with it (torchtitan's default: a pipeline
    # stage runs several forwards per step, and torch's schedules keep its parameters gathered until the
    # step's last backward anyway)
    reshard_after_forward: bool | None = None
    overlap_grad_reduce: bool = False  # start each bucket's dp reduction from backward, as soon as it is ready
    # muon: momentum, Nesterov, Newton-Schulz iterations, and how its lr is scaled per matrix shape
    # (match_rms_adamw: Moonlight's 0.2 sqrt(max(rows, cols)), so optim.lr serves AdamW's parameters and
    # Muon's alike; original: Keller Jordan's sqrt(max(1, rows / cols)))
    momentum: float = fraction(0.95)
    nesterov: bool = True
    ns_steps: int = positive(5)
    muon_adjust_lr: str = choice("match_rms_adamw", "original")
    # adamw8bit / adamw4bit: torch.compile torchao's update (one kernel per tensor shape); None = on CUDA
    # (on CPU inductor takes seconds per shape, and the eager update gives other roundings than the compiled)
    compile_update: bool | None = None


@dataclass
class DataSource:
    """One dataset of a blend (data.sources) or of the per-source evaluation (data.valid_sources)."""

    path: str = ""  # prefix of a .bin/.idx pair, or "stdlib" for the embedded corpus
    weight: float = 1.0  # its share of the training samples, before normalising (valid_sources: unused)
    name: str | None = None  # in metrics (train_tokens/<name>, eval_loss/<name>); None = the path's file name

    @property
    def label(self) -> str:
        """Its name in metrics and checkpoints."""
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class DataConfig:
    # prefix of a .bin/.idx pair (prepare-data's, or Megatron-LM's read as it is), or "stdlib" for the embedded
    # corpus
    train_path: str = BUILTIN_DATA
    valid_path: str | None = None  # None with "stdlib" = its held-out split; None otherwise = no eval
    # a weighted blend of datasets instead of train_path; weights are normalised; changing them (or adding a
    # source) on resume starts a new phase that continues each source where it stopped. Megatron-LM's blend
    # string ('0.3 /data/a 0.7 /data/b') is read as this list (config/blend_string.py)
    sources: list[DataSource] = field(default_factory=list)
    valid_sources: list[DataSource] = field(default_factory=list)  # each evaluated alone: eval_loss/<name>
    cache_dir: str = "${oc.env:HPC_TRAIN_CACHE,'~/.cache/hpc_train'}"  # where the embedded corpus is built
    # documents packed in a sample (from the datasets' document offsets): positions restart at each document
    # start; attention stays inside each document (FlexAttention on CUDA, query tiles on CPU: no seq x seq mask)
    reset_position_ids: bool = False
    document_mask: bool = False
    # global batches read and not trained on: [start, end) positions of the sample stream (the consumed_samples
    # of metrics.jsonl), each at global-batch boundaries (Megatron-LM's --skip-train-iteration-range, in samples).
    # Rollbacks of train.spike_guard add theirs to the sampler's checkpointed list
    skip_samples: list[list[int]] = field(default_factory=list)


MEMORY_DIR = "/dev/shm/hpc_train"  # in-memory checkpoints: a tmpfs, host memory that outlives the rank processes


@dataclass
class CheckpointConfig:
    """Sharded, verified checkpoints. A run resumes from the newest one that verifies in `dir`."""

    dir: str = "${run_dir}/checkpoints"
    # save every N steps (and at the end); 0 = only when preempted; auto = Daly's interval for checkpoint.mtbf_hours,
    # from the run's own save cost and step time (resilience/failures.py; `plan --mtbf-hours` prints it)
    interval: int | str = 0
    mtbf_hours: float | None = positive(None)  # a node's mean time between failures, for interval=auto
    keep_last: int = non_negative(3)  # committed checkpoints kept (the newest complete one is never deleted)
    keep_every: int = non_negative(0)  # also keep every K-th step forever; 0 = off
    # write in the background while training continues: auto = where each of a node's ranks has a core free
    # for it (ranks x (compute threads + 1) <= cores) or a GPU computes, else synchronously
    async_save: str = choice("auto", "true", "false")
    verify: str = choice("full", "sizes")  # full: sizes + checksums, every rank checking its share
    resume: bool = True
    io_threads: int = positive(1)  # per rank: files written, read and checksummed in parallel
    # node-local checkpoints (checkpoint/local.py), read by an in-job restart when newer than the shared one:
    # each rank's own state every local_interval steps in local_dir (environment variables expanded on each
    # node: $SLURM_TMPDIR, /tmp/ckpt/$SLURMD_NODENAME), and a copy on the rank at its place on the next node
    local_dir: str | None = None
    local_interval: int = non_negative(0)  # 0 = no local checkpoints
    # in-memory checkpoints every N steps (1 = every step): node-local checkpoints kept in host memory
    # (MEMORY_DIR, a tmpfs) and at the partner, saved as async_save decides; instead of local_dir/local_interval
    memory_interval: int = non_negative(0)

    @property
    def saves_locally(self) -> bool:
        """Node-local checkpoints are on (both keys set), on disk or in memory."""
        return bool(self.local_dir and self.local_interval) or bool(self.memory_interval)

    @property
    def local_every(self) -> int:
        """Steps between node-local saves, on disk or in memory."""
        return self.memory_interval or self.local_interval

    @property
    def asynchronous(self) -> bool | None:
        """async_save as given (YAML's and the command line's true/false arrive as "True"/"False"); None: auto."""
        return None if self.async_save == "auto" else self.async_save.lower() == "true"


@dataclass
class SlurmConfig:
    """The sbatch job `hpc-train submit` generates (through submitit): one task per rank (per GPU). Every
    command checks these values (checks.py), since the config a local run records may be submitted later."""

    nodes: int = positive(1)
    tasks_per_node: int = positive(1)
    gpus_per_node: int = non_negative(0)  # 0 = CPU job; otherwise must equal tasks_per_node
    gpu_mem_gb: float = positive(80.0)  # per GPU (GiB): `submit` refuses a layout the planner says does not fit
    cpus_per_task: int | None = positive(None)  # None = Slurm's default
    mem: str | None = None  # e.g. 200G, or 0 for all of a node's memory
    time: str = "01:00:00"  # MM, HH:MM:SS or D-HH:MM:SS
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None  # None = name
    log_dir: str | None = None  # None = <run_dir>/slurm
    # Slurm sends the preemption/time-limit warning signal this long before the end
    signal_delay_s: int = non_negative(120)
    max_requeues: int = non_negative(3)  # how often a preempted or timed-out job is requeued
    setup: list[str] = field(default_factory=list)  # shell lines before srun: module loads, exports
    extra: dict[str, str] = field(default_factory=dict)  # more #SBATCH directives, e.g. {mail-type: END}
    # `hpc-train sweep` and `ladder`: at most this many of the job array's members run at once; 0 = all
    array_parallelism: int = non_negative(0)


@dataclass
class WandbConfig:
    """Weights & Biases, from rank 0 (the optional extra `.[wandb]`). The W&B run id is the run's own (its
    run directory's), so a requeued or restarted job, or a later submission, continues the same W&B run."""

    project: str | None = None  # None = off
    entity: str | None = None  # None = W&B's default for the login
    mode: str = choice("online", "offline")  # offline: files under run_dir/wandb, `wandb sync` them later


@dataclass
class LoggingConfig:
    log_interval: int = positive(1)
    progress: str = choice("auto", "bar", "lines", "none")  # auto: a bar on a terminal, lines otherwise
    breakdown: bool = False  # per-step time of forward+backward, gradient reduction, optimizer, bubble estimate
    profile_steps: list[int] = field(default_factory=list)  # [a, b]: torch.profiler trace of steps a..b
    # step N's peak of live tensor bytes on rank 0, into its record's memory_bytes (profiled: 0 = off)
    measure_peak_step: int = non_negative(0)
    tensorboard: bool = False  # also write the metrics to <run_dir>/tensorboard
    # every N steps: name the ranks whose compute is slower than their peers' median; 0 = off
    straggler_interval: int = non_negative(50)
    straggler_threshold: float = non_negative(0.2)  # ... by more than this fraction
    # a straggler this many times the median has its node excluded next time; 0 = never
    straggler_blame: float = non_negative(0.0)
    # the peak FLOP/s MFU is reported against: the GPU's dense bf16 peak, or its dense fp8 peak (twice the
    # bf16 one on Hopper; for train.fp8 runs that want the honest ratio)
    mfu_peak: str = choice("bf16", "fp8")
    wandb: WandbConfig = field(default_factory=WandbConfig)  # also log to Weights & Biases (observe/wandb_log.py)


@dataclass
class EvalConfig:
    """Downstream tasks through lm-evaluation-harness inside the training loop (the optional extra `.[eval]`),
    scored by the training ranks with the requests sharded over dp; their figures go into metrics.jsonl as
    `downstream/<task>/<metric>` (train/downstream.py). Tasks that generate text are left to `hpc-train eval`."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task names, e.g. [hellaswag, arc_easy]; [] = off
    task_interval: int = non_negative(0)  # every N steps and at the last; 0 = at the last step only
    limit: int = positive(64)  # at most this many examples a task
    include_path: str | None = None  # a folder of task YAML files of your own (lm-eval's include_path)
    tokenizer: str | None = None  # a tokenizer.json; None = the one the training data was prepared with


@dataclass
class JobConfig:
    name: str = "run"
    run_dir: str = "runs/${name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
