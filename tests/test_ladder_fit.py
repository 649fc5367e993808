"""The model ladder's pure parts (commands/ladder.py): the scaling-law fit, the rung shapes and budgets, the
refusals, and reading finished runs back. No training and no subprocess: the whole file runs in a few seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpc_train.commands.ladder import (
    fit_power_law,
    format_fit,
    ladder_points,
    ladder_shapes,
    parse_sizes,
    predict_target,
)
from hpc_train.commands.runs import run_dirs
from hpc_train.config import ConfigError
from hpc_train.config.load import to_yaml
from hpc_train.job import load_config
from hpc_train.models import get_spec
from hpc_train.models.common.decoder import count_params

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.mark.parametrize("law", [(1.7, 300.0, 0.15), (0.4, 5.0e3, 0.3)])
def test_fit_recovers_a_known_law(law: tuple[float, float, float]) -> None:
    e, a, alpha = law
    compute = [1e15, 3e17, 4e15, 1e17, 2e16]  # unsorted: points and residuals keep the given order
    fit = fit_power_law([(c, e + a * c**-alpha) for c in compute])
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((e, a, alpha), rel=0.02)
    assert [c for c, _ in fit.points] == compute
    assert max(abs(r) for r in fit.residuals) < 1e-4
    assert fit.predict(1e21) == pytest.approx(e + a * 1e21**-alpha, rel=1e-3)  # A converted back to raw FLOPs
    text = format_fit(fit, ["r1", "r2", "r3", "r4", "r5"])
    assert "3.00e17" in text and "max |residual|" in text


def test_ladder_shapes_follow_the_family_rule_and_the_token_budget() -> None:
    cfg = load_config(TINY)
    head_dim, aspect = cfg.model.d_model // cfg.model.n_heads, cfg.model.d_model / cfg.model.n_layers
    tokens_per_step = 2 * cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.model.seq_len
    rungs = ladder_shapes(cfg, parse_sizes("0.2M,0.5M,1M"), tokens_per_param=20, dp=2)
    assert [r["size"] for r in rungs] == [2e5, 5e5, 1e6]
    assert rungs[0]["params"] < rungs[1]["params"] < rungs[2]["params"]
    for rung in rungs:
        overrides = rung["overrides"]
        assert abs(rung["params"] - rung["size"]) / rung["size"] < 0.25
        shaped = load_config(TINY, [f"{key}={value}" for key, value in overrides.items()])
        spec = get_spec(shaped.model.arch)
        spec.validate(shaped.model, 1)
        with torch.device("meta"):  # the overrides build the model whose params are reported
            assert count_params(spec.build_stage(shaped.model)) == rung["params"]
        d_model, layers = overrides["model.d_model"], overrides["model.n_layers"]
        assert d_model == overrides["model.n_heads"] * head_dim
        assert layers in (max(1, math.floor(d_model / aspect)), max(1, math.ceil(d_model / aspect)))
        assert overrides["train.steps"] == math.ceil(20 * rung["params"] / tokens_per_step)
        assert rung["tokens"] == overrides["train.steps"] * tokens_per_step >= 20 * rung["params"]
    doubled = ladder_shapes(cfg, [2e5], tokens_per_param=40, dp=2)[0]["overrides"]["train.steps"]
    assert doubled == math.ceil(40 * rungs[0]["params"] / tokens_per_step)


def test_parse_sizes_reads_suffixes() -> None:
    assert parse_sizes("1M,3m, 10M") == [1e6, 3e6, 1e7]
    assert parse_sizes("2.5e6,500K,1B,.5k") == [2.5e6, 5e5, 1e9, 500.0]


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="at least 3 points"):
        fit_power_law([(1e15, 3.0), (1e16, 2.8)])
    with pytest.raises(ConfigError, match="distinct"):
        fit_power_law([(1e15, 3.0), (1e16, 2.8), (1e16, 2.7)])
    with pytest.raises(ConfigError, match="does not fall"):
        fit_power_law([(1e15, 2.0), (1e16, 2.5), (1e17, 3.0)])
    cfg = load_config(TINY)
    for sizes in ([1e6, 1e6], [1e6, 1.01e6]):  # the second pair differs but lands on one shape
        with pytest.raises(ConfigError, match="same shape"):
            ladder_shapes(cfg, sizes, tokens_per_param=20, dp=1)
    with pytest.raises(ConfigError, match="not positive") as refused:
        ladder_shapes(cfg, [0.0, 1e6], tokens_per_param=0, dp=1)
    assert "size 0" in str(refused.value) and "tokens_per_param=0" in str(refused.value)
    for junk in ["", "1M,,3M", "abc", "1X", "nan", "1e", "1.5.2M", "10 M"]:
        with pytest.raises(ConfigError, match="K/M/B"):
            parse_sizes(junk)


def _run(run_dir: Path, records: list[dict], steps: int) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(TINY, [f"train.steps={steps}"])))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "lo')


def test_ladder_points_read_a_sweep(tmp_path: Path) -> None:
    cfg = load_config(TINY)
    global_batch = 2 * cfg.train.micro_batch_size  # nproc 2: known from consumed_samples, not the config
    losses = [5.0, 4.0, 3.0, 2.9, 2.8, 2.7, 2.6]
    train = [{"step": s, "consumed_samples": s * global_batch, "loss": v} for s, v in enumerate(losses, 1)]
    _run(tmp_path / "plain", train, steps=7)
    _run(tmp_path / "evaluated", [*train[:-1], {**train[-1], "eval_loss": 2.5}], steps=7)
    _run(tmp_path / "unfinished", train, steps=8)
    (tmp_path / "empty").mkdir()
    members = [{"name": n, "path": str(tmp_path / n)} for n in ("plain", "evaluated", "unfinished", "empty")]
    (tmp_path / "sweep.json").write_text(json.dumps({"members": members, "arrays": []}))
    assert run_dirs([str(tmp_path / "plain")]) == [tmp_path / "plain"]
    points, skipped = ladder_points(run_dirs([str(tmp_path)]))
    compute = get_spec(cfg.model.arch).flops_per_token(cfg.model) * 7 * global_batch * cfg.model.seq_len
    assert points == [("plain", compute, pytest.approx(2.8)), ("evaluated", compute, 2.5)]
    assert len(skipped) == 2 and "step 7 of 8" in skipped[0] and "no config.yaml or metrics.jsonl" in skipped[1]


def test_predict_target_extends_the_rungs_rule() -> None:
    cfg = load_config(TINY)
    fit = fit_power_law([(c, 1.7 + 300.0 * c**-0.15) for c in (1e15, 1e16, 1e17)])
    rung = ladder_shapes(cfg, [1e6], tokens_per_param=20, dp=1)[0]
    shaped = load_config(TINY, [f"{key}={value}" for key, value in rung["overrides"].items()])
    compute, loss = predict_target(fit, cfg, 1e6, tokens_per_param=20)
    assert compute == get_spec(shaped.model.arch).flops_per_token(shaped.model) * 20 * rung["params"]
    assert loss == pytest.approx(fit.predict(compute))


def test_fit_keeps_the_irreducible_term_non_negative() -> None:
    """Points whose free least-squares fit wants E < 0 (a law with E = -0.5) get E = 0 and a positive A."""
    fit = fit_power_law([(c, -0.5 + 40.0 * c**-0.05) for c in (1e15, 1e16, 1e17, 1e18)])
    assert fit.E == 0.0 and fit.A > 0 and fit.alpha > 0
    assert max(abs(r) for r in fit.residuals) < 0.05
