"""The planner against exact measurement: for each layout, real training steps measure rank 0's parameter,
gradient, optimizer and saved-activation bytes and the step's peak of live tensor bytes; the planner's
categories and its total must be within 5%."""

import pytest

from hpc_train.job import check_run, load_config
from hpc_train.planner import estimate, format_estimate
from tools.activation_table import LAYOUTS as BLOCK_LAYOUTS
from tools.activation_table import MODEL as BLOCK_MODEL
from tools.activation_table import block_runs, per_element, read_tables
from tools.validate_planner import CATEGORIES, LAYOUTS, PEAK, TOTAL_LEFT_OUT, measure, planned_peak

BLOCKS = "activation_table"  # `measured`'s key of tools/activation_table.py's tables (not a grid layout)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, small_corpus):
    """The grid's measurements, and in the same launch of 4 ranks the activation table's layouts at ZeRO-0
    and ZeRO-1."""
    base = tmp_path_factory.mktemp("planner")
    blocks = {f"{name} zero{z}": (w, [*o, f"optim.zero_stage={z}"]) for name, (w, o) in BLOCK_LAYOUTS.items()
              for z in (0, 1)}  # fmt: skip
    cfgs, runs = block_runs([], small_corpus, base, blocks)
    return {**measure(small_corpus, base, also=runs), BLOCKS: read_tables(cfgs, base)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_matches_measurement_within_5_percent(measured, layout):
    cfg, got, predicted = measured[layout]
    assert predicted["params"] == got["params"]  # exact
    for key in CATEGORIES:
        assert predicted[key] == pytest.approx(got[key], rel=0.05), key
    assert sum(predicted[k] for k in PEAK) == pytest.approx(sum(got[k] for k in PEAK), rel=0.05)
    # the host holds what offload moves there (the optimizer state and the owned gradients' copy; ZeRO-3:
    # also the parameter and gradient shards), as the run reports it
    assert ("host" in got) == (cfg.optim.offload == "cpu")
    assert predicted["host"] == pytest.approx(got.get("host", 0), rel=0.05)
    # the total the planner fits layouts by, against the step's measured peak: the profiler's record lies
    # between the peak with every unrecorded free (gloo's worker thread) late and early
    if layout not in TOTAL_LEFT_OUT:
        planned = planned_peak(cfg, predicted)
        assert 0.95 * got["step_peak_min"] <= planned <= 1.05 * got["step_peak"], (planned, got["step_peak"])


def test_the_total_is_asserted_on_every_kind_of_layout():
    """At least 20 layouts, with ZeRO-2 and ZeRO-3, offload, LoRA and QLoRA, compile, the chunked loss, fp8,
    context parallelism in both modes (with packed documents too), MoE, and MoE with LoRA, with float8, with
    sequence parallelism and with expert parallelism."""
    asserted = [overrides for name, (_, overrides) in LAYOUTS.items() if name not in TOTAL_LEFT_OUT]
    assert len(asserted) >= 20
    for setting in ("optim.zero_stage=2", "optim.zero_stage=3", "optim.offload=cpu", "finetune.method=lora",
                    "finetune.method=qlora", "train.compile=true", "model.loss_chunk_tokens=64", "train.fp8=tensorwise",
                    "train.fp8=rowwise", "model.moe.num_experts=4", "parallel.cp_mode=ring",
                    "parallel.cp_mode=ulysses", "parallel.ep=2"):  # fmt: skip
        assert any(setting in overrides for overrides in asserted), setting
    for mode in ("parallel.cp_mode=ring", "parallel.cp_mode=ulysses"):
        assert any(mode in o and "data.document_mask=true" in o for o in asserted), mode
    for setting in ("finetune.method=lora", "train.fp8=rowwise", "parallel.sequence_parallel=true"):  # with MoE
        assert any("model.moe.num_experts=4" in o and setting in o for o in asserted), setting
    with_overlap = [o for o in asserted if "optim.zero_stage=2" in o and "optim.overlap_grad_reduce=true" in o]
    assert with_overlap and len(with_overlap) < sum("optim.zero_stage=2" in o for o in asserted)  # and without


def test_plan_cli_and_submit_refuses_a_layout_that_does_not_fit(capsys):
    import json

    from hpc_train.cli import main

    main(["plan", "configs/gpt_70b.yaml", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and 20 * 2**30 < plan["total"] < 80 * 2**30 and plan["microbatches_in_flight"] == 5
    main(["plan", "configs/gpt_7b.yaml", "--search", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
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


def test_plan_reports_the_worst_pipeline_stage_and_names_it(capsys):
    """Every pipeline rank is estimated and the one that needs the most reported: at 130B tp4 pp8 over 512
    micro-batches, rank 1 (one micro-batch fewer in flight than rank 0 and no embedding, but two receive
    buffers per micro-batch where rank 0 has one)."""
    import json

    from hpc_train.cli import main
    from hpc_train.job import check_run, load_config
    from hpc_train.planner import activation_parts, estimate, pipeline_buffers, stage_estimate

    cfg = load_config("configs/gpt_130b.yaml", ["data.train_path=stdlib", "data.valid_path=null"])
    dims = check_run(cfg, 64, check_paths=False)
    stages = [stage_estimate(cfg, dims, rank) for rank in range(dims.pp)]
    first, second, last = stages[0], stages[1], stages[-1]
    assert [s.microbatches_in_flight for s in stages] == list(range(8, 0, -1))
    buffer = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model * 2 // cfg.parallel.tp  # bf16, SP
    received = [pipeline_buffers(cfg, activation_parts(cfg), rank) for rank in (0, 1, 7)]
    assert received == [512 * buffer, 2 * 512 * buffer, 512 * buffer]
    assert first.params > second.params < last.params  # the embedding; the head and final norm
    assert estimate(cfg, dims) == second and second.total == max(s.total for s in stages) > first.total
    main(["plan", "configs/gpt_130b.yaml", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert (plan["stage"], plan["stages"], plan["total"]) == (1, 8, second.total)
    main(["plan", "configs/gpt_130b.yaml"])
    assert "per rank (worst stage: 1 of 8, pipeline ranks from 0):" in capsys.readouterr().out


def test_plan_counts_context_parallelism():
    """cp divides a rank's activations by cp (its sequence shard) and `plan --search` tries cp, in both
    modes, for long sequences only."""
    from hpc_train.distributed.mesh import ParallelDims
    from hpc_train.job import load_config
    from hpc_train.planner import activation_bytes, search, traffic
    from tests.conftest import TINY_MODEL

    long = [*TINY_MODEL, "model.seq_len=16384", "train.micro_batch_size=1"]
    one, four = load_config(None, long), load_config(None, [*long, "parallel.cp=4"])
    assert activation_bytes(four) == pytest.approx(activation_bytes(one) / 4, rel=0.05)  # + what every rank keeps
    assert traffic(one, ParallelDims()).get("cp", 0) == 0 < traffic(four, ParallelDims(cp=4))["cp"]
    rows = search(one, 8, 80 * 2**30, 1e15)
    assert {(r["cp"], r["cp_mode"]) for r in rows if r["cp"] > 1} >= {(2, "ring"), (4, "ulysses")}
    assert all(r["tp"] * r["pp"] * r["dp"] * r["cp"] == 8 for r in rows)
    short = search(load_config(None, TINY_MODEL), 8, 80 * 2**30, 1e15)
    assert all(r["cp"] == 1 for r in short)


def test_plan_search_says_what_it_shows_where_the_config_stands_and_how_to_get_each_row(capsys):
    """`plan --search` (issue 71): how many layouts it searched, fit and shows; the config's own layout and its
    rank among those that fit; the rows that tie with the fastest (an estimate within 5% of its, less than the
    estimate's error) marked; a legend; and each row's overrides, only the keys that differ from the config,
    which give the same plan: the config with them has the same bytes and estimated step time."""
    import functools
    import json
    import shlex

    import yaml

    from hpc_train.cli import main
    from hpc_train.job import check_run, load_config
    from hpc_train.planner import GiB, estimate, step_time_estimate

    main(["plan", "configs/tiny.yaml", "--search", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows, own = report["rows"], report["own"]
    fitting = [r for r in rows if r["fits"]]
    assert report["world"] == 2 and report["searched"] == len(rows) and report["fit"] == len(fitting) > 20
    assert own["rank"] == 1 + sum(r["step_s"] < own["step_s"] for r in fitting) > 1 and not own["tie"]
    (same,) = [r for r in rows if not r["overrides"]]  # the config's own layout is among those searched
    assert (same["total_gib"], same["step_s"]) == (own["total_gib"], own["step_s"])
    assert [r["tie"] for r in rows] == [r["fits"] and r["step_s"] <= 1.05 * rows[0]["step_s"] for r in rows]
    assert 0 < report["ties"] == sum(r["tie"] for r in rows) < report["fit"] and report["tie_within"] == 0.05
    base = load_config("configs/tiny.yaml")
    for row in rows:
        for item in row["overrides"]:
            key, value = item.split("=", 1)
            assert functools.reduce(getattr, key.split("."), base) != yaml.safe_load(value), (item, row)
    nvme = next(r for r in rows if r["offload"] == "nvme")
    assert {"optim.offload=nvme", "optim.offload_dir=$SLURM_TMPDIR/hpc_train_offload"} <= set(nvme["overrides"])
    interleaved = next(r for r in rows if r["schedule"] == "interleaved_1f1b")
    for row in (rows[0], nvme, interleaved, rows[-1]):
        cfg = load_config("configs/tiny.yaml", row["overrides"])
        dims = check_run(cfg, 2, check_paths=False)
        planned = (estimate(cfg, dims).total / GiB, step_time_estimate(cfg, dims, 989e12))
        assert planned == (row["total_gib"], row["step_s"]), row

    main(["plan", "configs/tiny.yaml", "--search"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"2 ranks, 80 GiB per GPU: {len(rows)} layouts searched, {len(fitting)} fit; the 20 fastest "
                        "below (--json lists all)")  # fmt: skip
    assert lines[1].startswith("the config's layout (tp=1 pp=1 dp=2, mbs 8 x accum 1, recompute=none, zero=0, "
                               f"offload=none, adamw): #{own['rank']} of {len(fitting)} that fit, est. ")  # fmt: skip
    assert lines[2].startswith(f"{report['ties']} layout(s) tie with the fastest (~: within 5% of its estimate)")
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "~", "tp"])
    assert lines[header].endswith("step s  overrides") and "disk GiB" not in lines[header]  # no nvme row shown
    table, legend = lines[header + 1 : header + 21], " ".join(line.strip() for line in lines[header + 21 :])
    assert [line.split()[:2] for line in table] == [[str(i), "~" if r["tie"] else str(r["tp"])] for i, r in
                                                     enumerate(fitting[:20], 1)]  # fmt: skip
    assert all(line.endswith(f"  {shlex.join(r['overrides'])}") for line, r in zip(table, fitting, strict=False))
    assert legend.startswith("legend: #: rank by estimated step time; ~: a tie, within 5% of the fastest's estimate")
    assert "overrides: the key=value arguments that give the layout from this config" in legend


def test_plan_search_keeps_the_update_rule_and_a_plan_that_does_not_fit_exits_1_with_the_nearest_fix(capsys):
    """The update rule is kept unless --allow-rule-change (a low-bit one changes the numerics): the layouts
    that fit only with 8-bit or 4-bit moments are counted, and with the flag listed, their overrides setting
    optim.name. The disk column and its legend where a row shown offloads to nvme. Where nothing fits,
    `plan --search` exits 1 naming the closest layout and what would fit it (a larger GPU, more ranks: the
    overrides given fit there); a `plan` that does not fit exits 1 with the nearest fix, which fits."""
    import json

    from hpc_train.cli import main
    from hpc_train.job import check_run, load_config
    from hpc_train.planner import GiB, estimate

    tight = ["plan", "configs/tiny.yaml", "--world", "1", "--gpu-mem", "0.012", "--search"]
    main([*tight, "--json"])
    kept = json.loads(capsys.readouterr().out)
    main([*tight, "--json", "--allow-rule-change"])
    changed = json.loads(capsys.readouterr().out)
    assert {r["optim"] for r in kept["rows"]} == {"adamw"} and kept["fit_with_rule_change"] > 0
    low_bit = [r for r in changed["rows"] if r["optim"] != "adamw"]
    assert len(low_bit) == kept["fit_with_rule_change"] == changed["fit"] - kept["fit"]
    assert all(r["fits"] and f"optim.name={r['optim']}" in r["overrides"] for r in low_bit)
    main(tight)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"1 rank, 0.012 GiB per GPU: 108 layouts searched, {kept['fit']} fit")
    assert f"{kept['fit_with_rule_change']} layout(s) that fit only with 8-bit or 4-bit AdamW moments are left " \
           "out" in lines[3]  # fmt: skip
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "~", "tp"])
    assert "host GiB  disk GiB    step s" in lines[header]
    legend = " ".join(line.strip() for line in lines[header + 1 + kept["fit"] :])
    assert "disk GiB: optimizer state a rank keeps on its node's own disk (optim.offload=nvme)" in legend

    nothing = ["plan", "configs/tiny.yaml", "--world", "1", "--gpu-mem", "0.002", "--search"]
    with pytest.raises(SystemExit) as none_fit:
        main([*nothing, "--json"])
    report = json.loads(capsys.readouterr().out)
    fix = report["fix"]
    assert none_fit.value.code == 1 and report["fit"] == 0 and fix["gpu_mem_gib"] == 1
    assert fix["closest"]["total_gib"] == min(r["total_gib"] for r in report["rows"]) > 0.002
    cfg = load_config("configs/tiny.yaml", fix["more_ranks"]["overrides"])
    assert fix["more_ranks"]["world"] == 2 and estimate(cfg, check_run(cfg, 2, check_paths=False)).total <= 0.002 * GiB
    with pytest.raises(SystemExit) as none_fit:
        main(nothing)
    out = capsys.readouterr().out
    assert none_fit.value.code == 1 and "1 rank, 0.002 GiB per GPU: 108 layouts searched, none fit" in out
    assert "nothing fits: the closest layout needs" in out and "  a GPU of 1 GiB: --gpu-mem 1" in out
    assert "  more ranks: --world 2, where parallel.tp=2 " in out

    with pytest.raises(SystemExit) as too_big:
        main(["plan", "configs/tiny.yaml", "--gpu-mem", "0.03"])
    out = capsys.readouterr().out
    assert too_big.value.code == 1 and "DOES NOT FIT in 0.03 GiB per GPU" in out
    assert "nearest fix: model.recompute=full fits at " in out and "add --search to rank every layout" in out
    with pytest.raises(SystemExit):
        main(["plan", "configs/tiny.yaml", "--gpu-mem", "0.03", "--json"])
    plan = json.loads(capsys.readouterr().out)
    cfg = load_config("configs/tiny.yaml", plan["fix"]["overrides"])
    assert not plan["fits"] and estimate(cfg, check_run(cfg, 2, check_paths=False)).total <= 0.03 * GiB


def test_a_block_keeps_megatrons_32_bytes_per_sbh_element_over_tp_with_sequence_parallelism(measured):
    """A GPT-2 block with selective recompute under tensor parallelism t with sequence parallelism keeps
    32/t bytes per s·b·h element (Korthikanti et al.'s 34/t less the dropout masks): the projections keep
    their input sharded and gather it again in backward, and at ZeRO-0 (autocast over fp32 weights) the
    residual stream is bf16 and the weights' casts are the step's, not the micro-batch's. Measured tensor
    by tensor at tp2 and tp4 (tools/activation_table.py), and the planner's formula says the same; with
    the gathered inputs kept instead, the same run keeps more, runs as many matmuls and gives the same loss
    and gradients to the bit. (Run in the grid's 4-rank launch: `measured`.)"""
    for name, table in measured[BLOCKS].items():
        # (at ZeRO-0 the norms keep their fp32 weight and bias cast to bf16 each forward: 0.16 of the 32 at
        # this tiny width and sequence, nothing at scale)
        assert per_element(table) * table["tp"] == pytest.approx(32, abs=0.2), (name, table["tensors"])
        assert table["planned"] == pytest.approx(sum(table["tensors"].values()), rel=0.01), name
        # the same run keeping the gathered inputs keeps 2 bytes more per element of each, whole, and runs
        # as many matmuls: backward gathers again, it does not multiply again
        kept = table["kept_gathered"]
        assert per_element({**kept, "sbh": table["sbh"]}) - per_element(table) == pytest.approx(
            4 - 4 / table["tp"], abs=0.01
        )
        assert kept["matmuls"] == table["matmuls"] > 0
        assert table["same_gradients"] and kept["loss"] == table["loss"]
    # ZeRO-0's weight casts are the step's: their own line in the plan (the grid's gpt2_tp2_sp_bf16_autocast
    # total checks their bytes against the measured peak), none at ZeRO-1
    for z in (0, 1):
        cfg = load_config(None, [*BLOCK_MODEL, *BLOCK_LAYOUTS["tp2"][1], f"optim.zero_stage={z}", "parallel.nproc=4"])
        dims = check_run(cfg, 4, check_paths=False)
        plan = estimate(cfg, dims)
        assert (plan.weight_casts > 0) == (z == 0) == ("weights' casts" in format_estimate(cfg, dims, plan, 2**30))


@pytest.mark.parametrize(
    "overrides, dims, copies",
    [
        (["slurm.nodes=2", "checkpoint.memory_interval=1", "optim.zero_stage=1"], {"dp": 2}, 4),
        (["slurm.nodes=2", "checkpoint.memory_interval=1"], {"dp": 2}, 2),  # its twin keeps the tensors
        (["slurm.nodes=2", "checkpoint.memory_interval=1", "parallel.tp=2", "slurm.tasks_per_node=2"], {"tp": 2}, 4),
        (["checkpoint.memory_interval=1"], {"dp": 2}, 2),  # one node: no partner
        (["slurm.nodes=2", "checkpoint.local_dir=/tmp/x", "checkpoint.local_interval=1"], {"dp": 2, "tp": 1}, 1),
        (["slurm.nodes=2", "checkpoint.local_dir=/tmp/x", "checkpoint.local_interval=1", "optim.zero_stage=1"],
         {"dp": 2}, 2),
    ],
    ids=["memory_zero1", "memory_twin", "memory_tp_across_nodes", "memory_one_node", "disk_twin", "disk_zero1"],
)  # fmt: skip
def test_node_local_checkpoints_count_their_copies_in_host_memory(overrides, dims, copies):
    """On disk, the state copy they are written from and the partner's copy a save receives (none where a dp
    twin on another node holds the tensors, at ZeRO-0); in memory, the two steps kept of each in a tmpfs."""
    from hpc_train.distributed.mesh import ParallelDims
    from hpc_train.planner import local_copies, stage_estimates
    from tests.conftest import TINY_MODEL

    cfg = load_config(None, [*TINY_MODEL, "parallel.max_restarts=1", "checkpoint.interval=2", *overrides])
    assert local_copies(cfg, ParallelDims(**dims)) == copies
    plan = stage_estimates(cfg, ParallelDims(**dims))[0]
    assert plan.host_copy == copies * (plan.params + plan.optimizer)
