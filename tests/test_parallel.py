"""4D parallelism: every (pp, dp, cp, tp) layout trains exactly like one process on the same global batch,
for every model family (llama; gpt2, whose tied embeddings span pipeline stages and tp shards).

Each launch runs several layouts one after another in the same worker processes (a fresh process group
per layout) to keep the suite fast. Compared against the single-process run: the loss and the global
gradient norm of every step, and the final parameters gathered to full tensors.
"""

import importlib.util

import pytest

from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import load_config
from hpc_train.launch.local import launch_sequence
from hpc_train.planner import traffic
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, max_param_diff, read_final_model, read_metrics
from tools.bench_parallel import counted_training

STEPS = 3
TOL = 1e-5
ARCHS = ("llama", "gpt2")
COMMON = [*TINY_MODEL, f"train.steps={STEPS}"]  # 2 layers: a step's cost is mostly per-layer dispatch
# the interleaved schedule needs pp x virtual_stages = 4 layers: its layouts compare with a 4-layer reference
DEEP = "model.n_layers=4"
SP = "parallel.sequence_parallel=true"
INTERLEAVED = ["parallel.virtual_stages=2", "parallel.schedule=interleaved_1f1b", DEEP]
# the head and loss a few tokens at a time (uneven chunks too; whole sequences under SP), against the
# reference's single chunk
CHUNKED = "model.loss_chunk_tokens=96"
# name -> (world size, overrides); global batch 8 everywhere
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=8", CHUNKED]),
    "tp2_sp": (2, ["parallel.tp=2", SP, "train.micro_batch_size=4", "train.grad_accum=2", CHUNKED]),
    "pp2_1f1b": (2, ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=2", CHUNKED]),
    "pp2_interleaved": (2, ["parallel.pp=2", *INTERLEAVED, "train.micro_batch_size=2", "train.grad_accum=4"]),
    "tp2_dp2": (4, ["parallel.tp=2", SP, "train.micro_batch_size=2", "train.grad_accum=2"]),
    "pp2_tp2": (4, ["parallel.pp=2", "parallel.tp=2", SP, "train.micro_batch_size=4", "train.grad_accum=2"]),
    "pp2_dp2": (4, ["parallel.pp=2", "train.micro_batch_size=2", "train.grad_accum=2"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", SP, "train.micro_batch_size=2", "train.grad_accum=2"]),
    "dp2": (2, ["train.micro_batch_size=4", CHUNKED]),
    "dp4": (4, ["train.micro_batch_size=2"]),
    # activation recompute changes memory, never numbers
    "tp2_sp_full_recompute": (2, ["parallel.tp=2", SP, "train.micro_batch_size=8", "model.recompute=full"]),
    "pp2_selective_recompute": (
        2,
        ["parallel.pp=2", "train.micro_batch_size=4", "train.grad_accum=2", "model.recompute=selective"],
    ),
}
# context parallelism: each sample's sequence split over cp ranks (ring: zig-zag, KV passed around the ring;
# Ulysses: all-to-all to head shards), alone and with tp + SP, pp, dp with ZeRO-3, and the ring recomputed
RING, ULYSSES = "parallel.cp_mode=ring", "parallel.cp_mode=ulysses"
LAYOUTS.update({
    "cp2_ring": (2, ["parallel.cp=2", RING, "train.micro_batch_size=4", "train.grad_accum=2", CHUNKED]),
    # ZeRO-3 at dp=1: FSDP2 shards over dp x cp
    "cp2_ulysses_zero3": (2, ["parallel.cp=2", ULYSSES, "train.micro_batch_size=8", "optim.zero_stage=3"]),
    "cp2_ring_recompute": (2, ["parallel.cp=2", RING, "train.micro_batch_size=8", "model.recompute=selective"]),
    "cp4_ring": (4, ["parallel.cp=4", RING, "train.micro_batch_size=8"]),
    "cp4_ulysses": (4, ["parallel.cp=4", ULYSSES, "train.micro_batch_size=4", "train.grad_accum=2"]),
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.cp=2", RING, SP, "train.micro_batch_size=4", "train.grad_accum=2"]),
    "pp2_cp2": (4, ["parallel.pp=2", "parallel.cp=2", ULYSSES, "train.micro_batch_size=4", "train.grad_accum=2"]),
    "dp2_cp2_zero3": (4, ["parallel.cp=2", RING, "train.micro_batch_size=4", "optim.zero_stage=3"]),
})  # fmt: skip


# the schedules past interleaved 1F1B: interleaved zero bubble, ZBV and DualPipeV (each backward split into its
# input and weight halves, the weight halves run later; the V-shaped ones place stages r and 2pp-1-r on rank r,
# so gpt2's tied embedding has both ends on the first rank), at pp2 and pp4 (8 layers: two stages per rank),
# then with the features they compose with: ZeRO-1 (reductions launched from inside backward) + selective
# recompute, ZeRO-2 + full recompute, ZeRO-3 (FSDP2), tp2 + SP
DEEPER = "model.n_layers=8"
SCHEDULE = {name: [f"parallel.schedule={name}", "parallel.virtual_stages=2"]
            for name in ("interleaved_zb", "zbv", "dualpipev")}  # fmt: skip
for name, schedule in SCHEDULE.items():
    LAYOUTS[f"pp2_{name}"] = (2, ["parallel.pp=2", *schedule, DEEP, "train.micro_batch_size=2", "train.grad_accum=4"])
    LAYOUTS[f"pp4_{name}"] = (4, ["parallel.pp=4", *schedule, DEEPER, "train.micro_batch_size=1", "train.grad_accum=8"])
ZERO_BUCKETS = "optim.bucket_mb=0.05"
LAYOUTS.update({
    "pp2_dp2_zbv_zero1_overlap_recompute": (4, ["parallel.pp=2", *SCHEDULE["zbv"], DEEP, "train.micro_batch_size=2",
        "train.grad_accum=2", "optim.zero_stage=1", "optim.overlap_grad_reduce=true", ZERO_BUCKETS,
        "model.recompute=selective"]),
    "pp2_dp2_dualpipev_zero2_recompute": (4, ["parallel.pp=2", *SCHEDULE["dualpipev"], DEEP, "train.micro_batch_size=1",
        "train.grad_accum=4", "optim.zero_stage=2", ZERO_BUCKETS, "model.recompute=full"]),
    "pp2_dp2_interleaved_zb_zero3": (4, ["parallel.pp=2", *SCHEDULE["interleaved_zb"], DEEP, "train.micro_batch_size=2",
        "train.grad_accum=2", "optim.zero_stage=3"]),
    "pp2_tp2_zbv": (4, ["parallel.pp=2", "parallel.tp=2", SP, *SCHEDULE["zbv"], DEEP, "train.micro_batch_size=4",
        "train.grad_accum=2"]),
})  # fmt: skip


def reference_of(layout: str) -> str:
    """The one-process run a layout compares with: of its depth."""
    overrides = LAYOUTS.get(layout, (0, []))[1]
    return "reference_deeper" if DEEPER in overrides else "reference_deep" if DEEP in overrides else "reference"


def _derive(variants: dict[str, str], extra: list[str]) -> None:
    """Add each variant: its base layout's world and overrides, plus `extra`."""
    for name, base in variants.items():
        LAYOUTS[name] = (LAYOUTS[base][0], [*LAYOUTS[base][1], *extra])


# ZeRO stages 1-3 (small buckets: several buckets, shard boundaries inside parameters; stage 3: FSDP2)
# against the same layout with plain data parallelism
ZERO_LAYOUTS = {
    "dp2_zero1": "dp2",
    "dp2_zero1_offload": "dp2",
    "dp4_zero1": "dp4",
    "tp2_dp2_zero1": "tp2_dp2",
    "pp2_dp2_zero1": "pp2_dp2",
    "dp2_zero2": "dp2",
    "dp4_zero2": "dp4",
    "pp2_dp2_zero2": "pp2_dp2",
    "tp2_dp2_zero2_overlap": "tp2_dp2",
    "pp2_dp2_zero2_overlap": "pp2_dp2",
    "dp4_zero3": "dp4",
    "dp2_zero3_offload": "dp2",
    "tp2_dp2_zero3": "tp2_dp2",
    "pp2_dp2_zero3": "pp2_dp2",
}
SUFFIXES = {"offload": ["optim.offload=cpu"], "overlap": ["optim.overlap_grad_reduce=true"]}
for name, base in ZERO_LAYOUTS.items():
    stage, extra = name.split("zero")[1][0], SUFFIXES.get(name.split("_")[-1], [])
    _derive({name: base}, [f"optim.zero_stage={stage}", "optim.bucket_mb=0.05", *extra])
# dp reductions launched from inside backward (several micro-batches, SP placement fixes, pipeline stages)
# against the same layout reducing after backward: the same numbers exactly
OVERLAP_LAYOUTS = {
    "tp2_dp2_zero1_overlap": "tp2_dp2_zero1",
    "pp2_dp2_zero1_overlap": "pp2_dp2_zero1",
    "tp2_dp2_overlap": "tp2_dp2",
    "tp2_pp2_dp2_overlap": "tp2_pp2_dp2",
}
_derive(OVERLAP_LAYOUTS, ["optim.overlap_grad_reduce=true", "optim.bucket_mb=0.05"])
# every block's saved tensors through host memory (model.activation_offload) against the same layout keeping
# them: the same tensors come back, so the same numbers, bit for bit (tp2 x pp2: DTensors, pipeline micro-batches)
OFFLOAD_LAYOUTS = {"pp2_tp2_offload": "pp2_tp2"}
_derive(OFFLOAD_LAYOUTS, ["model.activation_offload=full"])


# train.compile=true (inductor on CPU) against the eager single-process reference, llama only (each compile
# costs tens of seconds): tensor + sequence parallel, pipeline with selective recompute, and both cp modes with
# ZeRO-1 over dp x cp (their exchanges run eagerly between compiled graphs; the blocks' graphs are the same for
# both, so the second compiles nothing new). Compiled kernels fuse and reorder fp32 reductions (norms,
# softmax), so they match to rounding, within TOL, not bitwise.
COMPILED_LAYOUTS = {
    "tp2_sp": LAYOUTS["tp2_sp"],
    "pp2_selective_recompute": LAYOUTS["pp2_selective_recompute"],
    "cp2_ring_zero1": (2, [*LAYOUTS["cp2_ring"][1], "optim.zero_stage=1"]),
    "cp2_ulysses_zero1": (2, ["parallel.cp=2", ULYSSES, "train.micro_batch_size=8", "optim.zero_stage=1"]),
}


# optim.name=muon (llama): its Newton-Schulz iteration runs in bf16 and amplifies fp32 rounding in the
# gradient's small singular directions, so one process with another micro-batch split already differs from
# itself by 3.4e-5 in the weights after 3 steps: layouts match to that, not to TOL. (That every strategy
# updates exactly as torch.optim.Muon on the same gradients is tests/test_rules.py's.)
MUON_LAYOUTS = {"tp2_muon": "tp2", "dp2_zero1_muon": "dp2_zero1"}
MUON_TOL = 1e-4


# data.reset_position_ids + data.document_mask on a corpus of short documents (several per sample, most longer
# than a cp shard and crossing shard boundaries), with evaluation, against one process with them on (and off,
# llama: the loop applies them to training and evaluation); context parallelism masks every exchanged key by its
# document, and the pipeline hands each stage its micro-batch's documents
DOCUMENTS = ["data.reset_position_ids=true", "data.document_mask=true", f"train.eval_interval={STEPS}"]
DOCUMENTS_OFF = ["data.reset_position_ids=false", "data.document_mask=false"]
DOCUMENT_LAYOUTS = ("tp2_sp", "cp2_ring", "cp4_ring", "cp4_ulysses", "pp2_1f1b", "pp2_cp2")
# gpt2's learned positions are looked up on the first stage only: its cp shards and first stages
GPT2_DOCUMENT_LAYOUTS = ("tp2_sp", "cp2_ring", "pp2_cp2")


# eval.tasks and the held-out loss at the last step (llama; the tasks with the `.[eval]` extra): each layout's
# figures are one process's, its requests scored through the layout's own forward: tp's gathered logits (with
# SP), cp's summed shards, the last pipeline stage's (a V-shaped schedule's, forward only, on the first rank),
# each dp rank its share; cp's with packed documents on (their run evaluates already): layout -> its reference
DOWNSTREAM = {"tp2_dp2": "reference", "pp2_dp2": "reference", "pp2_zbv": "reference_deep",
              "cp2_ring_documents": "reference_documents"}  # fmt: skip
LM_EVAL = importlib.util.find_spec("lm_eval") is not None


def document_layouts(arch: str) -> tuple[str, ...]:
    return GPT2_DOCUMENT_LAYOUTS if arch == "gpt2" else DOCUMENT_LAYOUTS


def _config(base, arch: str, name: str, extra: list[str], corpus: str):
    overrides = [*COMMON, f"model.arch={arch}", f"data.train_path={corpus}", f"run_dir={base / arch / name}", *extra]
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus, short_documents, local_tasks):
    """Run directory per model family: <arch>/reference and <arch>/<layout>."""
    base = tmp_path_factory.mktemp("layouts")
    scored = {*DOWNSTREAM, *DOWNSTREAM.values()}
    tasks = ["eval.tasks=[local_mc,local_next,local_text]", f"eval.include_path={local_tasks}"] if LM_EVAL else []
    held_out = [f"train.eval_interval={STEPS}", f"data.valid_path={small_corpus}_valid"]
    evals = lambda name: tasks if name.endswith("documents") else [*held_out, *tasks]
    cfg = lambda arch, name, extra: _config(base, arch, name, [*extra, *evals(name)] if arch == "llama" and name in
                                            scored else extra, small_corpus)  # fmt: skip
    muon = lambda name, extra: cfg("llama", name, [*extra, "optim.name=muon"])
    docs = lambda arch, name, extra: cfg(arch, name, [*DOCUMENTS, f"data.train_path={short_documents}",
                                                      f"data.valid_path={short_documents}", *extra])  # fmt: skip
    references = [cfg(arch, "reference", ["train.micro_batch_size=8"]) for arch in ARCHS]
    depths = (("reference_deep", DEEP), ("reference_deeper", DEEPER))
    references += [cfg(arch, name, ["train.micro_batch_size=8", depth]) for arch in ARCHS for name, depth in depths]
    references += [docs(arch, "reference_documents", ["train.micro_batch_size=8"]) for arch in ARCHS]
    references.append(docs("llama", "documents_off", ["train.micro_batch_size=8", *DOCUMENTS_OFF]))
    muon_runs = [muon("reference_muon", ["train.micro_batch_size=8"]),
                 muon("split_muon", ["train.micro_batch_size=4", "train.grad_accum=2"])]  # fmt: skip
    launch_sequence(run_training, 1, [(c,) for c in [*references, *muon_runs]])
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        cfgs = [cfg(arch, n, [*LAYOUTS[n][1], f"parallel.nproc={world}"]) for arch in ARCHS for n in names]
        cfgs += [muon(n, [*LAYOUTS[base][1], f"parallel.nproc={world}"])
                 for n, base in MUON_LAYOUTS.items() if LAYOUTS[base][0] == world]  # fmt: skip
        cfgs += [docs(arch, f"{n}_documents", [*LAYOUTS[n][1], f"parallel.nproc={world}"])
                 for arch in ARCHS for n in document_layouts(arch) if LAYOUTS[n][0] == world]  # fmt: skip
        cfgs += [cfg("llama", f"{n}_compiled", [*extra, f"parallel.nproc={world}", "train.compile=true"])
                 for n, (w, extra) in COMPILED_LAYOUTS.items() if w == world]  # fmt: skip
        launch_sequence(counted_training, world, [(c,) for c in cfgs])  # run_training, counting cp's bytes
    return {arch: base / arch for arch in ARCHS}


@pytest.mark.parametrize(
    ("arch", "layout"),
    [(arch, name) for arch in ARCHS for name in LAYOUTS] + [("llama", f"{n}_compiled") for n in COMPILED_LAYOUTS],
)
def test_layout_matches_single_process(runs, arch, layout):
    runs, reference = runs[arch], reference_of(layout)
    ref, got = read_metrics(runs / reference), read_metrics(runs / layout)
    assert len(got) == STEPS
    for r, g in zip(ref, got, strict=True):
        assert abs(r["loss"] - g["loss"]) <= TOL, (r["step"], r["loss"], g["loss"])
        assert abs(r["grad_norm"] - g["grad_norm"]) <= TOL * max(1.0, r["grad_norm"]), r["step"]
    assert max_param_diff(read_final_model(runs / layout), read_final_model(runs / reference)) <= TOL
    assert ref[-1]["loss"] < ref[0]["loss"]
    # a compiled layout's records count its recompiles (the compile feature was on), and nothing recompiled
    compiled = layout.endswith("_compiled")
    assert [g.get("recompiles") for g in got] == ([0] * STEPS if compiled else [None] * STEPS)


@pytest.mark.parametrize("layout", list(DOWNSTREAM))
def test_evaluation_scores_alike_in_every_layout(runs, layout):
    """The held-out loss, and the multiple-choice and greedy accuracies and the rolling likelihood's figures of
    eval.tasks, in metrics.jsonl at the last step, are one process's (test_downstream.py: one process's are
    lm-eval's HFLM)."""
    ref, got = read_metrics(runs["llama"] / DOWNSTREAM[layout])[-1], read_metrics(runs["llama"] / layout)[-1]
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= TOL
    pytest.importorskip("lm_eval")
    figures = {key: value for key, value in ref.items() if key.startswith("downstream/")}
    assert figures.keys() == {key for key in got if key.startswith("downstream/")}
    assert {"downstream/local_mc/acc", "downstream/local_next/acc", "downstream/local_text/bits_per_byte"} <= set(got)
    for key, value in figures.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(ZERO_LAYOUTS))
