"""Expert parallelism (parallel.ep): routed experts sharded over ranks carved from dp, tokens dispatched and
combined by all-to-all, expert gradients reduced over their own group. Every layout's loss curve, per-layer
expert loads and final weights against one process, and checkpoints resharded between ep2 and ep1."""

from __future__ import annotations

import pytest

from hpc_train.config import load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, max_param_diff, read_final_model, read_metrics

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.bias_update_rate=0.01", "model.moe.num_shared_experts=1"]  # fmt: skip

TWO = {  # name -> overrides at 2 processes; global batch 8 everywhere
    "ep2": ["train.micro_batch_size=4", "parallel.ep=2"],
    "ep2_zero1": ["train.micro_batch_size=4", "parallel.ep=2", "optim.zero_stage=1", "optim.bucket_mb=0.05"],
}


def test_expert_parallel_matches_one_process(tmp_path, small_corpus):
    def cfg(name: str, world: int, *extra: str):
        return load_config(None, [*TINY_MODEL, *MOE, "train.steps=3", f"data.train_path={small_corpus}",
                                  f"run_dir={tmp_path / name}", f"parallel.nproc={world}", *extra])  # fmt: skip

    reference = cfg("reference", 1, "train.micro_batch_size=4", "train.grad_accum=2")
    launch_local(run_training, 1, reference)
    cfgs = {name: cfg(name, 2, *extra) for name, extra in TWO.items()}
    launch_sequence(run_training, 2, [(c,) for c in cfgs.values()])
    ref, final = read_metrics(reference.run_dir), read_final_model(reference.run_dir)
    for name, c in cfgs.items():
        records = read_metrics(c.run_dir)
        for ours, theirs in zip(records, ref, strict=True):
            assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5), name
            for layer, figures in theirs["moe"].items():
                assert ours["moe"][layer] == pytest.approx(figures, abs=1e-5), (name, layer)
        assert max_param_diff(read_final_model(c.run_dir), final) < 1e-5, name
