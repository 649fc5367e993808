"""Update rules apart from the data-parallel strategies: one process updates exactly as torch's own
optimizers do, and the planner counts each rule's state."""

import copy
import zlib

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.config import ConfigError
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_sequence
from hpc_train.optim.rules import RULES, is_hidden_matrix, rule_class, target
from hpc_train.placement import distribute_like
from hpc_train.planner import dp_traffic_bytes, local_param_count


class Tiny(nn.Module):
    """A block's matrices under `layers.`, an embedding, a norm and a bias outside Muon's reach."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 12), nn.Linear(12, 8)])
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.norm(h).square().mean()


def _grads(model, seed):
    model(torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(seed))).backward()


def test_muon_rule_matches_torch_muon_and_adamw():
    cfg = load_config(None, ["optim.name=muon", "optim.weight_decay=0.1", "optim.lr=0.01"]).optim
    ours = Tiny()
    theirs = copy.deepcopy(ours)
    rule = rule_class(cfg)([target(n, p) for n, p in ours.named_parameters()], cfg)
    matrices = [p for n, p in theirs.named_parameters() if is_hidden_matrix(n, p.ndim)]
    others = [p for n, p in theirs.named_parameters() if not is_hidden_matrix(n, p.ndim)]
    assert len(matrices) == 2 and len(others) == 5  # the embedding, biases and norm stay with AdamW
    assert is_hidden_matrix("layers.3.attn.wq.lora_a", 2) and not is_hidden_matrix("output.weight", 2)
    muon = torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                            adjust_lr_fn=cfg.muon_adjust_lr)  # fmt: skip
    decay = [p for p in others if p.ndim >= 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)  # fmt: skip
    for step in range(3):
        for model in (ours, theirs):
            _grads(model, step)
        rule.step(cfg.lr)
        muon.step()
        adamw.step()
        rule.zero_grad()
        muon.zero_grad()
        adamw.zero_grad()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), (step, name)
    # a step skipped on the device (a non-finite one: NaN gradients) changes no weight and no state
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    state = {n: {k: v.clone() for k, v in rule.state(p).items()} for n, p in ours.named_parameters()}
    _grads(ours, 3)
    next(ours.parameters()).grad.fill_(float("nan"))
    rule.step(cfg.lr, torch.ones(()))
    rule.zero_grad()
    for name, p in ours.named_parameters():
        assert torch.equal(p, before[name]), name
        assert all(torch.equal(v, state[name][k]) for k, v in rule.state(p).items()), name
    # state: one momentum buffer per matrix, two moments per other parameter, all fp32
    weights = dict(ours.named_parameters())
    assert rule.state(weights["layers.0.weight"]).keys() == {"momentum_buffer"}
    assert rule.state(weights["norm.weight"]).keys() == {"exp_avg", "exp_avg_sq"}
    matrix_elements = sum(p.numel() for p in matrices)
    assert rule.state_bytes() == 4 * matrix_elements + 8 * sum(p.numel() for p in others)


def test_rule_state_round_trip_and_fresh_start():
    cfg = load_config(None, ["optim.name=muon"]).optim
    model = Tiny()
    targets = [target(n, p) for n, p in model.named_parameters()]
    rule = rule_class(cfg)(targets, cfg)
    _grads(model, 0)
    rule.step(cfg.lr)
    saved = {id(t.tensor): {k: v.clone() for k, v in rule.state(t.tensor).items()} for t in targets}
    again = rule_class(cfg)(targets, cfg)
    for t in targets:
        again.load_state(t.tensor, saved[id(t.tensor)], step=1)
        assert {k: v.tolist() for k, v in again.state(t.tensor).items()} == {
            k: v.tolist() for k, v in saved[id(t.tensor)].items()
        }
    fresh = rule_class(cfg)(targets, cfg)
    for t in targets:
        fresh.load_state(t.tensor, {}, step=5)  # nothing saved: state as before a first update
        assert all(not v.any() for v in fresh.state(t.tensor).values())


@pytest.mark.parametrize("name", list(RULES))
def test_planned_state_bytes_match_the_rule(name):
    """The per-element figures the planner uses are what the rule really holds after a step."""
    cfg = load_config(None, [f"optim.name={name}"]).optim
    model = Tiny()
    rule = rule_class(cfg)([target(n, p) for n, p in model.named_parameters()], cfg)
    _grads(model, 0)
    rule.step(cfg.lr)
    planned = sum(
        rule.planned_state_bytes(is_hidden_matrix(n, p.ndim)) * p.numel() for n, p in model.named_parameters()
    )
    assert rule.state_bytes() == planned


def test_unknown_rule_and_impossible_settings_are_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match="optim.name='lion' is not an update rule; use adamw or muon"):
        rule_class(load_config(None, ["optim.name=lion"]).optim)
    with pytest.raises(ConfigError, match="optim.ns_steps=100 must be at most 99"):
        check_run(load_config(None, ["optim.name=muon", "optim.ns_steps=100"]), 1, check_paths=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (a Replicate DTensor's full_tensor is its own storage)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _muon_step_check(rank_env, cfg):
    """One optimizer step of the layout on the same whole gradients on every dp rank (their mean is
    themselves, exactly) against torch.optim.Muon and AdamW on the whole tensors: bit for bit."""
    cpu = torch.device("cpu")
    with distributed(rank_env, cpu, "gloo", 120):
        run = build_run(cfg, rank_env, cpu, with_data=False)
        model, optimizer, lr = run.model, run.optimizer, 0.02
        named = [(n, p) for n, p in model.named_parameters if p.requires_grad]
        before = {n: _full(p).float() for n, p in named}
        grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
                 for n, p in named}  # fmt: skip
        for name, p in named:
            p.grad = distribute_like(grads[name], p).to(p.dtype)
        optimizer.begin_step(1)
        optimizer.reduce_gradients()
        optimizer.step(lr)
        ref = {n: nn.Parameter(t.clone()) for n, t in before.items()}
        for name, p in ref.items():
            p.grad = grads[name]
        matrices = [p for n, p in ref.items() if is_hidden_matrix(n, p.ndim)]
        assert matrices and all(model.mesh.size("tp") == 1 or isinstance(p, DTensor) for _, p in named)
        o = cfg.optim
        torch.optim.Muon(matrices, lr=lr, weight_decay=o.weight_decay, momentum=o.momentum,
                         adjust_lr_fn=o.muon_adjust_lr).step()  # fmt: skip
        others = [p for n, p in ref.items() if not is_hidden_matrix(n, p.ndim)]
        torch.optim.AdamW([{"params": [p for p in others if p.ndim >= 2], "weight_decay": o.weight_decay},
                           {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0}],
                          lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True).step()  # fmt: skip
        for name, p in named:
            assert torch.equal(_full(p), ref[name].detach()), (cfg.run_dir, name)
            assert not torch.equal(ref[name].detach(), before[name]), name  # every parameter moved
        assert optimizer.state_bytes() > 0


# zero_stage 0 under tp (whole matrices gathered over tp), ZeRO-1 under tp x dp (over dp from the owned
# slices, then tp; small buckets cut matrices between ranks) and at dp=1 (pipeline stages, nothing gathered
# over dp), FSDP under tp x dp (2-D DTensors)
MUON_STRATEGIES = {
    "tp2_dp2_zero0": ["optim.zero_stage=0"],
    "tp2_dp2_zero1": ["optim.zero_stage=1", "optim.bucket_mb=0.01"],
    "tp2_dp2_zero2": ["optim.zero_stage=2", "optim.bucket_mb=0.01", "optim.overlap_grad_reduce=true"],
    "pp2_tp2_zero1": ["optim.zero_stage=1", "parallel.pp=2", "train.grad_accum=2"],
    "tp2_dp2_zero3": ["optim.zero_stage=3"],
}


def test_muon_under_every_strategy_updates_as_torch_muon_does(make_cfg):
    cfgs = [make_cfg("optim.name=muon", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.nproc=4",
                     "train.micro_batch_size=2", *extra, run=name)
            for name, extra in MUON_STRATEGIES.items()]  # fmt: skip
    launch_sequence(_muon_step_check, 4, [(cfg,) for cfg in cfgs])


def test_planner_counts_muons_matrix_gather_where_state_is_sharded():
    """ZeRO-1 at dp4: Muon's step all-gathers the matrices' fp32 updates, AdamW's does not; zero 0 holds
    whole matrices already."""
    dims = ParallelDims(dp=4)
    for stage, extra in ((1, True), (0, False)):
        adamw, muon = (load_config(None, [f"optim.zero_stage={stage}", f"optim.name={name}"]) for name in RULES)
        local = local_param_count(muon)
        difference = dp_traffic_bytes(muon, dims, local.trainable, local.trainable_matrices) - dp_traffic_bytes(
            adamw, dims, local.trainable, local.trainable_matrices
        )
        assert difference == (4 * local.trainable_matrices * 3 / 4 if extra else 0)
        assert 0 < local.trainable_matrices < local.trainable