def test_zero_matches_plain_data_parallel(runs, arch, layout):
    runs = runs[arch]
    zero, plain = read_final_model(runs / layout), read_final_model(runs / ZERO_LAYOUTS[layout])
    assert max_param_diff(zero, plain) <= 1e-6
    losses = [m["loss"] for m in read_metrics(runs / layout)]
    assert losses == pytest.approx([m["loss"] for m in read_metrics(runs / ZERO_LAYOUTS[layout])], abs=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(OFFLOAD_LAYOUTS))
def test_activation_offload_trains_bit_for_bit(runs, arch, layout):
    """The loss curve, the gradient norms and the final weights of the offloaded run are those of the run
    that keeps its activations, exactly; every step moved its blocks' tensors through host memory."""
    runs, base = runs[arch], OFFLOAD_LAYOUTS[layout]
    got, kept = read_metrics(runs / layout), read_metrics(runs / base)
    assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in kept]
    assert max_param_diff(read_final_model(runs / layout), read_final_model(runs / base)) == 0
    assert all(m["activation_offload"]["bytes"] > 0 and m["activation_offload"]["prefetched"] > 0 for m in got)
    assert all("activation_offload" not in m for m in kept)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(OVERLAP_LAYOUTS))
def test_overlapped_reduction_matches_reduction_after_backward(runs, arch, layout):
    runs = runs[arch]
    base = OVERLAP_LAYOUTS[layout]
    assert max_param_diff(read_final_model(runs / layout), read_final_model(runs / base)) == 0
    assert [m["grad_norm"] for m in read_metrics(runs / layout)] == [m["grad_norm"] for m in read_metrics(runs / base)]


