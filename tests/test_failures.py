"""`plan --mtbf-hours` / `--failures-per-day`: Daly's checkpoint interval and the goodput it leaves, checked
against the model they come from (the interval against the goodput's own maximum, the goodput against a
simulated run), then through `plan` on a real run's measured costs."""

import json
import math
import random

import numpy as np
import pytest

from hpc_train.resilience.failures import daly_interval, expected_goodput, young_interval
from tests.conftest import TINY_MODEL, run_cli

# (save, restart, job MTBF) in seconds: a cheap save on a reliable job, Llama 3 405B's interruptions (466 in 54
# days: an MTBF of 2.8 h) with a minute's save, and a save as long as a tenth of the MTBF
CASES = [(10.0, 300.0, 86_400.0), (60.0, 600.0, 54 * 86_400 / 466), (1_000.0, 600.0, 10_000.0)]


@pytest.mark.parametrize(("save", "restart", "mtbf"), CASES)
def test_daly_interval_nearly_maximizes_the_expected_goodput(save, restart, mtbf):
    """Over a fine grid of intervals, the goodput's maximum is within 0.1% of its value at Daly's interval,
    which is within 3% of the best one; Young's first-order interval is longer; a save of 2 MTBF or more
    gets the MTBF itself."""
    grid = np.geomspace(save / 10, 10 * mtbf, 200_001)
    goodputs = np.array([expected_goodput(t, save, restart, mtbf) for t in grid[::100]])
    fine = grid[max(0, 100 * int(goodputs.argmax()) - 100) : 100 * int(goodputs.argmax()) + 101]
    best = fine[np.argmax([expected_goodput(t, save, restart, mtbf) for t in fine])]
    daly = daly_interval(save, mtbf)
    assert abs(daly - best) / best < 0.03, (daly, best)
    assert expected_goodput(daly, save, restart, mtbf) > (1 - 1e-3) * expected_goodput(best, save, restart, mtbf)
    assert young_interval(save, mtbf) > daly
    assert daly_interval(2 * mtbf, mtbf) == mtbf


def test_expected_goodput_is_what_a_simulated_run_keeps():
    """A run simulated failure by failure (exponential times between failures; a failure loses the segment in
    progress and costs a restart, which a failure can strike too) keeps the share of its wall time the
    formula gives, within 1.5%, for an interval near Daly's and for one five times longer."""
    rng = random.Random(0)
    save, restart, mtbf = 30.0, 120.0, 3_600.0
    for interval in (daly_interval(save, mtbf), 5 * daly_interval(save, mtbf)):
        wall, segments = 0.0, 20_000
        for _ in range(segments):
            while (failure := rng.expovariate(1 / mtbf)) < interval + save:  # the segment fails: redo it
                wall += failure
                while (failure := rng.expovariate(1 / mtbf)) < restart:  # the restart fails too
                    wall += failure
                wall += restart
            wall += interval + save
        simulated = segments * interval / wall
        assert simulated == pytest.approx(expected_goodput(interval, save, restart, mtbf), rel=0.015)


def test_plan_gives_the_interval_for_a_runs_measured_costs(tmp_path):
    """A real run's step time, save cost and (none: assumed) restart feed `plan --mtbf-hours`: its interval is
    Daly's for those figures in whole steps, and its goodput the formula's, here and at the config's interval;
    the text names each figure's source; a save cost neither given nor measured, and the options without a
    failure rate, are refused."""
    run = tmp_path / "run"
    config = ["configs/tiny.yaml", *TINY_MODEL, "train.steps=4", "checkpoint.interval=2", f"run_dir={run}"]
    assert run_cli("plan", *config, "--mtbf-hours", "1000").returncode == 2  # no run yet: no save measured
    assert run_cli("train", *config).returncode == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    save = sum(r["checkpoint"]["blocked_s"] for r in records if "checkpoint" in r) / 2
    step = sorted(r["step_time_s"] for r in records)[1:3]
    out = run_cli("plan", *config, "--mtbf-hours", "1000", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["failures"]
    assert plan["save_s"] == pytest.approx(save) and plan["step_s"] == pytest.approx(sum(step) / 2)
    assert plan["restart_s"] == 300.0 and plan["mtbf_s"] == 1000 * 3600
    assert plan["interval_steps"] == round(daly_interval(save, 3.6e6) / plan["step_s"])
    for key, steps in (("goodput", plan["interval_steps"]), ("goodput_at_config", 2)):
        assert plan[key] == pytest.approx(expected_goodput(steps * plan["step_s"], save, 300.0, 3.6e6))
    text = run_cli("plan", *config, "--failures-per-day", "2", "--restart-s", "60").stdout
    assert f"the job's MTBF 12.00 h (2 failures a day); a save blocks training {save:,.1f} s (measured in {run}" in text
    assert "a restart takes 60 s (given)" in text and "checkpoint.interval=2: " in text
    refusals = {("--save-s", "5"): "--save-s, --restart-s and --step-s go with --mtbf-hours or --failures-per-day",
                ("--mtbf-hours", "1", "--failures-per-day", "1"): "give --mtbf-hours (a node's) or --failures-per-day",
                ("--mtbf-hours", "-1"): "--mtbf-hours -1.0 must be a positive number"}  # fmt: skip
    for flags, message in refusals.items():
        refused = run_cli("plan", *config, *flags)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert math.isclose(json.loads(run_cli("plan", *config, "--mtbf-hours", "1000", "--json", "--save-s",
                                           "7").stdout)["failures"]["save_s"], 7.0)  # fmt: skip


def test_auto_interval_saves_where_dalys_interval_falls_for_the_measured_costs(tmp_path):
    """checkpoint.interval=auto on two ranks: the first save 10 steps in; after each, the next comes Daly's
    interval later, in whole steps of the measured step time, for the slowest rank's measured save and the
    MTBF given (a node's, here one node's); keep_every's step and the last step are saved too. auto without an
    MTBF, an MTBF without auto, and an interval that is neither steps nor auto are refused before any rank
    starts."""
    run = tmp_path / "run"
    config = ["configs/tiny.yaml", *TINY_MODEL, "parallel.nproc=2", "train.steps=30", f"run_dir={run}"]
    trained = run_cli("train", *config, "checkpoint.interval=auto", "checkpoint.mtbf_hours=0.00002",
                      "checkpoint.keep_every=25")  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [r["step"] for r in records if "checkpoint" in r]
    assert saved[0] == 10 and saved[-1] == 30 and len(saved) >= 3 and 25 in saved, saved
    for record in records:
        if "auto_interval" not in record.get("checkpoint", {}):
            continue
        auto = record["checkpoint"]["auto_interval"]
        assert auto["mtbf_s"] == pytest.approx(0.00002 * 3600)
        assert auto["steps"] == max(1, round(daly_interval(auto["save_s"], auto["mtbf_s"]) / auto["step_s"]))
        kept = 25 if record["step"] < 25 else 30  # keep_every's step, which is saved whatever the interval
        assert min(record["step"] + auto["steps"], kept, 30) == next(s for s in saved if s > record["step"])
    assert "auto_interval" not in records[-1]["checkpoint"]  # the last save: none after it
    refusals = {"checkpoint.interval=auto": "checkpoint.interval=auto and checkpoint.mtbf_hours=None",
                "checkpoint.mtbf_hours=5": "checkpoint.interval=0 and checkpoint.mtbf_hours=5.0",
                "checkpoint.interval=soon": "checkpoint.interval='soon' must be >= 0 (steps between saves"}  # fmt: skip
    for override, message in refusals.items():
        refused = run_cli("train", *config, override)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
