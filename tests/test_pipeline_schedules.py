"""The pipeline schedules past interleaved 1F1B (parallel.schedule=interleaved_zb, zbv, dualpipev): what the
planner reads off torch's own action lists (bubble, micro-batches in flight), what a config may not ask of
them, the weight half's gradients reaching every data-parallel strategy's hooks, and checkpoints that resume
across schedules. Their parity with one process, alone and composed, is tests/test_parallel.py's (and fp8's,
tests/test_fp8.py's); the planner's memory against measurement at pp4 is tests/test_planner.py's."""

import json
from pathlib import Path

import pytest
import torch

from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.config import ConfigError, ParallelConfig
from hpc_train.data.batch import Batch
from hpc_train.distributed.pipeline import _simulate, bubble_fraction, in_flight_chunks, schedule_actions
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.planner import search
from hpc_train.train.loop import run_training
from hpc_train.train.step import StepOptions, train_step
from tests.conftest import TINY_MODEL, max_param_diff, read_final_model, read_metrics

SPLIT = ("interleaved_zb", "zbv", "dualpipev")
DEEP = "model.n_layers=4"


def schedule(name: str, pp: int = 2) -> ParallelConfig:
    return ParallelConfig(pp=pp, virtual_stages=1 if name == "1f1b" else 2, schedule=name)


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_1f1b_read_off_its_actions_is_its_formula(pp):
    """Where the planner had formulas (interleaved 1F1B: bubble (pp-1)/(m v), torch's warmup), the figures
    read off torch's action list are the same."""
    p = schedule("interleaved_1f1b", pp)
    for m in (pp, 2 * pp, 4 * pp):
        assert bubble_fraction(p, m) == pytest.approx((pp - 1) / (2 * m))
        assert [in_flight_chunks(p, m, r) for r in range(pp)] == [min(pp + 2 * (pp - 1 - r) + 1, 2 * m)
                                                                  for r in range(pp)]  # fmt: skip
    assert schedule_actions("1f1b", pp, 8, 1) is None  # torch lists one-stage schedules for rank 0 only: formula
    assert bubble_fraction(schedule("1f1b", pp), 8) == pytest.approx((pp - 1) / 8)


@pytest.mark.parametrize("name", ["interleaved_1f1b", *SPLIT])
def test_figures_listed_at_2pp_hold_for_longer_steps(name):
    """The planner lists at most 2pp micro-batches: the bubble and the micro-batches in flight of 8pp, listed
    whole, are those it extrapolates."""
    for pp in (2, 4):
        m = 8 * pp
        busy, makespan = _simulate_whole(name, pp, m)
        assert bubble_fraction(schedule(name, pp), m) == pytest.approx(max((makespan - b) / b for b in busy))
        full = schedule_actions(name, pp, m, 2)
        assert [in_flight_chunks(schedule(name, pp), m, r) for r in range(pp)] == [_peak(rank) for rank in full]


def _simulate_whole(name, pp, m):
    return _simulate(schedule_actions(name, pp, m, 2))


