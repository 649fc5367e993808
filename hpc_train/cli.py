"""The `hpc-train` command: train, submit, stop, status, plan, config show, ckpt, prepare-data, import-hf, export-hf,
generate."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpc_train.bootstrap import detect_rank_env
from hpc_train.config import ConfigError, check_values, config_path, raise_all, to_yaml
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.errors import UserError
from hpc_train.job import JobConfig, check_run, load_config

if TYPE_CHECKING:
    from hpc_train.resilience.failures import FailurePlan

SLURM_WORLD = "slurm.nodes x slurm.tasks_per_node"  # a Slurm job's world size, in its layout errors


def check_job(
    cfg: JobConfig, world_size: int, starts_here: bool, check_paths: bool = True, world_from: str = ""
) -> ParallelDims:
    """The one check every CLI command that resolves a config runs before it starts or submits anything
    (train, submit and its dry run, doctor, plan, config show, import-hf), so the same bad input gets the same
    error from each. Every key's own rule, the slurm section's included, holds wherever the command runs (a
    config is one document: what a local run records may be submitted later), and then `check_run`'s layout
    for `world_size` (`world_from` names where that came from, in the layout's errors). This machine's limits
    (`check_machine`) apply only where the ranks start here (`starts_here`): train and doctor --local started
    alone, import-hf, and `config show` outside a job, which reports what `train` here would refuse. A
    submitted job runs on the cluster's nodes, `plan` sizes a layout for any machine, and a rank started by
    srun or torchrun was placed by its launcher, so none of them is bound by this machine."""
    raise_all([lambda: check_values(cfg), *([lambda: check_machine(cfg)] if starts_here else [])])
    try:
        return check_run(cfg, world_size, check_paths, here=starts_here)
    except ConfigError as err:
        if not world_from:
            raise
        raise err.noting_layout(f"(world size = {world_from} = {world_size})") from None


def check_machine(cfg: JobConfig) -> None:
    """A run launched here fits this machine: its device exists and one process per GPU (NCCL's rule), or a
    bounded number of CPU processes (each needs a core's share and its own memory). What a feature needs of
    the machine it checks itself (`check_run`'s `here`)."""
    problems = []
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        problems.append("train.device=cuda but this machine has no CUDA device visible; use train.device=cpu")
    cores = len(os.sched_getaffinity(0))
    if cuda and torch.cuda.is_available():
        limit, what = torch.cuda.device_count(), f"one per GPU ({torch.cuda.device_count()} here)"
    else:
        limit, what = 4 * cores, f"4 per CPU core ({cores} here)"
    if cfg.parallel.nproc > limit:
        problems.append(f"parallel.nproc={cfg.parallel.nproc} local processes exceed {what}; use parallel.nproc <= "
                        f"{limit}, or `hpc-train submit` to run on a cluster")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def _config_items(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The config file and the overrides. CONFIG is optional: a first argument holding '=' is already an
    override."""
    items = [args.config, *args.overrides] if args.config else list(args.overrides)
    return (items.pop(0) if items and "=" not in items[0] else None), items


def _config_and_overrides(args: argparse.Namespace) -> JobConfig:
    from hpc_train.checkpoint.init_from import with_source_model

    return with_source_model(load_config(*_config_items(args)))


def check_inputs(
    cfg: JobConfig, world: int, starts_here: bool, world_from: str = "", notes: bool = True, in_job: bool = False
) -> ParallelDims:
    """Everything a run reads, before any process starts: the config (`check_job`: for this world size, and
    this machine's limits for ranks starting here), the datasets' contents, that checkpoint.dir is this run's
    (and, for a run starting here, not in use) and, outside a job (`in_job`: its rank 0 checks them as it
    starts), eval.tasks. With `notes` (one process of a job says it), a training dataset the run reads more
    than once is noted (on stderr: a dry run's output stays the job)."""
    from hpc_train.checkpoint.ownership import check_checkpoint_dir
    from hpc_train.data.prepare import check_datasets, repeats

    dims = check_job(cfg, world, starts_here, world_from=world_from)
    if cfg.logging.wandb.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.project is set but wandb is not installed here: pip install "
                          "'hpc_train[wandb]' (the job needs it too), or unset logging.wandb.project")  # fmt: skip
    if cfg.eval.tasks and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eval.tasks is set but lm-evaluation-harness is not installed here: pip install "
                          "'hpc_train[eval]' (the job needs it too), or unset eval.tasks")  # fmt: skip
    if cfg.eval.tasks and not in_job:
        from hpc_train.train.lm_eval_model import check_eval

        check_eval(cfg)
    datasets = check_datasets(cfg.data, cfg.model)
    check_checkpoint_dir(cfg, probe_lock=starts_here)
    t = cfg.train
    global_batch = dims.dp * t.micro_batch_size * t.grad_accum
    for line in repeats(cfg.data, datasets, t.steps * global_batch, global_batch) if notes else []:
        print(f"hpc-train: note: {line}", file=sys.stderr)
    return dims


def cmd_train(args: argparse.Namespace) -> None:
    from hpc_train.launch.local import launch_local
    from hpc_train.resilience.restart import run_task
    from hpc_train.train.loop import run_training

    cfg = _config_and_overrides(args)
    rank_env = detect_rank_env()
    world = rank_env.world_size if rank_env else cfg.parallel.nproc
    check_inputs(cfg, world, starts_here=rank_env is None, notes=rank_env is None or rank_env.rank == 0,
                 in_job=rank_env is not None)  # fmt: skip
    if rank_env is not None:
        run_task(run_training, rank_env, cfg)
    else:
        launch_local(run_training, cfg.parallel.nproc, cfg, max_restarts=cfg.parallel.max_restarts)


def cmd_config_show(args: argparse.Namespace) -> None:
    """The resolved config, then `check_job` as `train` here would run it (without reading the data): outside
    a job, for parallel.nproc local ranks and this machine's limits."""
    cfg = _config_and_overrides(args)
    print(to_yaml(cfg), end="")
    rank_env = detect_rank_env()
    world = rank_env.world_size if rank_env else cfg.parallel.nproc
    dims = check_job(cfg, world, starts_here=rank_env is None, check_paths=False)
    print(f"# valid for world size {world}: {describe(dims)}", file=sys.stderr)


def describe(dims: ParallelDims, sep: str = " ") -> str:
    return sep.join(f"{dim}={size}" for dim, size in dims.as_dict().items())


def cmd_plan(args: argparse.Namespace) -> None:
    """The plan of the config's layout, or with --search every layout's; exit status 1 where the layout (with
    --search: every layout) does not fit, with the nearest fix."""
    import json

    from hpc_train import planner
    from hpc_train.resilience.failures import failure_figures, format_failure_plan

    cfg = _config_and_overrides(args)
    flags = (("--world", args.world), ("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem),
             ("--peak-tflops", args.peak_tflops), ("--mtbf-hours", args.mtbf_hours),
             ("--failures-per-day", args.failures_per_day), ("--save-s", args.save_s),
             ("--restart-s", args.restart_s), ("--step-s", args.step_s))  # fmt: skip
    for flag, value in flags:
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{flag} {value} must be a positive number")
    world = args.world or planner.plan_world(cfg)
    gpu_mem = args.gpu_mem * 2**30 if args.gpu_mem else cfg.slurm.gpu_mem_gb * 2**30
    if args.search:
        if any(v is not None for v in (args.mtbf_hours, args.failures_per_day, args.save_s, args.restart_s,
                                       args.step_s)):  # fmt: skip
            raise ConfigError("--mtbf-hours and the failure options plan one layout's checkpoints: drop --search")
        check_values(cfg)  # check_job's rules for every key; the layout is what --search varies
        host_mem = args.host_mem * 2**30 if args.host_mem else None
        report = planner.search_report(cfg, world, gpu_mem, args.peak_tflops * 1e12, host_mem, args.allow_rule_change)
        print(json.dumps(report, indent=1) if args.json else planner.format_report(report))
        if report["fix"]:  # nothing fits
            sys.exit(1)
        return
    dims = check_job(cfg, world, starts_here=False, check_paths=False)
    plan = planner.estimate(cfg, dims)
    fits = plan.total <= gpu_mem
    limits = planner.Limits(world, gpu_mem, node=cfg.slurm.gpus_per_node or 8)
    fix = None if fits else planner.nearest_fix(cfg, limits, args.peak_tflops * 1e12)
    failures = _failure_plan(args, cfg, dims)
    if args.json:
        print(json.dumps({**plan.as_dict(), "fits": fits, "gpu_mem": gpu_mem, "fix": fix,
                          **({"failures": failure_figures(failures)} if failures else {})}, indent=1))  # fmt: skip
    else:
        print(planner.format_estimate(cfg, dims, plan, gpu_mem), *[planner.format_fix(fix, plan.total)] * (not fits),
              *([format_failure_plan(failures)] if failures else []), sep="\n")  # fmt: skip
    if not fits:
        sys.exit(1)


def _failure_plan(args: argparse.Namespace, cfg: JobConfig, dims: ParallelDims) -> FailurePlan | None:
    """--mtbf-hours / --failures-per-day: the checkpoint interval and goodput they call for (None without)."""
    from hpc_train import planner
    from hpc_train.resilience.failures import failure_plan, job_mtbf_s

    if args.mtbf_hours is None and args.failures_per_day is None:
        if any(v is not None for v in (args.save_s, args.restart_s, args.step_s)):
            raise ConfigError("--save-s, --restart-s and --step-s go with --mtbf-hours or --failures-per-day")
        return None
    if args.mtbf_hours is not None and args.failures_per_day is not None:
        raise ConfigError("give --mtbf-hours (a node's) or --failures-per-day (the job's), not both")
    given = {"step_s": args.step_s, "save_s": args.save_s, "restart_s": args.restart_s}  # checked by cmd_plan
    nodes = math.ceil(dims.world_size / cfg.slurm.tasks_per_node) if cfg.slurm.gpus_per_node else 1
    mtbf = job_mtbf_s(args.mtbf_hours, nodes, args.failures_per_day)
    estimated = planner.step_time_estimate(cfg, dims, args.peak_tflops * 1e12)
    try:
        interval = cfg.checkpoint.interval if isinstance(cfg.checkpoint.interval, int) else 0  # auto: none given
        return failure_plan(mtbf, given, cfg.run_dir, estimated, interval)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_fits(cfg: JobConfig, dims: ParallelDims) -> None:
    """Before a GPU job is submitted: the planner's total per rank against slurm.gpu_mem_gb."""
    from hpc_train import planner

    if not cfg.slurm.gpus_per_node:
        return
    plan, gpu_mem = planner.estimate(cfg, dims), cfg.slurm.gpu_mem_gb * 2**30
    if plan.total > gpu_mem:
        raise ConfigError(
            "the planner says this layout does not fit (use --force to submit anyway, or `hpc-train plan "
            f"CONFIG --search` for layouts that do):\n{planner.format_estimate(cfg, dims, plan, gpu_mem)}"
        )


def check_host_fits(cfg: JobConfig, dims: ParallelDims) -> None:
    """Before a job is submitted: the host memory the planner says a node's ranks need against what a node
    has, so a job that cannot fit is refused here rather than killed by the node's OOM killer. A rank needs
    its host bytes (offloaded state, the ring, activation offload's copies), its state copy where it is sure
    to be kept (node-local checkpoints, or train.spike_guard.memory_copy=true: unset, a run drops a copy
    that does not fit), and on a CPU job everything else it holds too."""
    from hpc_train import planner
    from hpc_train.launch import slurm

    node = slurm.node_memory_mb(cfg)
    if node is None:
        return
    node_mb, source = node
    sure_copy = cfg.checkpoint.saves_locally or cfg.train.spike_guard.memory_copy is True
    on_cpu = not cfg.slurm.gpus_per_node
    per_rank = max(plan.host + plan.host_copy * sure_copy + plan.total * on_cpu
                   for plan in planner.stage_estimates(cfg, dims))  # fmt: skip
    need_mb = math.ceil(cfg.slurm.tasks_per_node * per_rank / 2**20)
    if need_mb > node_mb:
        what = "the planner's host bytes" + (", on a CPU job all a rank holds" if on_cpu else "")
        fix = "optim.offload=nvme (the state on the node's disk), " if cfg.optim.offload == "cpu" else ""
        fix += "a larger slurm.mem, " if source.startswith("slurm.mem") else "a partition with more memory, "
        raise ConfigError(
            f"the {cfg.slurm.tasks_per_node} ranks of a node need {need_mb} MB of host memory "
            f"({math.ceil(per_rank / 2**20)} MB each: {what}), "
            f"more than the {node_mb} MB a node has ({source}): use {fix}fewer slurm.tasks_per_node over more "
            "slurm.nodes, or `hpc-train plan CONFIG --search --host-mem GIB` for layouts that fit (--force "
            "submits anyway)"
        )


def world_note(cfg: JobConfig, dims: ParallelDims) -> str:
    """Where `submit` and `train` here would run a config with different world sizes (slurm.nodes x
    slurm.tasks_per_node against parallel.nproc), what each gives and the key that makes them agree; ''
    where they agree."""
    nproc, nodes, per_dp = cfg.parallel.nproc, cfg.slurm.nodes, dims.world_size // dims.dp
    if nproc == dims.world_size:
        return ""
    batch = cfg.train.micro_batch_size * cfg.train.grad_accum  # a data-parallel rank's share of the global batch
    here = f", global batch {nproc // per_dp * batch}" if nproc % per_dp == 0 else ""
    tasks = f"slurm.tasks_per_node={nproc // nodes}" + (
        f" slurm.gpus_per_node={nproc // nodes}" * bool(cfg.slurm.gpus_per_node)
    )
    fix = tasks if nproc % nodes == 0 else f"{SLURM_WORLD} = {nproc}"
    return (f"note: this job runs {dims.world_size} rank(s) ({SLURM_WORLD} = {nodes} x {cfg.slurm.tasks_per_node}), "
            f"global batch {dims.dp * batch}; `hpc-train train` here would run parallel.nproc={nproc}{here} (submit "
            f"does not use parallel.nproc): set {fix} for the same run")  # fmt: skip


def check_submission(cfg: JobConfig, force: bool, notes: bool = True, queued: list | None = None) -> ParallelDims:
    """What `submit` checks of a run before its job is submitted (the partition apart): its inputs for the job's
    world size, the planner's memory against the GPUs and the nodes (unless `force`), and that no job in the
    queue (`queued`, else squeue's now) already runs its run directory."""
    from hpc_train.launch import slurm
    from hpc_train.launch.queue import check_no_job_runs

    dims = check_inputs(cfg, slurm.slurm_world_size(cfg), starts_here=False, world_from=SLURM_WORLD, notes=notes)
    if not force:
        check_fits(cfg, dims)
        check_host_fits(cfg, dims)
    check_no_job_runs(cfg.run_dir, queued)
    return dims


def cmd_submit(args: argparse.Namespace) -> None:
    from hpc_train.launch import slurm
    from hpc_train.launch.partition import check_partition
    from hpc_train.train.loop import run_training

    cfg = _config_and_overrides(args)
    dims = check_submission(cfg, args.force)
    check_partition(cfg, limits=not args.force)
    note = world_note(cfg, dims)
    if args.dry_run:
        path, overrides = _config_items(args)  # the by-hand script's: the config from any directory
        train_args = [*([str(config_path(path).absolute())] if path else []), *overrides]
        print(f"# {note}" if note else "", slurm.dry_run(cfg, describe(dims, ", "), train_args), sep="\n" * bool(note),
              end="")  # fmt: skip
        return
    job = slurm.submit(cfg, run_training)
    print(*[note] * bool(note), slurm.submission_summary(cfg, job), sep="\n", flush=True)
    if args.wait:
        _follow(cfg, job)


def cmd_sweep(args: argparse.Namespace) -> None:
    """A job array of the config's runs over the swept values (launch/sweep.py); --local: one after another
    here. Every member is checked before anything is submitted, and a finished member is skipped."""
    from hpc_train.launch import sweep

    path, items = _config_items(args)
    shared, axes = sweep.sweep_axes(items)
    if not axes:
        raise ConfigError("nothing to sweep: give a key with several values, e.g. optim.lr=1e-3,3e-3 (or use submit)")
    values = sweep.combinations(axes, args.zip)
    run_sweep(args, path, shared, [sweep.Member(sweep.member_label(v), v) for v in values])


def run_sweep(args: argparse.Namespace, path: str | None, shared: list[str], members: list) -> None:
    """Check, then submit (or list, or run here) a sweep's members, each the config at `path` with the `shared`
    overrides and its own values: `sweep` and `ladder`'s last part."""
    from hpc_train.checkpoint.init_from import with_source_model
    from hpc_train.launch import slurm, sweep
    from hpc_train.launch.partition import check_partition
    from hpc_train.launch.queue import queued_runs
    from hpc_train.train.loop import run_training

    base, members = sweep.load_members(lambda overrides: with_source_model(load_config(path, overrides)), shared,
                                       members)  # fmt: skip
    sweep.check_sweep_dir(base)
    problems, done = [], [sweep.finished(m.cfg) for m in members]
    queued = None if args.local else queued_runs()  # one squeue for every member's check
    for member, finished in zip(members, done, strict=True):
        if finished:
            continue
        try:
            if args.local:
                check_inputs(member.cfg, member.cfg.parallel.nproc, starts_here=True, notes=False)
            else:
                check_submission(member.cfg, args.force, notes=False, queued=queued)
        except ConfigError as err:
            problems.append(sweep.in_member(member.label, str(err)))
    if problems:
        raise ConfigError("\n".join(problems))
    todo = [m for m, finished in zip(members, done, strict=True) if not finished]
    print(f"sweep {base.run_dir}: {len(members)} member(s), {len(todo)} to run", sweep.format_members(members, done),
          sep="\n", flush=True)  # fmt: skip
    if not todo or (args.local and args.dry_run):  # a dry run here: the list alone
        return
    if args.local:
        sweep.write_manifest(base, sweep.with_members(base, members)[0])
        run_here(base, todo)
        return
    check_partition(base, limits=not args.force)
    if args.dry_run:
        print(f"# ---- sbatch script of the job array (task i runs the i-th member to run) ----\n"
              f"{sweep.array_script(base, todo)}", end="")  # fmt: skip
        return
    jobs = sweep.submit_array(base, todo, run_training)
    print(f"submitted job array {jobs[0].job_id.split('_')[0]} ({len(jobs)} task(s), at most "
          f"{base.slurm.array_parallelism or len(jobs)} at once); logs in {slurm.log_folder(base)}; "
          f"`hpc-train runs {base.run_dir}` shows the members", flush=True)  # fmt: skip
    if args.wait:
        _follow_array(base, todo, jobs)


def run_here(base: JobConfig, members: list) -> None:
    """--local: every member in turn on this machine; a member that fails is reported and the rest still run."""
    from hpc_train.launch.local import launch_runs
    from hpc_train.train.loop import run_training

    failed = []
    for n, member in enumerate(members, 1):
        cfg = member.cfg
        print(f"member {n}/{len(members)}: {cfg.name} in {cfg.run_dir}", flush=True)
        try:  # launch_runs: a member in this process compiles afresh, as in a process of its own
            launch_runs(cfg.parallel.nproc, [(run_training, (cfg,))], max_restarts=cfg.parallel.max_restarts)
        except Exception as err:  # noqa: BLE001 (the member's ranks printed theirs; the next member runs)
            print(f"member {cfg.name} failed: {err}", file=sys.stderr, flush=True)
            failed.append(cfg.name)
    if failed:
        raise UserError(f"{len(failed)} member(s) of {base.run_dir} failed: {', '.join(failed)}; running the same "
                        "sweep again resumes them")  # fmt: skip


def _follow_array(base: JobConfig, members: list, jobs: list) -> None:
    """Wait for every task of the array to end; a line per member, and exit 1 where one did not complete."""
    from hpc_train.launch import slurm

    ended = slurm.wait_for_jobs({f"member {member.label}": job for member, job in zip(members, jobs, strict=True)})
    states = [ended[f"member {member.label}"] for member in members]
    failed = [i for i, state in enumerate(states) if state != "COMPLETED" and slurm.stopped_at(jobs[i]) is None]
    for i in failed:
        cfg = members[i].cfg
        print(f"member {members[i].label}:", slurm.failure_report(jobs[i], cfg.slurm.nodes * cfg.slurm.tasks_per_node),
              file=sys.stderr)  # fmt: skip
    if failed:
        sys.exit(1)


def cmd_runs(args: argparse.Namespace) -> None:
    from hpc_train.commands.runs import plot_runs, runs_table

    table, rows = runs_table(args.run_dirs)
    print(table)
    if args.plot:
        print(f"curves drawn in {plot_runs(rows, args.plot)}")


def cmd_ladder(args: argparse.Namespace) -> None:
    """`ladder CONFIG --sizes ...`: a model of each size with its token budget, submitted as a sweep (members
    zipped); `ladder fit DIR`: loss against compute as a power law (commands/ladder.py)."""
    from hpc_train.checkpoint.init_from import with_source_model
    from hpc_train.commands import ladder
    from hpc_train.launch import slurm, sweep

    if args.config == "fit":
        cmd_ladder_fit(args)
        return
    if not args.sizes:
        raise ConfigError("ladder needs --sizes, e.g. --sizes 1M,3M,10M (or `hpc-train ladder fit DIR`)")
    path, shared = _config_items(args)
    base = with_source_model(load_config(path, shared))
    world = base.parallel.nproc if args.local else slurm.slurm_world_size(base)
    dims = check_job(base, world, starts_here=False, check_paths=False)
    shapes = ladder.ladder_shapes(base, ladder.parse_sizes(args.sizes), args.tokens_per_param, dims.dp)
    members = [sweep.Member(ladder.size_label(shape["params"]), {key: "null" if value is None else str(value)
               for key, value in shape["overrides"].items()}) for shape in shapes]  # fmt: skip
    run_sweep(args, path, shared, members)


def cmd_ladder_fit(args: argparse.Namespace) -> None:
    from hpc_train.commands import ladder
    from hpc_train.commands.runs import run_dirs

    if len(args.overrides) != 1:
        raise UserError("ladder fit takes one directory: hpc-train ladder fit DIR [--target 1B] [--plot FILE]")
    where = args.overrides[0]
    dirs = run_dirs([where])
    points, skipped = ladder.ladder_points(dirs)
    for reason in skipped:
        print(f"hpc-train: note: {reason}", file=sys.stderr)
    fit = ladder.fit_power_law([(compute, loss) for _, compute, loss in points])
    names = [name for name, _, _ in points]
    print(ladder.format_fit(fit, names))
    target = None
    if args.target:  # the largest fitted member's config: the family and its rule
        largest = next(d for d in dirs if d.name == max(points, key=lambda point: point[1])[0])
        cfg = load_config(saved=(largest / "config.yaml").read_text())
        compute, loss = ladder.predict_target(fit, cfg, ladder.parse_sizes(args.target)[0], args.tokens_per_param)
        print(f"predicted at {args.target} parameters ({compute:.3g} FLOPs at {args.tokens_per_param:g} tokens per "
              f"parameter): loss {loss:.4f}")  # fmt: skip
        target = compute
    try:
        plot = ladder.plot_fit(fit, names, Path(args.plot or Path(where) / "ladder_fit.png"), target)
    except ImportError:
        print("hpc-train: note: no plot: matplotlib is not installed (pip install 'hpc_train[viz]')", file=sys.stderr)
        return
    print(f"plot: {plot}")


def _follow(cfg: JobConfig, job) -> None:
    """Stream rank 0's output to the job's end; a job that did not complete exits 1 with the failing log."""
    from hpc_train.launch import slurm

    state = slurm.follow(job)
    if (step := slurm.stopped_at(job)) is not None:  # a user's stop: saved, and not requeued
        print(f"job {job.job_id} stopped on request at step {step}, saved (Slurm state {state}); submitting the "
              "same config resumes it")  # fmt: skip
        return
    print(f"job {job.job_id} finished: {state}")
    if state != "COMPLETED":
        print(slurm.failure_report(job, cfg.slurm.nodes * cfg.slurm.tasks_per_node), file=sys.stderr)
        sys.exit(1)


def cmd_stop(args: argparse.Namespace) -> None:
    """Stop each run's job: it saves and ends without requeueing (a pending one is cancelled)."""
    import time

    from hpc_train.commands.status import format_status, status_rows
    from hpc_train.launch import queue

    for run_dir in args.run_dirs:
        done = queue.stop(run_dir)
        print("\n".join(done) if done else f"no job in the queue runs {run_dir}")
    waited = 0
    while args.wait and any(queue.jobs_of(run_dir) for run_dir in args.run_dirs):
        time.sleep(1)
        waited += 1
        for run_dir in args.run_dirs if waited % 5 == 0 else []:  # a job requeued or started meanwhile: again
            queue.stop(run_dir)
    if args.wait:
        print(format_status(status_rows(args.run_dirs)))


def cmd_status(args: argparse.Namespace) -> None:
    from hpc_train.commands.status import format_status, status_rows

    print(format_status(status_rows(args.run_dirs)))


def cmd_doctor(args: argparse.Namespace) -> None:
    from hpc_train.commands.doctor import run_doctor
    from hpc_train.launch import slurm
    from hpc_train.launch.local import launch_local
    from hpc_train.launch.partition import check_partition

    cfg = _config_and_overrides(args)  # a doctor job is never restarted: a failure is its finding
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, max_restarts=0))
    if args.local:
        check_job(cfg, cfg.parallel.nproc, starts_here=True, check_paths=False)
        launch_local(run_doctor, cfg.parallel.nproc, cfg)
        return
    check_job(cfg, slurm.slurm_world_size(cfg), starts_here=False, check_paths=False, world_from=SLURM_WORLD)
    check_partition(cfg)
    job = slurm.submit(cfg, run_doctor)
    print(slurm.submission_summary(cfg, job), flush=True)
    _follow(cfg, job)


def cmd_ckpt(args: argparse.Namespace) -> None:
    """list / verify / inspect / convert the checkpoints of a run directory (or a checkpoints directory)."""
    from hpc_train.checkpoint.init_from import checkpoint_store
    from hpc_train.checkpoint.safe_load import read_dcp_metadata

    if args.ckpt_command == "convert":
        cmd_ckpt_convert(args)
        return
    if args.out is not None or args.to is not None:
        raise UserError(f"ckpt {args.ckpt_command} takes a directory alone; OUT and --to are for ckpt convert")
    store = checkpoint_store(args.run_dir)
    infos = [store.verify(info, full=args.ckpt_command == "verify") for info in store.scan()]
    if not infos:
        raise FileNotFoundError(f"no checkpoints under {store.root}")
    if args.ckpt_command == "inspect":
        chosen = next((i for i in infos if args.step in (None, i.step) and i.problem is None), None)
        if chosen is None:
            raise FileNotFoundError(f"no usable checkpoint{'' if args.step is None else f' of step {args.step}'}")
        print(f"{chosen.path} (step {chosen.step}, layout {chosen.manifest['layout']})")
        metadata = read_dcp_metadata(chosen.path, set(chosen.manifest["files"]))
        for key, meta in sorted(metadata.state_dict_metadata.items()):
            shape = tuple(getattr(meta, "size", ())) or "-"
            dtype = getattr(getattr(meta, "properties", None), "dtype", "")
            print(f"  {key:<48} {shape!s:<16} {dtype}")
        return
    latest = store.latest_pointer()
    print(f"{'checkpoint':<22} {'step':>8} {'size MB':>9}  {'layout':<40} status")
    for info in infos:
        size = sum(f.stat().st_size for f in info.path.iterdir() if f.is_file()) / 2**20
        layout = info.manifest["layout"] if info.manifest else {}
        short = " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "zero_stage") if k in layout)
        status = "ok" if info.problem is None else f"UNUSABLE: {info.problem}"
        mark = " (latest)" if info.path.name == latest else ""
        print(f"{info.path.name:<22} {info.step:>8} {size:>9.1f}  {short:<40} {status}{mark}")
    if args.ckpt_command == "verify" and any(i.problem for i in infos):
        sys.exit(1)


def cmd_ckpt_convert(args: argparse.Namespace) -> None:
    """A checkpoint as one file (torch, safetensors) or a stock DCP directory, for tools without hpc_train."""
    from hpc_train.checkpoint.export import chosen_checkpoint, convert, refuse_existing

    if args.out is None or args.to is None:
        raise UserError("ckpt convert needs OUT and --to: hpc-train ckpt convert CKPT OUT --to torch|safetensors|dcp")
    refuse_existing(args.out)  # before the checkpoint's checksums are read
    info = chosen_checkpoint(args.run_dir, args.step)
    done = convert(info, args.out, args.to)
    print(f"wrote {done.path} ({args.to}, step {info.step} of {info.path}): {done.tensors} tensors, "
          f"{done.bytes:,} bytes")  # fmt: skip


def cmd_import_hf(args: argparse.Namespace) -> None:
    from hpc_train.commands.convert import import_config, import_hf
    from hpc_train.launch.local import launch_local

    cfg = import_config(args.hf_dir, args.ckpt_dir, args.overrides)
    dims = check_job(cfg, cfg.parallel.nproc, starts_here=True, check_paths=False)
    launch_local(import_hf, cfg.parallel.nproc, cfg)
    print(f"imported {args.hf_dir} into {args.ckpt_dir} ({describe(dims)}); start a run from it with "
          f"model.init_from={args.ckpt_dir}")  # fmt: skip


def cmd_export_hf(args: argparse.Namespace) -> None:
    from hpc_train.commands.convert import export_hf
    from hpc_train.launch.local import single_process_group

    with single_process_group():
        out = export_hf(args.source, args.out_dir, args.adapters_only, args.base, args.tokenizer)
    what = "LoRA adapters (PEFT format)" if args.adapters_only else "model"
    note = "" if (out / "tokenizer.json").is_file() else " (no tokenizer: none is recorded for it; give --tokenizer)"
    print(f"exported the {what} of {args.source} to {out}{note}")


def cmd_generate(args: argparse.Namespace) -> None:
    from hpc_train.commands.convert import load_model
    from hpc_train.commands.generate import generate, pick_tokenizer
    from hpc_train.launch.local import single_process_group

    if not 0 < args.top_p <= 1 or args.temperature < 0 or args.max_new_tokens < 1:
        raise ConfigError("--top-p must be in (0, 1], --temperature >= 0 and --max-new-tokens >= 1")
    tokenizer = pick_tokenizer(args.source, args.tokenizer)
    with single_process_group():
        _, model = load_model(args.source, args.base)
        ids = generate(model, tokenizer.encode(args.prompt).tolist(), args.max_new_tokens, args.temperature,
                       args.top_p, args.seed, tokenizer.eod_id)  # fmt: skip
    print(args.prompt + tokenizer.decode(ids))


def cmd_eval(args: argparse.Namespace) -> None:
    """Downstream tasks through lm-eval on a checkpoint (any layout, in one process) or a Hugging Face folder;
    the results printed as lm-eval's table and written beside the checkpoint."""
    from hpc_train.checkpoint.hf_io import is_hf_folder
    from hpc_train.checkpoint.init_from import newest_checkpoint
    from hpc_train.commands.convert import load_model
    from hpc_train.commands.generate import pick_tokenizer
    from hpc_train.launch.local import single_process_group

    try:
        from lm_eval.utils import make_table

        from hpc_train.commands.downstream import HpcTrainLM, write_results
        from hpc_train.train.lm_eval_model import evaluate, task_manager
    except ImportError:
        raise UserError("hpc-train eval needs lm-evaluation-harness: pip install 'hpc_train[eval]'") from None
    if args.limit is not None and args.limit < 1 or args.batch_size < 1:
        raise ConfigError("--limit and --batch-size must be at least 1")
    info = None if is_hf_folder(args.source) else newest_checkpoint(args.source)
    tokenizer = pick_tokenizer(args.source, args.tokenizer)
    with single_process_group():
        _, model = load_model(args.source, args.base, info)
        tasks = args.tasks.split(",")
        results = evaluate(HpcTrainLM(model, tokenizer, args.batch_size), tasks, args.limit,
                           task_manager(tasks, args.include_path), args.log_samples)  # fmt: skip
    print(make_table(results))
    where = Path(args.source) if info is None else info.path.parent
    print(f"results: {write_results(results, where, 0 if info is None else info.step)}")


def cmd_prepare_data(args: argparse.Namespace) -> None:
    """One process here, or with --slurm a job array and its merge (launch/prepare_array.py)."""
    from hpc_train.data.indexed import read_index
    from hpc_train.data.prepare import expand_inputs, prepare_data

    if args.slurm is None and (args.wait or args.dry_run):
        raise ConfigError("--wait and --dry-run go with --slurm nodes=N; without it the data is prepared here")
    if args.slurm is not None:
        written = _prepare_on_slurm(args)
    else:
        written = prepare_data(expand_inputs(args.inputs), args.output, args.tokenizer, args.valid_every,
                               max_tokens=args.max_tokens, workers=args.workers, text_key=args.text_key)  # fmt: skip
    for split, prefix in (written or {}).items():
        docs, tokens = (read_index(prefix)[0][key] for key in ("num_docs", "num_tokens"))
        print(f"{split}: {prefix}.bin / {prefix}.idx: {docs:,} document{'s' * (docs != 1)}, {tokens:,} tokens")


def _prepare_on_slurm(args: argparse.Namespace) -> dict[str, str] | None:
    """Plan, check and submit the array and its merge (or print them: --dry-run); --wait: the prefixes written,
    once the merge has completed (a failed job exits 1 naming it and its log)."""
    from hpc_train.data.prepare import expand_inputs, note_cut
    from hpc_train.launch import prepare_array

    options = prepare_array.parse_slurm(args.slurm)
    plan = prepare_array.make_plan(expand_inputs(args.inputs), args.output, args.tokenizer, args.valid_every,
                                   args.max_tokens, args.workers, args.text_key, options)  # fmt: skip
    prepare_array.check_cluster(options)
    prepare_array.check_queue(plan)
    todo = prepare_array.parts_to_run(plan)
    if args.dry_run:
        print(prepare_array.dry_run(plan, todo), end="")
        return None
    array, merge = prepare_array.submit(plan, todo)
    print(prepare_array.submission_summary(plan, todo, array, merge), flush=True)
    if not args.wait:
        return None
    if (failure := prepare_array.follow(plan, todo, array, merge)) is not None:
        print(failure, file=sys.stderr)
        sys.exit(1)
    written, seen = merge.result()
    note_cut(seen, args.max_tokens)
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpc-train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("config", nargs="?", help="YAML config (e.g. configs/tiny.yaml)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=10")
        return p

    with_config(sub.add_parser("train", help="train (joins Slurm/torchrun, else starts parallel.nproc ranks)"))
    doctor = with_config(sub.add_parser("doctor", help="test an allocation: ranks join, one all-reduce per group"))
    doctor.add_argument("--local", action="store_true", help="on parallel.nproc local processes, not a Slurm job")
    submit = with_config(sub.add_parser("submit", help="submit a Slurm job (sbatch through submitit)"))
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch script and config; submit nothing")
    submit.add_argument("--wait", action="store_true", help="follow the job to its end, streaming rank 0's output")
    submit.add_argument("--force", action="store_true", help="submit past the planner's or the partition's limits")
    sweep = with_config(sub.add_parser("sweep", help="a job array of runs over swept values: key=v1,v2,..."))
    sweep.add_argument("--zip", action="store_true", help="the i-th values together, not every combination")
    ladder = with_config(sub.add_parser("ladder", help="models of several sizes as a sweep; `ladder fit DIR` fits "
                                        "their losses"))  # fmt: skip
    ladder.add_argument("--sizes", help="parameter counts, e.g. 1M,3M,10M")
    ladder.add_argument("--tokens-per-param", type=float, default=20.0, help="each size's token budget (default 20)")
    ladder.add_argument("--target", help="fit: predict the loss of a model of this size (e.g. 1B)")
    ladder.add_argument("--plot", help="fit: the plot's file (default DIR/ladder_fit.png)")
    for p in (sweep, ladder):
        p.add_argument("--dry-run", action="store_true", help="list the members and print the array's sbatch script")
        p.add_argument("--local", action="store_true", help="run the members one after another here")
        p.add_argument("--wait", action="store_true", help="until every member's job has ended")
        p.add_argument("--force", action="store_true", help="submit past the planner's or the partition's limits")
    runs = sub.add_parser("runs", help="a table of runs (a sweep's members): state, step, loss, goodput, values")
    runs.add_argument("run_dirs", nargs="+", metavar="DIR", help="run directories or sweep directories")
    runs.add_argument("--plot", help="also draw the runs' loss curves side by side into this PNG file")
    stop = sub.add_parser("stop", help="stop a run's Slurm job: its ranks save, and it ends without requeueing")
    stop.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    stop.add_argument("--wait", action="store_true", help="until the jobs have left the queue, then their status")
    status = sub.add_parser("status", help="each run's job, its state, its step and newest checkpoint")
    status.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="(default: every run with a queued job)")
    plan = with_config(sub.add_parser("plan", help="memory per rank of a layout; --search ranks layouts"))
    plan.add_argument("--gpu-mem", type=float, help="GiB per GPU (default: slurm.gpu_mem_gb)")
    plan.add_argument("--host-mem", type=float, help="--search: GiB of host memory per node (default: unbounded)")
    plan.add_argument("--search", action="store_true", help="enumerate layouts, rank those that fit by step time")
    plan.add_argument("--world", type=int, help="ranks (default: slurm nodes x tasks on GPUs, else parallel.nproc)")
    plan.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, for --search (H100 bf16)")
    low_bit = "--search: also layouts that fit only with 8-bit or 4-bit AdamW moments (which change the numerics)"
    plan.add_argument("--allow-rule-change", action="store_true", help=low_bit)
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--mtbf-hours", type=float, help="a node's mean time between failures: the checkpoint "
                      "interval and goodput it calls for (Daly)")  # fmt: skip
    plan.add_argument("--failures-per-day", type=float, help="the job's failures a day, instead of --mtbf-hours")
    plan.add_argument("--save-s", type=float, help="what a save blocks training for (default: the run's measured)")
    plan.add_argument("--restart-s", type=float, help="a failure to training again (default: measured, else 300)")
    plan.add_argument("--step-s", type=float, help="a step's time (default: measured, else the planner's)")
    ckpt = sub.add_parser("ckpt", help="list, verify (checksums), inspect or convert a run's checkpoints")
    ckpt.add_argument("ckpt_command", choices=["list", "verify", "inspect", "convert"])
    ckpt.add_argument("run_dir", help="a run directory or its checkpoints directory")
    ckpt.add_argument("out", nargs="?", help="convert: the new file (torch, safetensors) or directory (dcp)")
    ckpt.add_argument("--to", choices=["torch", "safetensors", "dcp"], help="convert: the format to write")
    ckpt.add_argument("--step", type=int, help="inspect, convert: this step (default: the newest usable)")
    cfg_cmd = sub.add_parser("config", help="inspect configs").add_subparsers(dest="config_command", required=True)
    with_config(cfg_cmd.add_parser("show", help="print the resolved config and check it"))
    imp = sub.add_parser("import-hf", help="a Hugging Face model folder -> a sharded checkpoint of any layout")
    imp.add_argument("hf_dir", help="a folder with config.json and safetensors (LlamaForCausalLM, GPT2LMHeadModel)")
    imp.add_argument("ckpt_dir", help="a new directory for the checkpoint")
    imp.add_argument("overrides", nargs="*", help="the layout, e.g. parallel.nproc=2 parallel.tp=2")
    exp = sub.add_parser("export-hf", help="a checkpoint (any layout) -> a folder transformers loads")
    exp.add_argument("source", help="a run directory or checkpoint directory (its newest verified checkpoint)")
    exp.add_argument("out_dir")
    exp.add_argument("--adapters-only", action="store_true", help="LoRA adapters alone, in PEFT's format")
    exp.add_argument("--tokenizer", help="a tokenizer.json to export (default: the one the run was trained with)")
    gen = sub.add_parser("generate", help="text from a checkpoint or Hugging Face folder (greedy or top-p)")
    for p in (exp, gen):
        p.add_argument("--base", help="QLoRA: where the run's base weights (its model.init_from) are now")
    gen.add_argument("source", help="a run / checkpoint directory, or a Hugging Face model folder")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching this mass")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", help="a tokenizer.json (default: the one the source was trained with, else "
                     "byte-level)")  # fmt: skip
    ev = sub.add_parser("eval", help="downstream tasks through lm-eval on a checkpoint (any layout) or HF folder")
    ev.add_argument("source", help="a run / checkpoint directory (its newest verified checkpoint), or a HF folder")
    ev.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (e.g. hellaswag,arc_easy)")
    ev.add_argument("--limit", type=int, help="at most this many examples a task")
    ev.add_argument("--batch-size", type=int, default=8, help="sequences scored at once (default 8)")
    ev.add_argument("--include-path", help="a folder of task YAML files of your own (lm-eval's include_path)")
    ev.add_argument("--log-samples", action="store_true", help="also write each request's scores to the results")
    ev.add_argument("--base", help="QLoRA: where the run's base weights (its model.init_from) are now")
    ev.add_argument("--tokenizer", help="a tokenizer.json (default: the one the source was trained with)")
    prep = sub.add_parser("prepare-data", help="tokenize text, JSONL or parquet files into an indexed dataset")
    prep.add_argument("inputs", nargs="+", help="text files (one document each), .jsonl/.ndjson files of {text} or "
                      "{prompt, response} lines, .parquet files with a text (or prompt and response) column, or globs "
                      "(quote globs: 'data/**/*.parquet')")  # fmt: skip
    prep.add_argument("--workers", type=int, default=1, help="processes tokenizing in parallel (default 1)")
    prep.add_argument("--text-key", default="text", help="the JSON key / parquet column holding a document's text")
    prep.add_argument("--max-tokens", type=int, help="keep the last N tokens of a longer example (use model.seq_len)")
    prep.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx (a .bin given "
                      "is dropped)")  # fmt: skip
    prep.add_argument("--tokenizer", default="byte", help="'byte' (default) or a Hugging Face tokenizer.json with an "
                      "end-of-document token; recorded as PREFIX.tokenizer.json")  # fmt: skip
    prep.add_argument(
        "--valid-every", type=int, default=0, help="hold out every N-th document (file or example) as PREFIX_valid"
    )
    prep.add_argument("--slurm", nargs="+", metavar="KEY=VALUE", help="tokenize on a Slurm job array, then merge: "
                      "nodes=N [partition=P] [account=A] [time=MIN]")  # fmt: skip
    prep.add_argument("--dry-run", action="store_true", help="--slurm: print the parts and sbatch scripts only")
    prep.add_argument("--wait", action="store_true", help="--slurm: follow the array and the merge to their end")
    return parser


COMMANDS = {
    "train": cmd_train,
    "submit": cmd_submit,
    "sweep": cmd_sweep,
    "ladder": cmd_ladder,
    "runs": cmd_runs,
    "doctor": cmd_doctor,
    "stop": cmd_stop,
    "status": cmd_status,
    "plan": cmd_plan,
    "config": cmd_config_show,
    "ckpt": cmd_ckpt,
    "prepare-data": cmd_prepare_data,
    "import-hf": cmd_import_hf,
    "export-hf": cmd_export_hf,
    "generate": cmd_generate,
    "eval": cmd_eval,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it (argparse exits 2 on a bad one): overrides may also follow flags."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(item.startswith("-") for item in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # overrides after a flag (`plan cfg.yaml --search parallel.tp=2`)
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (UserError, FileNotFoundError) as err:
        for line in str(err).splitlines():
            print(f"hpc-train: error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
