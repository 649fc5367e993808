"""What one transformer block keeps for backward under tensor parallelism, tensor by tensor, in bytes per
s·b·h element (s sequence length, b micro-batch size, h model width: Korthikanti et al.'s unit, in which
Megatron keeps 34/t bytes a layer with sequence parallelism and selective recompute, 32/t without its
dropout masks). One real forward and backward per layout on the ranks of one local launch; a block's
saved tensors are counted as observe/memory.py counts them (each storage once, parameters and autocast's
casts of them left out: those are the step's, not a micro-batch's), and
named by the module that saved them and the operation that made them. The planner's figure for the same
block is printed beside the measured total (a rotary model's tables, which the planner counts once per
stage, show in the block's table: 0.5 of its bytes per element here).

    python tools/activation_table.py                      # GPT-2, bf16, ZeRO-1, selective recompute
    python tools/activation_table.py optim.zero_stage=0 model.arch=llama
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.builder import build_run
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.distributed.parallelize import forward_backward
from hpc_train.job import JobConfig, load_config
from hpc_train.launch.local import launch_runs
from hpc_train.models.common.moe import is_moe_layer
from hpc_train.models.common.regather import keep_gathered_inputs
from hpc_train.observe.memory import is_parameter, is_weight_cast, storage_key_and_bytes
from hpc_train.placement import local
from hpc_train.planner import activation_parts

MODEL = ["model.arch=gpt2", "model.n_layers=3", "model.n_heads=8", "model.d_model=256", "model.seq_len=128",
         "train.micro_batch_size=2", "optim.zero_stage=1", "train.precision=bf16", "model.recompute=selective",
         "parallel.sequence_parallel=true"]  # fmt: skip
BLOCK = "layers.1"  # a block in the middle: neither the first (frozen embeddings) nor next to the head
LAYOUTS = {"tp2": (2, ["parallel.tp=2", "parallel.dp=2"]), "tp4": (4, ["parallel.tp=4"])}  # on 4 ranks


class BlockSaves:
    """Saved-tensor hooks counting what the block `BLOCK` keeps for backward, by (module, what made it)."""

    def __init__(self, stage: torch.nn.Module, params: list[torch.Tensor]):
        self.params = {storage_key_and_bytes(p)[0] for p in params}
        self.where: list[str] = []
        self.seen: set[int] = set()
        self.by_tensor: dict[str, int] = defaultdict(int)
        for name, module in stage.named_modules():
            if name.startswith(BLOCK):
                module.register_forward_pre_hook(lambda *_, name=name: self.where.append(name) and None)
                module.register_forward_hook(lambda *_: self.where.pop() and None)  # (a value would replace the output)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key_and_bytes(t)
        if self.where and key not in self.seen and not is_parameter(t, key, self.params) and not is_weight_cast(t):
            self.seen.add(key)
            made_by = type(t.grad_fn).__name__.removesuffix("Backward0") if t.grad_fn is not None else "leaf"
            layout = "/".join(type(p).__name__ for p in t.placements) if isinstance(t, DTensor) else "local"
            module = self.where[-1].removeprefix(BLOCK).lstrip(".") or "block"
            self.by_tensor[f"{module:<18} {made_by:<22} {str(t.dtype).removeprefix('torch.'):<9} {layout}"] += nbytes
        return t


# plain, biased, batched and float8's scaled
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten._scaled_mm.default}  # fmt: skip


class CountMatmuls(TorchDispatchMode):
    """How many matmuls a forward and backward run (each as dispatched: a DTensor's once)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def measure_block(rank_env: RankEnv, cfg: JobConfig, corpus: str, out: str) -> None:
    """One forward and backward of a micro-batch as built, then one with every block keeping its gathered
    inputs (`keep_gathered_inputs`); rank 0 writes its block's table, each pass's matmuls and loss, and
    whether the passes' gradients are equal to the bit, to `out`."""
    with distributed(rank_env, torch.device("cpu"), "auto", timeout_s=300):
        model = build_run(cfg, rank_env, torch.device("cpu"), with_data=False).model
        data = IndexedDataset(corpus, cfg.model.seq_len)
        batch = [data.batch(np.arange(cfg.train.micro_batch_size))]
        passes, grads = [], []
        for _ in range(2):
            saves = BlockSaves(model.chunks[0], model.parameters)
            with torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t), CountMatmuls() as matmuls:
                loss = forward_backward(model, batch).item()
            passes.append({"tensors": saves.by_tensor, "matmuls": matmuls.count, "loss": loss})
            grads.append([local(p.grad).clone() for p in model.parameters])
            for p in model.parameters:
                p.grad = None
            for block in model.chunks[0].layers.values():
                keep_gathered_inputs(block)
        passes[0]["same_gradients"] = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    if rank_env.rank == 0:
        Path(out).write_text(json.dumps(passes))