def _peak(actions) -> int:
    live = peak = 0
    for kind, _, _ in actions:
        live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def test_zero_bubble_schedules_idle_a_third_of_interleaved_1f1b():
    """pp4, 8 micro-batches: interleaved 1F1B idles (pp-1)/(m v) = 3/16 of its compute; the schedules that
    fill the bubble with weight halves 1/16 (forward, input and weight halves one unit each)."""
    assert bubble_fraction(schedule("interleaved_1f1b", 4), 8) == pytest.approx(3 / 16)
    for name in SPLIT:
        assert bubble_fraction(schedule(name, 4), 8) == pytest.approx(1 / 16), name
    # they keep a micro-batch until its weight half: pp micro-batches on every rank (DualPipeV one chunk more)
    assert [in_flight_chunks(schedule("zbv", 4), 8, r) for r in range(4)] == [8] * 4
    assert [in_flight_chunks(schedule("dualpipev", 4), 8, r) for r in range(4)] == [9] * 4
    assert [in_flight_chunks(schedule("interleaved_1f1b", 4), 8, r) for r in range(4)] == [11, 9, 7, 5]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["parallel.schedule=zbv", "parallel.virtual_stages=3", "model.n_layers=6"], "parallel.virtual_stages=2"),
        (["parallel.schedule=interleaved_zb", "parallel.virtual_stages=1"], "virtual_stages >= 2"),
        (["parallel.schedule=dualpipev", "parallel.virtual_stages=2", DEEP, "train.grad_accum=2"],
         "train.grad_accum >= 4"),
        (["parallel.schedule=interleaved_zb", "parallel.virtual_stages=2", DEEP, "train.grad_accum=5"],
         "multiple of 2"),
        (["parallel.schedule=zbv", "parallel.virtual_stages=2", DEEP, "train.grad_accum=2", "train.compile=true"],
         "train.compile=false"),
        (["parallel.schedule=1f1b", "parallel.virtual_stages=2", DEEP], "interleaved_zb, zbv or dualpipev"),
        (["parallel.pp=1", "parallel.schedule=zbv", "parallel.virtual_stages=2", DEEP], "set parallel.pp > 1"),
        # ZeRO-3: blocks resharded after forward leave the weight half's graph; a V's tied embedding (gpt2) whose
        # 320 rows do not split over dp 3 would be replaced by a padded copy
        (["parallel.schedule=interleaved_zb", "parallel.virtual_stages=2", DEEP, "parallel.nproc=4",
          "optim.zero_stage=3", "optim.reshard_after_forward=true"], "set optim.reshard_after_forward=false"),
        (["parallel.schedule=zbv", "parallel.virtual_stages=2", DEEP, "parallel.nproc=6", "optim.zero_stage=3",
          "model.arch=gpt2", "model.vocab_multiple=64"], "320 rows a tp rank to split evenly over dp x cp = 3"),
    ],
)  # fmt: skip
def test_a_schedule_it_cannot_run_is_refused_naming_the_fix(overrides, named):
    cfg = load_config(None, [*TINY_MODEL, "parallel.pp=2", "train.grad_accum=4", *overrides])
    with pytest.raises(ConfigError, match=named):
        check_run(cfg, cfg.parallel.nproc, check_paths=False)


def test_search_tries_every_schedule_at_pp_above_1():
    """plan --search plans each schedule at pp > 1, each with its own memory (ZB and ZBV keep fewer
    micro-batches than interleaved 1F1B on the first rank) and its own bubble."""
    cfg = load_config(None, [*TINY_MODEL, "model.n_layers=8", "train.grad_accum=8", "train.micro_batch_size=1"])
    rows = search(cfg, 4, 2**40, 1e12)
    at = {r["schedule"]: r for r in rows if r["pp"] == 4 and r["tp"] == 1 and r["mbs"] == 1 and r["zero"] == 0
          and r["recompute"] == "none" and r["offload"] == "none"}  # fmt: skip
    assert set(at) == {"1f1b", "interleaved_1f1b", *SPLIT}
    assert at["zbv"]["total_gib"] < at["interleaved_1f1b"]["total_gib"]
    assert at["zbv"]["step_s"] < at["interleaved_1f1b"]["step_s"] < at["1f1b"]["step_s"]
    assert {r["schedule"] for r in rows if r["pp"] == 1} == {"1f1b"}


def run_or_count(rank_env, cfg, count: bool) -> None:
    """`run_training(cfg)`, or (`count`) one step of it that counts each trainable parameter's
    post-accumulate-grad calls, written to run_dir/arrivals_<rank>.json beside what a full backward gives
    (micro-batches x the stages using it): the calls the data-parallel strategies count gradients with."""
    if not count:
        return run_training(rank_env, cfg)
    cpu = torch.device("cpu")
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    with distributed(rank_env, cpu, "gloo", 120):
        run = build_run(cfg, rank_env, cpu, with_data=False)
        model, names, calls = run.model, run.model.parameter_names(), {}
        for p in model.trainable_parameters:
            p.register_post_accumulate_grad_hook(
                lambda p: calls.__setitem__(names[id(p)], calls.get(names[id(p)], 0) + 1)
            )
        tokens = torch.randint(0, 200, (cfg.train.micro_batch_size, cfg.model.seq_len))
        train_step(model, run.optimizer, [Batch(tokens, tokens)] * cfg.train.grad_accum, 1e-3, StepOptions())
        expected = {names[id(p)]: cfg.train.grad_accum * model.backward_passes(p) for p in model.trainable_parameters}
        path = f"{cfg.run_dir}/arrivals_{rank_env.rank}.json"
        with open(path, "w") as f:
            json.dump({"calls": calls, "expected": expected}, f)


