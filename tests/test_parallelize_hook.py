"""A family whose layers a TP dict cannot describe shards its stages with its own hook
(`ModelSpec.parallelize_fn`); without one, its `tp_plan` is applied."""

import dataclasses

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hpc_train.config import ModelConfig
from hpc_train.features.tensor_parallel.sharding import apply_tensor_parallel
from hpc_train.launch.local import single_process_group
from hpc_train.models.llama import LLAMA


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
