"""The planner against exact measurement: for each layout, real training steps measure rank 0's parameter,
gradient, optimizer and saved-activation bytes; the planner's prediction must be within 5%."""

import pytest

from tools.validate_planner import CATEGORIES, LAYOUTS, PEAK, measure


@pytest.fixture(scope="module")
def measured(tmp_path_factory, small_corpus):
    return measure(small_corpus, tmp_path_factory.mktemp("planner"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_matches_measurement_within_5_percent(measured, layout):
    _, got, predicted = measured[layout]
    assert predicted["params"] == got["params"]  # exact
    for key in CATEGORIES:
        assert predicted[key] == pytest.approx(got[key], rel=0.05), key
    assert sum(predicted[k] for k in PEAK) == pytest.approx(sum(got[k] for k in PEAK), rel=0.05)


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