# (source schedule, target schedule): the source trains 2 steps and saves, the target resumes it to step 4
RESUMES = [("zbv", "1f1b"), ("1f1b", "zbv"), ("interleaved_zb", "dualpipev")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    base = tmp_path_factory.mktemp("schedules")
    common = [*TINY_MODEL, DEEP, f"data.train_path={small_corpus}", "checkpoint.interval=2"]

    def cfg(run: str, *overrides: str):
        return load_config(None, [*common, f"run_dir={base / run}", *overrides])

    def layout(name: str) -> list[str]:
        virtual = "1" if name == "1f1b" else "2"
        return ["parallel.pp=2", f"parallel.schedule={name}", f"parallel.virtual_stages={virtual}",
                "train.micro_batch_size=2", "train.grad_accum=4", "parallel.nproc=2"]  # fmt: skip

    launch_local(run_training, 1, cfg("reference", "train.steps=4", "train.micro_batch_size=8"))
    sequence = []
    for source, target in RESUMES:
        run = f"{source}_to_{target}"
        sequence += [
            (cfg(run, "train.steps=2", *layout(source)), False),
            (cfg(run, "train.steps=4", *layout(target)), False),
        ]
    sequence += [(cfg(f"arrivals_{arch}_{name}", f"model.arch={arch}", *layout(name)), True)
                 for arch in ("llama", "gpt2") for name in SPLIT]  # fmt: skip
    launch_sequence(run_or_count, 2, sequence)
    return base


@pytest.mark.parametrize("source, target", RESUMES)
def test_a_checkpoint_resumes_under_another_schedule_on_the_same_curve(runs, source, target):
    """Saved at step 2 under one schedule (a V places other stages on each rank than the looped ones),
    resumed under another: steps 3 and 4, and the final weights, are those of one uninterrupted process."""
    run, reference = runs / f"{source}_to_{target}", runs / "reference"
    got = read_metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4] and [
        m["resumed_from"]["step"] for m in got if "resumed_from" in m
    ] == [2]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in read_metrics(reference)], abs=1e-5)
    assert max_param_diff(read_final_model(run), read_final_model(reference)) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("name", SPLIT)
def test_weight_halves_reach_the_gradient_hooks_as_a_full_backward_does(runs, arch, name):
    """Every trainable parameter's post-accumulate-grad hooks run once per micro-batch and stage using it
    (twice for gpt2's tied embedding on a V's first rank): torch's own weight half assigns `.grad` and
    runs none, which would leave ZeRO-2's fp32 accumulation and the reductions from inside backward idle."""
    counted = [json.loads((runs / f"arrivals_{arch}_{name}" / f"arrivals_{rank}.json").read_text()) for rank in (0, 1)]
    for record in counted:
        assert record["calls"] == record["expected"]
    twice = {n for record in counted for n, e in record["expected"].items() if e == 2 * 4}
    assert twice == ({"tok_embeddings.weight"} if arch == "gpt2" and name != "interleaved_zb" else set())


def weight_pass_gradients(rank_env, reshard_after_forward: bool) -> dict[str, bool]:
    """One zbv step of one rank holding both stages of a two-layer model, the second stage sharded by FSDP2:
    which of that stage's weights got a gradient."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpc_train.distributed.pipeline import build_schedule

    cpu = torch.device("cpu")
    with distributed(rank_env, cpu, "gloo", 120):
        torch.manual_seed(0)
        chunks, mesh = [nn.Linear(8, 8), nn.Linear(8, 8)], init_device_mesh("cpu", (1,))
        fully_shard(chunks[1], mesh=mesh, reshard_after_forward=reshard_after_forward)
        steps = build_schedule(chunks, [0, 1], schedule("zbv", pp=1), 2, mesh, cpu,
                               lambda out, target: ((out - target) ** 2).mean())  # fmt: skip
        steps.step(torch.randn(4, 8), target=torch.randn(4, 8))
        return {name: p.grad is not None for name, p in chunks[1].named_parameters()}


def test_a_weight_the_split_backward_cannot_reach_stops_the_step_by_name():
    """The weight half computes the gradients of the weights torch's private input pass grouped. A stage whose
    weights are not there (FSDP2 resharded them after forward: the config refuses it, the stage does not rely
    on that) stops the step naming them, the torch version and the fix; it used to leave them without a
    gradient. Kept gathered, every weight of the stage gets its gradient."""
    assert launch_local(weight_pass_gradients, 1, False) == {"weight": True, "bias": True}
    with pytest.raises(ConfigError) as refused:
        launch_local(weight_pass_gradients, 1, True)
    message = str(refused.value)
    assert "leaves weight, bias of pipeline stage 1 without a gradient" in message
    assert f"torch {torch.__version__}" in message and "parallel.schedule=1f1b or interleaved_1f1b" in message
