"""Activation recompute and activation offload: same losses and gradients as neither, and the measured
activation bytes (saved for backward, on the device) drop as each policy should, by the planner's figures.
The measurements themselves: a step's peak of live tensor bytes, and nothing they or the optimizers hook
keeps memory alive."""

import weakref

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hpc_train.builder import build_run
from hpc_train.data.indexed import IndexedDataset
from hpc_train.distributed.parallelize import forward_backward
from hpc_train.launch.local import single_process_group
from hpc_train.observe.memory import SavedActivations, StepPeak
from hpc_train.optim.buckets import BucketedReduction

POLICIES = {
    "none": [],
    "selective": ["model.recompute=selective"],
    "full": ["model.recompute=full"],
    "full_every_2": ["model.recompute=full", "model.recompute_every=2"],
    "full_first_1": ["model.recompute=full", "model.recompute_first=1"],
    # the blocks' saved tensors through host memory: every block but the last, every block, and beside
    # recompute (a block that recomputes keeps its own: here the first of every two)
    "offload_selective": ["model.activation_offload=selective"],
    "offload_full": ["model.activation_offload=full"],
    "offload_full_recompute_every_2": ["model.activation_offload=full", "model.recompute=full",
                                       "model.recompute_every=2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def measured(small_corpus, tmp_path_factory):
    from hpc_train.job import load_config
    from tests.conftest import TINY_MODEL

    results = {}
    with single_process_group() as rank_env:
        for name, overrides in POLICIES.items():
            cfg = load_config(None, [*TINY_MODEL, "model.n_layers=4", "train.micro_batch_size=4",
                                     f"data.train_path={small_corpus}", *overrides])  # fmt: skip
            model = build_run(cfg, rank_env, torch.device("cpu"), with_data=False).model
            data = IndexedDataset(small_corpus, cfg.model.seq_len)
            batch = [data.batch(np.arange(4))]
            freed = blocks_outputs_freed(model.chunks[0])
            with SavedActivations(model.parameters) as saved:
                loss = forward_backward(model, batch).item()
            grads = {n: p.grad.clone() for n, p in model.named_parameters}
            offloaded = [
                hook.after_update(torch.zeros(())) for hook in model.hooks if hook.name == "activation_offload"
            ]
            results[name] = (loss, grads, saved.bytes, offloaded[0] if offloaded else None, cfg, freed)
    return results


def blocks_outputs_freed(stage: torch.nn.Module) -> list[bool]:
    """Filled during the stage's next forward: whether each block's output was already freed when the final
    norm began, backward still to come. The next block saves that output for its backward: autograd keeps it
    alive unless that block's saved tensors went to host memory (copies), so an offloaded block's input is
    gone, and every other block's stays (on the CPU too, where host and device are one memory)."""
    outputs, freed = [], []
    for block in stage.layers.values():
        block.register_forward_hook(lambda module, args, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    stage.norm.register_forward_pre_hook(lambda module, args: freed.extend(ref.expired() for ref in outputs))
    return freed


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_recompute_and_offload_give_the_same_loss_and_gradients(measured, policy):
    loss, grads, *_ = measured[policy]
    ref_loss, ref_grads, *_ = measured["none"]
    assert loss == ref_loss
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= 1e-7
    if policy.startswith("offload") and "recompute" not in policy:  # bit for bit: the same tensors came back
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_saved_activation_bytes_drop_as_each_policy_predicts(measured):
    saved = {name: result[2] for name, result in measured.items() if not name.startswith("offload")}
    # batch 4 x seq 32 x d 64 fp32 = 32 KiB per hidden-state tensor; 4 layers
    hidden = 4 * 32 * 64 * 4
    assert saved["none"] > saved["selective"] > saved["full_every_2"] > saved["full"]
    per_layer_full = (saved["none"] - saved["full"]) / 4  # what one layer saves beyond its input
    assert saved["full_every_2"] == pytest.approx(saved["full"] + 2 * per_layer_full, rel=0.01)
    assert saved["full_first_1"] == pytest.approx(saved["full"] + 3 * per_layer_full, rel=0.01)
    # beyond its input, a layer saves at least its norm outputs, q, k, v, the attention output and the
    # three MLP intermediates (ffn 192 = 3 x d): well over 8 hidden-state tensors
    assert per_layer_full > 8 * hidden


def test_step_peak_is_the_most_tensor_bytes_alive_at_once():
    before = torch.empty(4000, dtype=torch.uint8)
    with StepPeak(torch.device("cpu")) as peak:
        a = torch.empty(2000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        del a
        c = torch.empty(1000, dtype=torch.uint8)
    assert peak.peak_bytes - peak.start_bytes == 5000 == peak.peak_min_bytes - peak.start_bytes
    with StepPeak(torch.device("cpu")) as peak:
        d = torch.empty(2000, dtype=torch.uint8)
        del before  # allocated before the profiler started: its free is not recorded
    # counted alive to the end (upper bound) or freed at once (lower bound); the true peak lies between
    assert peak.peak_bytes - peak.start_bytes == 2000
    assert peak.peak_min_bytes - peak.start_bytes == 2000 - 4000
    del b, c, d


def test_measuring_keeps_no_graph_alive():
    """A forward whose backward never runs (a pipeline stage's first-step shape inference) is freed: the
    saved-tensor hooks hand autograd a detached tensor, not one holding autograd's node (a cycle through
    C++ the garbage collector cannot see)."""
    layer = torch.nn.Linear(8, 8)
    with SavedActivations(list(layer.parameters())):
        out = torch.tanh(layer(torch.randn(4, 8)))  # tanh saves its own output
    alive = weakref.ref(out)
    del out
    assert alive() is None


def test_a_parameter_hook_does_not_keep_its_optimizer_alive():
    """The parameters hold their hooks in C++: a bound method there would keep the bucketed reduction (and
    an optimizer's state) alive after the run, in a cycle the garbage collector cannot see."""
    p = torch.nn.Parameter(torch.zeros(4))
    reduction = BucketedReduction([[p]], lambda i: lambda: None, overlap=True)
    reduction.begin_step(1)
    alive = weakref.ref(reduction)
    del reduction
    assert alive() is None
    p.sum().backward()  # the hook outlives it and does nothing


@pytest.mark.parametrize("policy", [p for p in POLICIES if p.startswith("offload")])
def test_offloaded_activations_went_through_the_hooks_as_the_planner_says(measured, policy):
    """What passed through the offload hooks (each storage once) is what the planner takes off the device's
    activations and puts in host memory; the device kept that much less, every offloaded block's tensors
    were brought back ahead of its backward, and the ones it saved were freed before backward (copies kept,
    not the tensors: `blocks_outputs_freed`). Without the feature nothing passes (no hook is attached)."""
    from hpc_train.distributed.mesh import ParallelDims
    from hpc_train.planner import activation_bytes, estimate

    _, _, saved, offloaded, cfg, freed = measured[policy]
    base = measured["full_every_2" if "recompute" in policy else "none"][4]  # the same without offload
    planned = activation_bytes(base) - activation_bytes(cfg)  # one micro-batch (the batch is one here)
    assert offloaded["bytes"] == planned > 0 and offloaded["tensors"] > 0
    blocks = {"offload_selective": 3, "offload_full": 4, "offload_full_recompute_every_2": 2}[policy]
    assert offloaded["prefetched"] == blocks  # each offloaded block's group, ahead of its backward
    # a block's output is freed before backward exactly where the next block (its saver) offloads: moved, not
    # just counted; the last block's output is the final norm's input
    moved = {"offload_selective": [0, 1], "offload_full": [0, 1, 2], "offload_full_recompute_every_2": [0, 2]}[policy]
    assert freed == [i in moved for i in range(4)] and measured["none"][5] == [False] * 4
    plan = estimate(cfg, ParallelDims())
    assert plan.host == plan.host_features == planned and plan.activations == activation_bytes(cfg)
    if policy == "offload_selective":  # the last block still saves the stage's RoPE tables, so exactly
        assert saved == measured["none"][2] - planned
    assert measured["none"][3] is None and measured["full"][3] is None


def test_activation_offload_refusals_name_the_fix(make_cfg):
    """Offload inside compiled blocks is refused, and so is a layout in which it would move no block."""
    from hpc_train.config import ConfigError
    from hpc_train.job import check_run

    with pytest.raises(ConfigError, match="model.activation_offload=full with train.compile"):
        check_run(make_cfg("model.activation_offload=full", "train.compile=true"), 1, check_paths=False)
    with pytest.raises(ConfigError, match=r"moves no block here.*recompute fewer blocks .*activation_offload=none"):
        check_run(make_cfg("model.activation_offload=full", "model.recompute=full"), 1, check_paths=False)
    with pytest.raises(ConfigError, match="moves no block here.*use activation_offload=full or recompute fewer"):
        check_run(make_cfg("model.activation_offload=selective", "model.n_layers=1"), 1, check_paths=False)
    check_run(make_cfg("model.activation_offload=selective"), 1, check_paths=False)
