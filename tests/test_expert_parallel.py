"""Expert parallelism (parallel.ep): routed experts sharded over ranks carved from dp, tokens dispatched and
combined by all-to-all, expert gradients reduced over their own group; and MoE layers under sequence and
context parallelism, each rank routing its own tokens. Every layout's loss curve, gradient norm, per-layer
expert loads and final weights (routing biases included) against one process; checkpoints resharded from ep2
to ep1 and back; the memory each rank holds; the refused layouts."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from hpc_train.checkpoint.safe_load import read_dcp_metadata
from hpc_train.config import ConfigError
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_sequence
from hpc_train.planner import estimate, format_estimate, local_param_count, traffic
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, assert_moe_run_matches, max_param_diff, read_final_model, read_metrics
from tools.bench_moe import counted_training  # counts the bytes all_to_all_single sends

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.bias_update_rate=0.01", "model.moe.num_shared_experts=1"]  # fmt: skip
EXPERT_BYTES = 2 * 3 * 4 * 64 * 32 * 4  # two MoE layers' routed experts (w1, w3, w2 of 4 experts), fp32

# name -> (processes, overrides, steps); global batch 8 everywhere, as the reference's two micro-batches of 4
# (the aux loss is off: it is per micro-batch, and the 4-process layouts split their batch otherwise)
LAYOUTS = {
    "ep2": (2, ["train.micro_batch_size=4", "parallel.ep=2"], 3),
    # checkpoints: the first two steps at one ep (and ZeRO stage), the third resumed at the other
    "ep2_zero3_then_ep1": (
        2,
        ["train.micro_batch_size=4", "parallel.ep=2", "optim.zero_stage=3", "checkpoint.interval=2"],
        2,
    ),  # fmt: skip
    "ep1_then_ep2_zero2": (2, ["train.micro_batch_size=4", "checkpoint.interval=2"], 2),
    "ep2_tp2": (4, ["train.micro_batch_size=4", "parallel.ep=2", "parallel.tp=2"], 3),
    "ep2_pp2": (4, ["train.micro_batch_size=2", "train.grad_accum=2", "parallel.ep=2", "parallel.pp=2"], 3),
    # the experts' gradients reduce-scattered and their optimizer state (ZeRO-3: themselves) sharded over edp=2;
    # ZeRO-1 and -2 checkpoint at step 2 (sync; async), where an expert's state is held by one edp rank each,
    # and resume at ep2 and (a copy) at ep1
    "dp4_ep2_zero1": (
        4,
        [
            "train.micro_batch_size=2",
            "parallel.ep=2",
            "optim.zero_stage=1",
            "optim.bucket_mb=0.05",
            "checkpoint.interval=2",
        ],
        2,
    ),  # fmt: skip
    "dp4_ep2_zero2": (
        4,
        [
            "train.micro_batch_size=2",
            "parallel.ep=2",
            "optim.zero_stage=2",
            "optim.bucket_mb=0.05",
            "checkpoint.interval=2",
            "checkpoint.async_save=true",
        ],
        2,
    ),  # fmt: skip
    "dp4_ep2_zero3": (4, ["train.micro_batch_size=2", "parallel.ep=2", "optim.zero_stage=3"], 3),
}
# optim.name=muon: each expert's matrix orthogonalized on the rank holding it, against one process (Muon's
# bf16 iteration amplifies fp32 rounding: tests/test_parallel.py's MUON_TOL); the router stays on AdamW
MUON = ["optim.name=muon", "train.micro_batch_size=4", "checkpoint.interval=3"]
MUON_TOL = 1e-4
RESUMED = {
    "ep2_zero3_then_ep1": ["parallel.ep=1", "optim.zero_stage=0"],
    "ep1_then_ep2_zero2": ["parallel.ep=2", "optim.zero_stage=2", "optim.bucket_mb=0.05"],
    "dp4_ep2_zero1": [],
    "dp4_ep2_zero2": [],
}
RESUMED_AT_EP1 = ("dp4_ep2_zero1", "dp4_ep2_zero2")  # copies of these checkpoints, resumed at ep1
# sequence and context parallelism: each rank routes and computes only its own tokens; with the aux loss on
# (its load counts summed over the ranks holding the rest of a sample), against a reference with it on, whose
# micro-batches these layouts' are (dp1 with two of them, or dp2 with one); two steps (the biases move between)
SP = "parallel.sequence_parallel=true"
SPLIT = {
    "tp2_sp": (2, ["train.grad_accum=2", "parallel.tp=2", SP]),
    "cp2_ring_zero3": (2, ["train.grad_accum=2", "parallel.cp=2", "parallel.cp_mode=ring", "optim.zero_stage=3"]),
    "ep2_tp2_sp_zero1": (4, ["parallel.ep=2", "parallel.tp=2", SP, "optim.zero_stage=1", "optim.bucket_mb=0.05"]),
    "ep2_cp2_ulysses_zero2": (
        4,
        ["parallel.ep=2", "parallel.cp=2", "parallel.cp_mode=ulysses", "optim.zero_stage=2", "optim.bucket_mb=0.05"],
    ),  # fmt: skip
    "ep2_cp2_ring": (4, ["parallel.ep=2", "parallel.cp=2", "parallel.cp_mode=ring"]),
    "tp2_sp_cp2_ulysses": (4, ["train.grad_accum=2", "parallel.tp=2", SP, "parallel.cp=2", "parallel.cp_mode=ulysses"]),
}
AUX = ["model.moe.aux_loss_coef=0.1", "train.micro_batch_size=4"]


def test_expert_parallel_layouts_match_one_process(tmp_path, small_corpus):
    def cfg(name: str, world: int, steps: int, *extra: str):
        return load_config(None, [*TINY_MODEL, *MOE, f"train.steps={steps}", f"data.train_path={small_corpus}",
                                  f"run_dir={tmp_path / name}", f"parallel.nproc={world}", *extra])  # fmt: skip

    reference = cfg("reference", 1, 3, "train.micro_batch_size=4", "train.grad_accum=2")
    reference_muon = cfg("reference_muon", 1, 3, *MUON, "train.grad_accum=2")
    reference_aux = cfg("reference_aux", 1, 2, *AUX, "train.grad_accum=2")
    launch_sequence(run_training, 1, [(reference,), (reference_muon,), (reference_aux,)])
    ref, final = read_metrics(reference.run_dir), read_final_model(reference.run_dir)
    ep2_muon = cfg("ep2_zero1_muon", 2, 3, *MUON, "parallel.ep=2", "optim.zero_stage=1", "optim.bucket_mb=0.05")
    cfgs = {name: cfg(name, world, steps, *extra) for name, (world, extra, steps) in LAYOUTS.items()}
    resumed = {name: cfg(name, LAYOUTS[name][0], 3, *LAYOUTS[name][1], *other) for name, other in RESUMED.items()}
    at_ep1 = {f"{name}_then_ep1": cfg(f"{name}_then_ep1", 4, 3, *LAYOUTS[name][1], "parallel.ep=1")
              for name in RESUMED_AT_EP1}  # fmt: skip
    # every token to every expert: each rank sends exactly half its rows to the other (the planner's figure);
    # selective recompute runs no MoE forward again; full recompute of every second block runs the first again
    every_expert = ["train.micro_batch_size=4", "parallel.ep=2", "model.moe.top_k=4", "model.recompute_every=2"]
    every = {r: cfg(f"every_expert_{r}", 2, 1, *every_expert, f"model.recompute={r}") for r in ("selective", "full")}
    every_sp = cfg("every_expert_tp2_sp", 4, 1, *every_expert, "model.recompute=selective", "parallel.tp=2", SP)
    split = {name: cfg(name, world, 2, *AUX, *extra) for name, (world, extra) in SPLIT.items()}
    two = [(c,) for name, c in cfgs.items() if LAYOUTS[name][0] == 2]
    two += [(c,) for name, c in resumed.items() if LAYOUTS[name][0] == 2]
    two += [(c,) for c in (*every.values(), ep2_muon)] + [(c,) for name, c in split.items() if SPLIT[name][0] == 2]
    launch_sequence(counted_training, 2, two)
    four = [(c,) for name, c in cfgs.items() if LAYOUTS[name][0] == 4] + [(every_sp,)]
    launch_sequence(counted_training, 4, four + [(c,) for name, c in split.items() if SPLIT[name][0] == 4])
    # each expert shard written once: the files hold exactly the items DCP indexed, whose tensors are every
    # parameter's weight and ZeRO's three fp32 states (master, AdamW's moments) once, and the routing biases
    weights = {k: t[: reference.model.vocab_size] if k in VOCAB_ROWS else t for k, t in final.items()}
    biases = sum(t.numel() for k, t in weights.items() if k.endswith("expert_bias"))
    expected_tensor_bytes = 4 * (4 * sum(t.numel() for t in weights.values()) - 3 * biases)
    for name in RESUMED_AT_EP1:
        shutil.copytree(cfgs[name].run_dir, at_ep1[f"{name}_then_ep1"].run_dir)
        on_disk, items, tensor_bytes = written_bytes(Path(cfgs[name].run_dir) / "checkpoints/step_0000002")
        assert tensor_bytes == expected_tensor_bytes and on_disk == items, name
    four = [(c,) for name, c in resumed.items() if LAYOUTS[name][0] == 4] + [(c,) for c in at_ep1.values()]
    launch_sequence(counted_training, 4, four)
    cfgs.update(at_ep1)
    assert final["layers.1.mlp.router.expert_bias"].abs().sum() > 0  # the biases moved: routing is compared
    for name, c in cfgs.items():
        records = read_metrics(c.run_dir)
        assert len(records) == 3, name
        if name in RESUMED or name in at_ep1:
            assert records[2]["resumed_from"]["step"] == 2, name
        assert_moe_run_matches(c.run_dir, ref, final, name)  # the gradient norm counts each expert once
    ref_aux, final_aux = read_metrics(reference_aux.run_dir), read_final_model(reference_aux.run_dir)
    assert all(figures["aux_loss"] > 0 for r in ref_aux for figures in r["moe"].values())
    for name, c in split.items():  # loads summed, aux losses added, over the ranks splitting the tokens
        assert_moe_run_matches(c.run_dir, ref_aux, final_aux, name)
    muon_ref, muon_got = read_metrics(reference_muon.run_dir), read_metrics(ep2_muon.run_dir)
    assert [r["loss"] for r in muon_got] == pytest.approx([r["loss"] for r in muon_ref], abs=1e-5)
    assert [r["grad_norm"] for r in muon_got] == pytest.approx([r["grad_norm"] for r in muon_ref], rel=MUON_TOL)
    assert max_param_diff(read_final_model(ep2_muon.run_dir), read_final_model(reference_muon.run_dir)) < MUON_TOL
    saved = read_dcp_metadata(Path(ep2_muon.run_dir) / "checkpoints/step_0000003").state_dict_metadata
    assert "optim.layers.1.mlp.experts.w1.momentum_buffer" in saved  # the experts are Muon's
    assert "optim.layers.1.mlp.router.gate.weight.exp_avg" in saved  # the router AdamW's
    planned_runs = {**cfgs, **split}
    for name in ("ep2", "ep2_tp2", "ep2_pp2", "dp4_ep2_zero1", "dp4_ep2_zero2", "dp4_ep2_zero3", *SPLIT):
        record = read_metrics(planned_runs[name].run_dir)[0]
        for key in ("params", "grads", "optimizer"):
            assert record["memory_predicted_bytes"][key] == record["memory_bytes"][key], (name, key)
    rows, counts = 128 * 4 // 2 * 64 * 4, 4 * 8 // 2  # one all-to-all's rows, one exchange's counts
    # all-to-alls and count exchanges of the two MoE layers: 4 and 1 each, 6 and 2 for a block recomputed whole
    for recompute, (exchanges, forwards) in {"selective": (4 + 4, 1 + 1), "full": (6 + 4, 2 + 1)}.items():
        run = every[recompute]
        dims = check_run(run, 2, check_paths=False)
        sent, planned = float((Path(run.run_dir) / "ep_bytes_0").read_text()), traffic(run, dims)["ep"]
        assert sent == planned == exchanges * rows + forwards * counts, recompute
    # under sequence parallelism each tp rank dispatches its half of the sequence: half the rows, all the counts
    dims = check_run(every_sp, 4, check_paths=False)
    for rank in range(4):
        sent = float((Path(every_sp.run_dir) / f"ep_bytes_{rank}").read_text())
        assert sent == traffic(every_sp, dims)["ep"] == 8 * rows // 2 + 2 * counts, rank
    # `hpc-train plan` prints that figure; the routed experts per rank
    dims = check_run(run, 2, check_paths=False)
    text = format_estimate(run, dims, estimate(run, dims), 2**35)
    assert f"ep=2: 2 routed experts per rank, {planned / 2**30:.3f} GiB sent per rank and step by all-to-all" in text
    # under tp every tp rank sends its ep group the same rows as a rank of the same dp rank without tp sends
    sent = {(name, rank): (Path(cfgs[name].run_dir) / f"ep_bytes_{rank}").read_text() for name, rank in
            (("ep2", 0), ("ep2_tp2", 0), ("ep2_tp2", 1))}  # fmt: skip
    assert len(set(sent.values())) == 1 and float(sent["ep2", 0]) > 0, sent
    ep1, ep2 = (read_metrics(cfgs[name].run_dir)[0]["memory_bytes"] for name in ("ep1_then_ep2_zero2", "ep2"))
    assert ep1["params"] - ep2["params"] == EXPERT_BYTES // 2  # each rank holds half the experts
    assert ep1["grads"] - ep2["grads"] == EXPERT_BYTES // 2


VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")  # padded in the model, saved unpadded


def written_bytes(step_dir: Path) -> tuple[int, int, int]:
    """A checkpoint's bytes on disk, the bytes of the items its DCP index places in those files, and the
    tensor bytes of those items (each written chunk's elements; DCP frames each item, ~1.6 KB)."""
    metadata = read_dcp_metadata(step_dir)
    chunk_bytes = {(fqn, tuple(chunk.offsets)): math.prod(chunk.sizes) * entry.properties.dtype.itemsize
                   for fqn, entry in metadata.state_dict_metadata.items()
                   for chunk in getattr(entry, "chunks", [])}  # fmt: skip
    stored = metadata.storage_data.items()
    tensors = sum(chunk_bytes[index.fqn, tuple(index.offset)] for index, _ in stored if index.offset is not None)
    return sum(f.stat().st_size for f in step_dir.glob("*.distcp")), sum(i.length for _, i in stored), tensors


def test_refused_expert_parallel_layouts(make_cfg):
    with pytest.raises(ConfigError, match=r"parallel.ep=2 shards the routed experts(.|\n)*set parallel.ep=1"):
        check_run(make_cfg("parallel.ep=2"), 2, check_paths=False)
    with pytest.raises(ConfigError) as err:
        check_run(make_cfg(*MOE, "parallel.ep=3", "optim.zero_stage=3"), 6, check_paths=False)
    assert "parallel.ep=3 must divide model.moe.num_experts=4" in str(err.value)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide the data-parallel size 1"):
        check_run(make_cfg(*MOE, "parallel.ep=2", "parallel.tp=2"), 2, check_paths=False)
    check_run(make_cfg(*MOE, "parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "train.grad_accum=2"), 8,
              check_paths=False)  # fmt: skip


def test_zero3_shards_whole_experts(make_cfg):
    """FSDP2 shards a stacked experts weight by whole experts, padded to its ranks: at dp8 ep2 each of the
    4 edp ranks holding a layer's 2 local experts gets one of them (or a padding one), not a quarter of both."""
    widths = {}
    for hidden in (32, 64):
        cfg = make_cfg(*MOE, "model.moe.num_shared_experts=0", f"model.moe.expert_ffn_hidden={hidden}",
                       "parallel.ep=2", "optim.zero_stage=3")  # fmt: skip
        widths[hidden] = local_param_count(cfg, dp=8).shard_total
    assert widths[64] - widths[32] == 2 * 3 * 64 * 32  # two MoE layers, w1 w3 w2 of one expert each
