"""Update rules apart from the data-parallel strategies: one process updates exactly as torch's own
optimizers do, Muon's own Newton-Schulz is torch's, the planner counts each rule's state, and a resume
under another rule is refused unless the state is reset."""

import ast
import copy
import inspect
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import hpc_train
from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.checkpoint.ownership import check_checkpoint_dir
from hpc_train.checkpoint.safe_load import CheckpointError
from hpc_train.config import ConfigError
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.optim.rules import RULES, is_hidden_matrix, rule_class, target
from hpc_train.optim.rules.muon import NS_COEFFICIENTS, NS_EPS, adjusted_lr, orthogonalize
from hpc_train.placement import distribute_like, local
from hpc_train.planner import dp_traffic_bytes, local_param_count
from hpc_train.train.loop import run_training


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


def test_no_module_imports_a_private_torch_optim_module():
    """torch.optim's private modules (torch.optim._muon) may change in any torch release; the rules own the
    few lines they would take from one."""
    private = []
    for path in sorted(Path(hpc_train.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            private += [f"{path.name}:{node.lineno}: {n}" for n in names if n.startswith("torch.optim._")]
    assert not private, private


def test_muons_newton_schulz_and_lr_adjustment_are_torchs():
    """hpc_train's own Newton-Schulz and learning-rate adjustment against torch's private functions, bit for
    bit, and its coefficients against torch.optim.Muon's public defaults, where this torch has them."""
    if hasattr(torch.optim, "Muon"):
        defaults = inspect.signature(torch.optim.Muon).parameters
        assert defaults["ns_coefficients"].default == NS_COEFFICIENTS and defaults["eps"].default == NS_EPS
    try:
        from torch.optim import _muon
    except ImportError:
        pytest.skip("this torch has no torch.optim._muon to compare with")
    gen = torch.Generator().manual_seed(0)
    for shape in ((8, 12), (12, 8), (16, 16)):
        matrix = torch.randn(shape, generator=gen)
        for steps in (1, 5):
            theirs = _muon._zeropower_via_newtonschulz(matrix.clone(), NS_COEFFICIENTS, steps, NS_EPS)
            assert torch.equal(orthogonalize(matrix, steps), theirs), (shape, steps)
        for how in ("match_rms_adamw", "original"):
            assert adjusted_lr(0.02, how, torch.Size(shape)) == _muon._adjust_lr(0.02, how, torch.Size(shape))
    assert orthogonalize(torch.zeros(4, 6), 5).eq(0).all()  # the norm's floor: no division by zero


def test_muon_takes_each_routed_expert_as_its_own_matrix_and_leaves_the_router_to_adamw():
    """The experts' stacks (experts, in, out) are Muon's, each expert's matrix orthogonalized alone in one
    batched iteration and its learning rate adjusted for its (out, in) shape; the router's gate is AdamW's."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((3, 8, 12), (3, 12, 8)):
        stack = torch.randn(shape, generator=gen)
        each = torch.stack([orthogonalize(m, 5) for m in stack])
        torch.testing.assert_close(orthogonalize(stack, 5).float(), each.float(), atol=1e-2, rtol=0)  # bf16
        assert not torch.allclose(orthogonalize(stack, 5).float(), orthogonalize(stack.reshape(-1, shape[-1]), 5)
                                  .reshape(shape).float(), atol=1e-2)  # not one matrix of the whole stack  # fmt: skip
    assert is_hidden_matrix("layers.1.mlp.experts.w1", 3) and is_hidden_matrix("layers.1.mlp.experts.w2", 3)
    assert not is_hidden_matrix("layers.1.mlp.router.gate.weight", 2)
    assert is_hidden_matrix("layers.1.mlp.shared.w1.weight", 2)
    w1 = nn.Parameter(torch.empty(4, 64, 32))  # (experts, d_model in, hidden out)
    assert target("layers.1.mlp.experts.w1", w1).matrix_shape == torch.Size([4, 32, 64])
    assert adjusted_lr(0.02, "original", torch.Size([4, 32, 64])) == adjusted_lr(0.02, "original", torch.Size([32, 64]))


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


def _resumed_optimizer_state(rank_env, cfgs):
    """Per config, resumed from its checkpoint without a step: ZeRO's masters and the rule's state, by parameter."""
    cpu = torch.device("cpu")
    resumed = []
    with distributed(rank_env, cpu, "gloo", 60):
        for cfg in cfgs:
            run = build_run(cfg, rank_env, cpu, with_data=False)
            run.checkpointer.resume()
            states = run.optimizer.param_states()
            masters = [local(s["master"]).clone() for s in states]
            rule = [local(t).clone() for s in states for k, t in s.items() if k != "master"]
            resumed.append((masters, rule))
    return resumed


def test_another_rule_on_resume_is_refused_unless_the_state_is_reset(make_cfg, capsys):
    """An adamw checkpoint resumed under muon: refused before any process starts (the CLI's check) and by
    the run, before it reads or writes a checkpoint, naming both rules and the fix. With
    optim.reset_state=true the weights and ZeRO's fp32 masters are resumed, every rule's state starts at
    zero, the log says so, and the run trains on."""
    common = ["optim.zero_stage=1", "train.precision=bf16", "checkpoint.interval=2", "train.micro_batch_size=2"]
    launch_local(run_training, 1, make_cfg(*common, "train.steps=2"))
    switched = make_cfg(*common, "train.steps=3", "optim.name=muon")
    checkpoints = Path(switched.checkpoint.dir)

    def written() -> dict[str, int]:  # the run's claim on the directory (.lock) aside
        return {str(p): p.stat().st_mtime_ns for p in checkpoints.rglob("*") if p.name != ".lock"}

    before = written()
    refusal = r"trained with optim.name=adamw, and this run asks for optim.name=muon: .* optim.reset_state=true to"
    with pytest.raises(CheckpointError, match=refusal):
        check_checkpoint_dir(switched, probe_lock=False)
    with pytest.raises(CheckpointError, match=refusal):
        launch_local(run_training, 1, switched)
    assert written() == before
    reset = make_cfg(*common, "train.steps=3", "optim.name=muon", "optim.reset_state=true")
    check_checkpoint_dir(reset, probe_lock=False)
    capsys.readouterr()
    (masters, kept), (reset_masters, zeros) = launch_local(
        _resumed_optimizer_state, 1, [make_cfg(*common, "train.steps=3"), reset]
    )
    assert "optimizer state reset (optim.reset_state=true)" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(masters, reset_masters, strict=True))
    assert any(t.any() for t in kept) and zeros and not any(t.any() for t in zeros)
    assert len(launch_local(run_training, 1, reset).losses) == 1
    assert "optimizer state reset" in capsys.readouterr().out
