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
from hpc_train.checkpoint.safe_load import CheckpointError, read_dcp_metadata
from hpc_train.config import ConfigError
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.optim.rules import RULES, is_hidden_matrix, rule_class, target
from hpc_train.optim.rules.muon import NS_COEFFICIENTS, NS_EPS, adjusted_lr, orthogonalize
from hpc_train.placement import distribute_like, local
from hpc_train.planner import dp_traffic_bytes, estimate, format_search, local_param_count, search
from hpc_train.train.loop import run_training
from tests.conftest import max_param_diff, read_final_model, read_metrics


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


class Wide(Tiny):
    """Tiny's parameters, wide enough that a low-bit rule quantizes the embedding and the matrices (at least
    4096 elements, whole blocks) and keeps fp32 moments for the norm and the biases."""

    def __init__(self):
        nn.Module.__init__(self)
        self.tok_embeddings = nn.Embedding(16, 512)
        self.layers = nn.ModuleList([nn.Linear(512, 128), nn.Linear(128, 512)])
        self.norm = nn.LayerNorm(512)


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
    """The per-tensor figures the planner uses are what the rule really holds after a step."""
    cfg = load_config(None, [f"optim.name={name}"]).optim
    model = Wide()
    rule = rule_class(cfg)([target(n, p) for n, p in model.named_parameters()], cfg)
    _grads(model, 0)
    rule.step(cfg.lr)
    planned = sum(rule.planned_state_bytes(is_hidden_matrix(n, p.ndim), p.numel(), p.numel())
                  for n, p in model.named_parameters())  # fmt: skip
    assert rule.state_bytes() == planned


LOW_BIT = {"adamw8bit": ("AdamW8bit", 256, 2 + 8 / 256), "adamw4bit": ("AdamW4bit", 128, 1 + 8 / 128)}


def _flat_spans(model: nn.Module, block: int) -> list:
    """Each parameter of `model` as two flat fp32 views cut at a block boundary, as ZeRO-1 at dp2 cuts its
    slices (optim/zero.py), named after their parameter."""
    spans = []
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        cut = flat.numel() // 2 // block * block or flat.numel()
        for piece in (flat[:cut], flat[cut:]):
            if piece.numel():
                spans.append((name, p, nn.Parameter(piece)))
    return spans


