"""The planner against exact measurement: for each layout, real training steps measure rank 0's parameter,
gradient, optimizer and saved-activation bytes; the planner's prediction must be within 5%."""

import dataclasses

import pytest

from hpc_train.config import load_config
from hpc_train.launch.local import free_port, launch_local
from hpc_train.planner import activation_bytes, estimate
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, read_metrics

SP = "parallel.sequence_parallel=true"
ZERO1_BF16 = ["optim.zero_stage=1", "train.precision=bf16"]
LAYOUTS = {  # name -> (world size, overrides)
    "fp32": (1, []),
    "selective": (1, ["model.recompute=selective"]),
    "full": (1, ["model.recompute=full"]),
    "full_every_2": (1, ["model.recompute=full", "model.recompute_every=2"]),
    "zero1_bf16": (1, ZERO1_BF16),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", SP]),
    "tp2_sp_full": (2, ["parallel.tp=2", SP, "model.recompute=full"]),
    "tp2_sp_zero1_bf16": (2, ["parallel.tp=2", SP, *ZERO1_BF16]),
    "dp2_zero1": (2, ["optim.zero_stage=1"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "train.grad_accum=2"]),
    "pp2_interleaved": (
        2,
        ["parallel.pp=2", "train.grad_accum=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved_1f1b"],
    ),  # fmt: skip
    "tp2_pp2_sp_selective": (
        4,
        ["parallel.tp=2", "parallel.pp=2", SP, "train.grad_accum=2", "model.recompute=selective"],
    ),  # fmt: skip
}
COMMON = [*TINY_MODEL, "model.n_layers=4", "model.d_model=128", "model.seq_len=64", "train.steps=2",
          "train.micro_batch_size=4", "train.save_final_model=false"]  # fmt: skip


def _run_layouts(rank_env, ports, cfgs):
    for port, cfg in zip(ports, cfgs, strict=True):
        run_training(dataclasses.replace(rank_env, master_port=port), cfg)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, small_corpus):
    base = tmp_path_factory.mktemp("planner")
    cfgs = {n: load_config(None, [*COMMON, f"data.train_path={small_corpus}", f"run_dir={base / n}",
                                  f"parallel.nproc={w}", *o]) for n, (w, o) in LAYOUTS.items()}  # fmt: skip
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        launch_local(_run_layouts, world, [free_port() for _ in names], [cfgs[n] for n in names])
    # step 2: a pipeline stage runs one extra forward on its first step to infer its shapes
    return {n: (cfgs[n], read_metrics(cfgs[n].run_dir)[1]["memory_bytes"]) for n in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_matches_measurement_within_5_percent(measured, layout):
    cfg, got = measured[layout]
    world = LAYOUTS[layout][0]
    plan = estimate(cfg, world // (cfg.parallel.tp * cfg.parallel.pp))
    assert plan.params == got["params"]  # exact
    assert plan.optimizer == pytest.approx(got["optimizer"], rel=0.05)
    assert plan.grads == pytest.approx(got["grads"], rel=0.05)
    assert activation_bytes(cfg) == pytest.approx(got["activations_per_microbatch"], rel=0.05)
    measured_total = sum(got[k] for k in ("params", "grads", "optimizer", "activations_per_microbatch"))
    planned_total = plan.params + plan.grads + plan.optimizer + activation_bytes(cfg)
    assert planned_total == pytest.approx(measured_total, rel=0.05)


def test_plan_cli_and_submit_refuses_a_layout_that_does_not_fit(capsys):
    import json

    from hpc_train.cli import main

    main(["plan", "configs/gpt_70b.yaml", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and 20 * 2**30 < plan["total"] < 80 * 2**30 and plan["microbatches_in_flight"] == 5
    main(["plan", "configs/gpt_7b.yaml", "--search", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["fits"] and all(r["tp"] * r["pp"] * r["dp"] == 32 for r in rows)
    assert [r["step_s"] for r in rows if r["fits"]] == sorted(r["step_s"] for r in rows if r["fits"])

    too_small = ["configs/gpt_70b.yaml", "slurm.gpu_mem_gb=24", "data.train_path=stdlib", "data.valid_path=null"]
    with pytest.raises(SystemExit) as refused:
        main(["submit", *too_small, "--dry-run"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "--force" in err and "DOES NOT FIT in 24 GiB" in err
    main(["submit", *too_small, "--dry-run", "--force"])
    assert "#SBATCH --gpus-per-node=8" in capsys.readouterr().out