def tables(overrides: list[str], corpus: str, base: Path, layouts: dict = LAYOUTS) -> dict[str, dict]:
    """Layout name -> {"tensors": bytes by tensor, "sbh": the block's s·b·h elements, "planned": the
    planner's bytes for the block, "tp": t}: every layout run on the ranks of one launch (4)."""
    cfgs, runs = block_runs(overrides, corpus, base, layouts)
    launch_runs(max(w for w, _ in layouts.values()), runs)
    return read_tables(cfgs, base)


def block_runs(overrides: list[str], corpus: str, base: Path, layouts: dict = LAYOUTS) -> tuple[dict, list]:
    """The layouts' configs, and their runs of `measure_block` for a launch of as many ranks as the widest
    needs (writing into `base`; `read_tables` reads them): a caller's launch may run them among its own."""
    cfgs = {name: load_config(None, [*MODEL, *o, *overrides, f"data.train_path={corpus}", f"parallel.nproc={w}"])
            for name, (w, o) in layouts.items()}  # fmt: skip
    return cfgs, [(measure_block, (cfg, corpus, str(base / f"{name}.json"))) for name, cfg in cfgs.items()]


def read_tables(cfgs: dict[str, JobConfig], base: Path) -> dict[str, dict]:
    """`tables`' answer from the files the runs of `block_runs` wrote."""
    out = {}
    for name, cfg in cfgs.items():
        m = cfg.model
        planned = activation_parts(cfg).block(m.recompute, is_moe_layer(m, int(BLOCK.split(".")[1])))
        built, kept = json.loads((base / f"{name}.json").read_text())
        out[name] = {**built, "kept_gathered": kept, "tp": cfg.parallel.tp, "planned": planned,
                     "sbh": cfg.train.micro_batch_size * m.seq_len * m.d_model}  # fmt: skip
    return out


def per_element(table: dict) -> float:
    """A measured block's bytes per s·b·h element."""
    return sum(table["tensors"].values()) / table["sbh"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=[], help="key=value for every layout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = str(Path(tmp) / "corpus")
        prepare_data(stdlib_sources()[:40], corpus, progress=False)
        results = tables(args.overrides, corpus, Path(tmp))
    for name, table in results.items():
        t, sbh = table["tp"], table["sbh"]
        print(f"\n{name} (t={t}), block {BLOCK}: bytes per s·b·h element, and x t (Megatron: 32 without dropout)")
        print(f"  {'module':<18} {'made by':<22} {'dtype':<9} {'layout':<10} {'/sbh':>7} {'x t':>7}")
        for tensor, nbytes in sorted(table["tensors"].items(), key=lambda kv: -kv[1]):
            print(f"  {tensor:<51} {nbytes / sbh:>7.3f} {nbytes / sbh * t:>7.2f}")
        total, kept = per_element(table), per_element(table["kept_gathered"] | {"sbh": sbh})
        print(f"  {'measured':<51} {total:>7.3f} {total * t:>7.2f}")
        print(f"  {'planned':<51} {table['planned'] / sbh:>7.3f} {table['planned'] / sbh * t:>7.2f}")
        print(f"  {'measured, the gathered inputs kept':<51} {kept:>7.3f} {kept * t:>7.2f}")
        print(
            f"  matmuls in a forward and backward: {table['matmuls']} (gathered inputs kept: "
            f"{table['kept_gathered']['matmuls']}); the same loss and gradients to the bit: "
            f"{table['same_gradients'] and table['loss'] == table['kept_gathered']['loss']}"
        )


if __name__ == "__main__":
    main()