@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_rules_update_as_torchao_and_their_state_is_the_same_on_any_dp_cut(name, capsys):
    """One process: the rule updates exactly as torchao's own optimizer on the same model (its eager update,
    as the rule runs off CUDA), with low-bit moments for the embedding and the matrices and fp32 ones for
    the norm and the biases; its bytes are the documented figure per element. The same parameters cut into
    block-aligned slices (ZeRO at dp2) hold the same codes and scales; their checkpointed state (fp32 moments
    and the signed moment's scale per element, per parameter) loads bit-exactly into whole parameters;
    without the scale the signed moment would requantize to other codes."""
    import torchao.optim

    cfg = load_config(None, [f"optim.name={name}"]).optim
    torchao_name, block, per_element = LOW_BIT[name]
    ours, whole_model, theirs = Wide(), Wide(), Wide()
    whole_model.load_state_dict(ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    rule = rule_class(cfg)([target(n, p) for n, p in ours.named_parameters()], cfg)
    spans = _flat_spans(whole_model, block)
    sliced = rule_class(cfg)([target(n, p, piece) for n, p, piece in spans], cfg)
    decay = [p for p in theirs.parameters() if p.ndim >= 2]
    reference = getattr(torchao.optim, torchao_name)(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": [p for p in theirs.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)  # fmt: skip
    for step in range(3):
        for model in (ours, theirs, whole_model):
            _grads(model, step)
        for _, p, piece in spans:
            start = (piece.data_ptr() - p.data_ptr()) // p.element_size()
            piece.grad = p.grad.reshape(-1)[start : start + piece.numel()]
        rule.step(cfg.lr)
        sliced.step(cfg.lr)
        with torch.compiler.set_stance("force_eager"):
            reference.step()
        for o in (rule, sliced, reference, whole_model):
            o.zero_grad()
        for (n, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), (step, n)
    quantized = {n for n, p in ours.named_parameters() if hasattr(rule.states[p]["exp_avg"], "codes")}
    assert quantized == {"tok_embeddings.weight", "layers.0.weight", "layers.1.weight"}
    elements = {n: p.numel() for n, p in ours.named_parameters()}
    overhead = 2 * 4 * (256 if name == "adamw8bit" else 16)  # each moment's code book
    assert rule.state_bytes() == sum(per_element * elements[n] + overhead if n in quantized else 8 * elements[n]
                                     for n in elements)  # fmt: skip
    params = dict(ours.named_parameters())
    for key in ("exp_avg", "exp_avg_sq"):  # the slices' state is the whole parameters' state, cut
        for n in quantized:
            codes = [sliced.states[piece][key].codes.reshape(-1) for m, _, piece in spans if m == n]
            assert torch.equal(torch.cat(codes), rule.states[params[n]][key].codes.reshape(-1)), (n, key)
    saved = {n: {} for n in params}  # per parameter, as a checkpoint stores the slices' state
    for n, _, piece in spans:
        for key, value in sliced.state(piece).items():
            saved[n][key] = torch.cat([saved[n][key], value]) if key in saved[n] else value
    loaded, requantized = rule_class(cfg)(rule.targets, cfg), rule_class(cfg)(rule.targets, cfg)
    for n, p in params.items():
        state = {k: v.view(p.shape) for k, v in saved[n].items()}
        loaded.load_state(p, state, step=3)
        requantized.load_state(p, {k: v for k, v in state.items() if k != "exp_avg_scale"}, step=3)
        for key in ("exp_avg", "exp_avg_sq"):
            ours_now, back = rule.states[p][key], loaded.states[p][key]
            pairs = [(ours_now, back)]
            if n in quantized:
                pairs = [(ours_now.codes, back.codes), (ours_now.scale, back.scale)]
            assert all(torch.equal(a, b) for a, b in pairs), (n, key)
    assert any(not torch.equal(rule.states[params[n]]["exp_avg"].codes, requantized.states[params[n]]["exp_avg"].codes)
               for n in quantized)  # fmt: skip
    # a shard that is not whole blocks (FSDP's rows of a quantized parameter) keeps fp32 moments, said at once
    row = params["layers.0.weight"][:1].detach().reshape(-1)[:100]
    capsys.readouterr()
    rule_class(cfg)([target("layers.0.weight", params["layers.0.weight"], nn.Parameter(row))], cfg)
    assert "1 parameter shard(s) here keep fp32 moments: their [100] elements" in capsys.readouterr().out
    # a skipped step (read on the host) changes nothing
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    _grads(ours, 3)
    rule.step(cfg.lr, torch.ones(()))
    assert all(torch.equal(p, before[n]) for n, p in ours.named_parameters())
    assert all(rule.states[p]["step"].item() == 3 for p in params.values())


def test_unknown_rule_and_impossible_settings_are_refused_before_any_process_starts():
    rules = "adamw, muon, adamw8bit or adamw4bit"
    with pytest.raises(ConfigError, match=f"optim.name='lion' is not an update rule; use {rules}"):
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
        adamw, muon = (load_config(None, [f"optim.zero_stage={stage}", f"optim.name={n}"]) for n in ("adamw", "muon"))
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
    with pytest.raises(CheckpointError, match=refusal.replace("muon", "adamw8bit")):  # the same keys, other state
        check_checkpoint_dir(make_cfg(*common, "train.steps=3", "optim.name=adamw8bit"), probe_lock=False)
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


# layouts of 2 ranks against one process (global batch 4), and the bound each stays within after 6 steps
LOW_BIT_LAYOUTS = {
    "dp2_zero1": ["optim.zero_stage=1", "optim.bucket_mb=0.02", "train.micro_batch_size=2"],  # matrices cut
    "dp2_zero2": ["optim.zero_stage=2", "optim.bucket_mb=0.02", "train.micro_batch_size=2"],
    "dp2_zero1_offload": ["optim.zero_stage=1", "optim.offload=cpu", "train.micro_batch_size=2"],
    "dp2_zero3": ["optim.zero_stage=3", "train.micro_batch_size=2"],
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=4"],
}
# where every block is the parameter's (dp's slices and FSDP's rows cut at block boundaries here), only
# the gradients' rounding differs (dp sums in another order): an element crosses a code boundary now and
# then. Under tp a row-parallel shard's blocks are not the whole matrix's: every moment is rounded
# differently, about as far as the run with fp32 moments is (measured: 9e-5 and 1.0e-3)
LOW_BIT_BOUNDS = {("dp2", "adamw8bit"): 1e-4, ("dp2", "adamw4bit"): 2e-4, ("tp2", "adamw8bit"): 5e-4,
                  ("tp2", "adamw4bit"): 3e-3}  # fmt: skip


def test_low_bit_rules_across_layouts_resume_exactly_and_are_planned(make_cfg, capfd):
    """adamw8bit and adamw4bit at dp2 ZeRO-1, -2, -1 with CPU offload, -3 and tp2 against one process, within the stated
    bounds; the measured optimizer bytes are the planner's (exact where whole tensors are updated, within
    its 5% where ZeRO takes a share of each), so moments that fell back to fp32 fail it. A ZeRO-1 run
    stopped at step 3 resumes bit-exactly, and its step-3 checkpoint resumed by one process continues
    within the dp bound."""
    steps = ["train.steps=6", "checkpoint.interval=3"]
    one = {name: make_cfg(*steps, f"optim.name={name}", "train.micro_batch_size=4", run=f"one_{name}")
           for name in ("adamw", *LOW_BIT)}  # fmt: skip
    layouts = {(layout, name): make_cfg(*steps, f"optim.name={name}", "parallel.nproc=2", *o, run=f"{layout}_{name}")
               for name in LOW_BIT for layout, o in LOW_BIT_LAYOUTS.items()}  # fmt: skip
    zero1 = ["optim.name=adamw8bit", "parallel.nproc=2", *LOW_BIT_LAYOUTS["dp2_zero1"], "checkpoint.interval=3"]
    split = [make_cfg(*zero1, f"train.steps={n}", run="split") for n in (3, 6)]
    source = make_cfg(*zero1, "train.steps=3", run="reshard")
    # rank-1 adapters in buckets of one: each bucket is padded to dp x 256, so rank 1 owns no element at all,
    # and still saves with the others (it takes the rule's keys from them)
    owns_nothing = make_cfg(
        "optim.name=adamw8bit",
        "parallel.nproc=2",
        "optim.zero_stage=1",
        "optim.bucket_mb=0.0001",
        "train.micro_batch_size=2",
        "finetune.method=lora",
        "finetune.lora_targets=[wq]",
        "finetune.lora_rank=1",
        "train.steps=2",
        "checkpoint.interval=2",
        run="owns_nothing",
    )
    target_cfg = make_cfg("optim.name=adamw8bit", "train.micro_batch_size=4", *steps, run="reshard")
    launch_sequence(run_training, 1, [(cfg,) for cfg in one.values()])
    launch_sequence(run_training, 2, [(cfg,) for cfg in (*layouts.values(), *split, source, owns_nothing)])
    launch_local(run_training, 1, target_cfg)
    assert "keep fp32 moments" not in capfd.readouterr().out  # every block whole on its rank (ZeRO cuts at them)
    assert (Path(owns_nothing.checkpoint.dir) / "step_0000002").is_dir()
    for (layout, name), cfg in layouts.items():
        ref = read_final_model(one[name].run_dir)
        diff = max_param_diff(read_final_model(cfg.run_dir), ref)
        assert diff <= LOW_BIT_BOUNDS[(layout[:3], name)], (layout, name, diff)
        if layout.startswith("dp2"):  # the same blocks: fp32 moments are much further
            assert max_param_diff(read_final_model(one["adamw"].run_dir), ref) > 10 * diff, (layout, name)
        measured = _measured_optimizer(cfg.run_dir)
        planned = estimate(cfg, check_run(cfg, 2, check_paths=False)).optimizer
        assert measured == planned if layout == "tp2" else measured == pytest.approx(planned, rel=0.05), layout
    for name in LOW_BIT:  # the moments stored as they live (codes and block scales): within 1% of the state
        stored, held = _stored_optimizer_bytes(one[name]), _measured_optimizer(one[name].run_dir)
        assert stored <= 1.01 * held, (name, stored, held)
    uninterrupted = layouts[("dp2_zero1", "adamw8bit")].run_dir
    assert [m["loss"] for m in read_metrics(split[1].run_dir)] == [m["loss"] for m in read_metrics(uninterrupted)]
    assert max_param_diff(read_final_model(split[1].run_dir), read_final_model(uninterrupted)) == 0.0
    assert [m["resumed_from"]["step"] for m in read_metrics(target_cfg.run_dir) if "resumed_from" in m] == [3]
    resharded = max_param_diff(read_final_model(target_cfg.run_dir), read_final_model(one["adamw8bit"].run_dir))
    assert resharded <= LOW_BIT_BOUNDS[("dp2", "adamw8bit")]


def _measured_optimizer(run_dir) -> int:
    return [m for m in read_metrics(run_dir) if "memory_bytes" in m][-1]["memory_bytes"]["optimizer"]


def _stored_optimizer_bytes(cfg) -> int:
    """The bytes of the optimizer state a run's last checkpoint stores (DCP's metadata: every key's shape)."""
    last = sorted(Path(cfg.checkpoint.dir).glob("step_*"))[-1]
    stored = read_dcp_metadata(last, {p.name for p in last.iterdir()}).state_dict_metadata
    return sum(md.size.numel() * md.properties.dtype.itemsize for key, md in stored.items() if key.startswith("optim."))


def test_plan_search_tries_low_bit_moments_where_adamws_do_not_fit():
    """A memory limit between the default layout's total with 8-bit moments and with AdamW's: --search
    gives that layout adamw8bit, and fits it; a layout that fits with AdamW keeps it, and so does one that
    fits with neither."""
    cfg = load_config(None, [])
    dims = check_run(cfg, 1, check_paths=False)
    adamw = estimate(cfg, dims).total
    eight = estimate(load_config(None, ["optim.name=adamw8bit"]), dims).total
    assert eight < adamw
    rows = search(cfg, 1, (eight + adamw) / 2, 1e12)
    (row,) = [r for r in rows if (r["mbs"], r["recompute"], r["zero"], r["offload"])
              == (cfg.train.micro_batch_size, cfg.model.recompute, 0, "none")]  # fmt: skip
    assert row["optim"] == "adamw8bit" and row["fits"]
    assert {r["optim"] for r in search(cfg, 1, 2**50, 1e12)} == {"adamw"}  # where AdamW's fits
    assert {r["optim"] for r in search(cfg, 1, 1, 1e12)} == {"adamw"}  # and where nothing fits
    assert "adamw8bit" in format_search(rows)
