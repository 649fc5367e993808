"""A family whose layers a TP dict cannot describe shards its stages with its own hook
(`ModelSpec.parallelize_fn`); without one, its `tp_plan` is applied. The features' transforms run in the
registry's order, the one docs/architecture.md gives."""

import dataclasses
import functools
import re

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hpc_train.config import ModelConfig
from hpc_train.features.tensor_parallel.sharding import apply_tensor_parallel
from hpc_train.launch.local import single_process_group
from hpc_train.models.llama import LLAMA
from tests.conftest import ROOT, TINY_MODEL


def test_a_family_hook_replaces_the_tp_plan():
    calls = []

    def no_plan(*args):
        raise AssertionError("the TP plan was asked for although the family has its own hook")

    spec = dataclasses.replace(LLAMA, tp_plan=no_plan, parallelize_fn=lambda *args: calls.append(args))
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, seq_len=16)
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        stage = spec.build_stage(cfg)
        apply_tensor_parallel(stage, spec, mesh["tp"], True)
        assert calls == [(stage, mesh["tp"], True)]
        assert isinstance(stage.vocab_mask, DTensor)  # the logits' mask is still sharded like them

        plain = LLAMA.build_stage(cfg)
        apply_tensor_parallel(plain, LLAMA, mesh["tp"], False)  # no hook: the plan shards the projections
        assert isinstance(plain.layers["0"].attn.wq.weight, DTensor)


# every feature on (the transforms are recorded, not run: most need a mesh of several ranks)
EVERY_FEATURE = ["train.fp8=tensorwise", "parallel.tp=2", "parallel.cp=2", "model.moe.num_experts=4",
                 "model.recompute=full", "finetune.method=lora", "model.activation_offload=full", "train.compile=true",
                 "optim.zero_stage=3"]  # fmt: skip


def test_transforms_run_in_the_registry_order(monkeypatch):
    """build_model with every feature on: parallelize runs each feature's transform once per stage, on the meta
    device, in FEATURES' order (what docs/architecture.md's list of transforms is compared with, below)."""
    from hpc_train import job
    from hpc_train.builder import build_model
    from hpc_train.distributed.mesh import Mesh, ParallelDims

    applied = []

    def recorded(name, transform):
        @functools.wraps(transform)  # the same keyword-only parameters: bound to the same sections
        def record(stage, plan, **sections):
            applied.append((name, all(p.is_meta for p in stage.parameters())))

        return record

    registry = job.FEATURES
    stubs = [dataclasses.replace(f, transform=recorded(f.name, f.transform), initialize=None, hooks=None)
             for f in registry]  # fmt: skip
    monkeypatch.setattr(job, "FEATURES", tuple(stubs))
    cfg = job.load_config(None, [*TINY_MODEL, *EVERY_FEATURE])
    with single_process_group():
        build_model(cfg, Mesh(ParallelDims(), "cpu"), torch.device("cpu"))
    assert applied == [(f.name, True) for f in registry]


def test_docs_list_the_transforms_in_the_registry_order():
    """docs/architecture.md's sentence on the order the transforms run in names every registered feature, in
    FEATURES' order."""
    from hpc_train.job import FEATURES

    readme = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    listed = re.search(r"in the registry's order, `FEATURES` in `job.py`: ((?:`\w+`, )*`\w+`);", readme)
    assert listed, "docs/architecture.md no longer gives the order of the transforms"
    assert re.findall(r"`(\w+)`", listed.group(1)) == [f.name for f in FEATURES]