def test_muon_noise_floor_is_one_process_with_another_split(runs):
    """What MUON_TOL allows: one process, the batch in 2 micro-batches instead of 1, already moves the
    weights by more than TOL under Muon (the bf16 iteration), and by less than MUON_TOL."""
    runs = runs["llama"]
    diff = max_param_diff(read_final_model(runs / "split_muon"), read_final_model(runs / "reference_muon"))
    assert TOL < diff <= MUON_TOL


@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_layout_matches_single_process(runs, layout):
    runs = runs["llama"]
    ref, got = read_metrics(runs / "reference_muon"), read_metrics(runs / layout)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], abs=TOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=MUON_TOL)
    assert max_param_diff(read_final_model(runs / layout), read_final_model(runs / "reference_muon")) <= MUON_TOL
    adamw = read_final_model(runs / "reference")  # the rule was applied: Muon's weights are not AdamW's
    assert max_param_diff(read_final_model(runs / "reference_muon"), adamw) > 5 * MUON_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_documents_train_alike_in_every_layout(runs, arch):
    runs = runs[arch]
    ref = read_metrics(runs / "reference_documents")
    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"] and "eval_loss" in ref[-1]
    if arch == "llama":
        off = read_metrics(runs / "documents_off")
        assert abs(ref[0]["loss"] - off[0]["loss"]) > 1e-4 and abs(ref[-1]["eval_loss"] - off[-1]["eval_loss"]) > 1e-4
    reference = read_final_model(runs / "reference_documents")
    for layout in document_layouts(arch):
        got = read_metrics(runs / f"{layout}_documents")
        for r, g in zip(ref, got, strict=True):
            assert abs(r["loss"] - g["loss"]) <= TOL and abs(r.get("eval_loss", 0) - g.get("eval_loss", 0)) <= TOL
        assert max_param_diff(read_final_model(runs / f"{layout}_documents"), reference) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if "cp" in name])
def test_context_parallel_bytes_are_the_planners(runs, arch, layout):
    """What rank 0 sent over cp per step, counted at the primitives, is the planner's cp traffic (a
    pipeline's first step adds the forward that infers its shapes: at most one step's more over the run)."""
    cfg = load_config(None, [*COMMON, f"model.arch={arch}", *LAYOUTS[layout][1]])
    dims = ParallelDims(pp=cfg.parallel.pp, cp=cfg.parallel.cp, tp=cfg.parallel.tp)
    sent, planned = float((runs[arch] / layout / "cp_bytes_0").read_text()), traffic(cfg, dims)["cp"]
    if cfg.parallel.pp == 1:
        assert sent > 0 and sent == pytest.approx(planned, rel=1e-9)
    else:
        assert planned < sent < planned * (1 + 1 / STEPS)
