"""Fine-tuning: Hugging Face weights in and out, and LoRA.

Tiny random `transformers` models (Llama with grouped-query attention, GPT-2 with tied embeddings and fused
q/k/v, Mixtral with 4 experts of which each token takes 2), built here; no download. Imported, they give the
logits `transformers` gives, within 1e-5 in fp32, under one process, tp2 and pp2; imported at tp2 and
exported, every tensor comes back bit-exact. An MoE trained here exports to Mixtral with its logits. LoRA on
tp2 (sequence parallel), pp2 and dp2 with ZeRO-1 trains like one process; its merged export and its PEFT
adapters give, in `transformers`, the logits of the fine-tuned model.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hpc_train.bootstrap import distributed
from hpc_train.builder import build_run
from hpc_train.checkpoint.hf_io import HFFolder, save_hf
from hpc_train.checkpoint.init_from import newest_checkpoint, with_model_fields, with_source_model
from hpc_train.cli import main
from hpc_train.commands.convert import export_hf, import_config, import_hf, load_model, load_whole
from hpc_train.commands.generate import generate
from hpc_train.config import ConfigError, ModelConfig, MoEConfig
from hpc_train.data.batch import collate
from hpc_train.data.prepare import load_datasets, prepare_data, stdlib_sources
from hpc_train.data.sampler import ResumableSampler
from hpc_train.data.tokenizer import is_byte_json
from hpc_train.distributed.parallelize import step_context
from hpc_train.job import check_run, load_config
from hpc_train.launch.local import launch_local, launch_sequence, single_process_group
from hpc_train.models import MODEL_SPECS, hf_adapter_reading, hf_adapter_writing
from hpc_train.models.common.hf import ARCH_FIELDS, model_fields, plan_import
from hpc_train.train.loop import run_training
from tests.conftest import max_param_diff, read_final_model, read_metrics

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOL = 1e-5
VOCAB = 300
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _save_random(model, path) -> str:
    """Every parameter perturbed (norms and biases too), so a misplaced one shows in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, str]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     rope_theta=5000.0, rms_norm_eps=1e-5)  # fmt: skip
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
    # experts narrower than the model (a transposed expert weight has the wrong shape), top 2 of 4
    mixtral = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         rope_theta=5000.0, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    return {
        "llama": _save_random(transformers.LlamaForCausalLM(llama), root / "llama"),
        "gpt2": _save_random(transformers.GPT2LMHeadModel(gpt2), root / "gpt2"),
        "mixtral": _save_random(transformers.MixtralForCausalLM(mixtral), root / "mixtral"),
    }


def hf_logits(path: str, adapters: str | None = None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapters is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapters)
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def logits_entry(rank_env, cfg, out: str, resume: bool = False) -> None:
    """This layout's logits on TOKENS, whole, saved by the rank holding the last stage's tp rank 0."""
    device = torch.device("cpu")
    with distributed(rank_env, device, "gloo", 120):
        run = build_run(cfg, rank_env, device, with_data=False)
        if resume:
            run.checkpointer.resume()
        model, mesh, cfg = run.model, run.model.mesh, run.cfg
        model.train(False)
        with torch.no_grad(), step_context(model, device):
            if mesh.is_first_stage:
                hidden = model.chunks[0](TOKENS)
                if not mesh.is_last_stage:
                    dist.send(hidden.contiguous(), dst=mesh.ranks_along("pp")[0][-1])
            else:
                hidden = torch.empty(*TOKENS.shape, cfg.model.d_model)
                dist.recv(hidden, src=mesh.ranks_along("pp")[0][0])
                hidden = model.chunks[0](hidden)
            if mesh.is_last_stage:
                if model.chunks[0].emits_hidden:  # a pipeline's last stage ends at the final norm
                    hidden = model.chunks[0].logits(hidden)
                logits = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
                if mesh.rank("tp") == 0:
                    torch.save(logits[..., : cfg.model.vocab_size].clone(), out)


def _cfg(make_cfg, *overrides: str, run: str):
    return make_cfg(*overrides, run=run)


def test_imported_models_give_the_logits_of_transformers(make_cfg, hf_models, tmp_path):
    """One process, tp2 and pp2, for every family (Mixtral: llama with model.moe), against `transformers`'
    own forward."""
    layouts = {"single": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "train.grad_accum=2"]}
    jobs = {}
    for arch, path in hf_models.items():
        for layout, overrides in layouts.items():
            cfg = _cfg(make_cfg, f"model.init_from={path}", *overrides, run=f"{arch}_{layout}")
            jobs[(arch, layout)] = (cfg, str(tmp_path / f"{arch}_{layout}.pt"))
    for key, (cfg, out) in jobs.items():
        if key[1] == "single":
            launch_local(logits_entry, 1, cfg, out)
    launch_sequence(logits_entry, 2, [job for key, job in jobs.items() if key[1] != "single"])
    for (arch, layout), (_, out) in jobs.items():
        expected = hf_logits(hf_models[arch])
        assert (torch.load(out) - expected).abs().max() < TOL, (arch, layout)


def test_import_at_tp2_then_export_is_bit_exact(hf_models, tmp_path, capsys):
    """Each family's folder imported at tp2 and exported gives back every tensor; their folders hold no
    tokenizer, so neither does the export, which says so."""
    layout = ["parallel.nproc=2", "parallel.tp=2", "model.seq_len=32"]
    imports = {arch: import_config(path, str(tmp_path / arch), layout) for arch, path in hf_models.items()}
    launch_sequence(import_hf, 2, [(cfg,) for cfg in imports.values()])
    capsys.readouterr()
    for arch in hf_models:
        main(["export-hf", str(tmp_path / arch), str(tmp_path / f"{arch}_out")])
        assert capsys.readouterr().out.endswith(" (no tokenizer: none is recorded for it; give --tokenizer)\n")
        assert not (tmp_path / f"{arch}_out" / "tokenizer.json").exists()
    for arch, path in hf_models.items():
        original = safetensors_torch.load_file(f"{path}/model.safetensors")
        exported = safetensors_torch.load_file(str(tmp_path / f"{arch}_out" / "model.safetensors"))
        assert original.keys() == exported.keys(), arch
        assert all(torch.equal(original[k], exported[k]) for k in original), arch
    assert torch.equal(hf_logits(str(tmp_path / "gpt2_out")), hf_logits(hf_models["gpt2"]))


CONTEXT_KEYS = {"llama": ("max_position_embeddings", "rope_parameters", "rope_scaling"), "gpt2": ("n_positions",)}


def _hf_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> tuple[str, str]:
    """(tokenizer.json, dataset prefix): a BPE tokenizer of at most VOCAB tokens ending documents with
    </s>, and standard-library sources prepared with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root, sources = tmp_path_factory.mktemp("bpe"), stdlib_sources()[:6]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, limit_alphabet=100, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([path.read_text() for path in sources], trainer)
    tok.save(str(root / "tokenizer.json"))
    return str(root / "tokenizer.json"), prepare_data(sources, str(root / "code"), str(root / "tokenizer.json"),
                                                      progress=False)["train"]  # fmt: skip


def test_export_keeps_the_source_context(make_cfg, hf_models, bpe_data, tmp_path, capsys):
    """A model fine-tuned at a shorter model.seq_len than its source's context exports that context, not
    the training length: Llama through import-hf and a run from the imported checkpoint, GPT-2 from its
    folder, whose whole learned position table (trained rows and the rest) comes back. Each export holds
    the tokenizer its data was prepared with (byte-level for Llama, BPE for GPT-2), which
    `AutoTokenizer.from_pretrained` loads, its end-of-document id as bos and eos, and which import-hf then
    export-hf keep; `generate` uses it, on the run and on the export, unless --tokenizer says otherwise."""
    tokenizer_file, bpe_prefix = bpe_data
    imported = import_config(hf_models["llama"], str(tmp_path / "imported"), ["model.seq_len=16"])
    launch_local(import_hf, 1, imported)
    short = ["model.seq_len=16", "train.steps=2", "checkpoint.interval=2"]
    runs = {
        "llama": _cfg(make_cfg, f"model.init_from={tmp_path / 'imported'}", *short, run="ctx_llama"),
        "gpt2": _cfg(make_cfg, f"model.init_from={hf_models['gpt2']}", f"data.train_path={bpe_prefix}", *short,
                     run="ctx_gpt2"),
    }  # fmt: skip
    for arch, cfg in runs.items():
        launch_local(run_training, 1, cfg)
        with single_process_group():
            export_hf(cfg.run_dir, str(tmp_path / f"{arch}_out"))
        source, exported = _hf_config(hf_models[arch]), _hf_config(tmp_path / f"{arch}_out")
        assert {k: exported.get(k) for k in CONTEXT_KEYS[arch]} == {k: source.get(k) for k in CONTEXT_KEYS[arch]}
    # each run recorded the tokenizer its data was prepared with
    assert Path(runs["gpt2"].run_dir, "tokenizer.json").read_text() == Path(tokenizer_file).read_text()
    assert is_byte_json(Path(runs["llama"].run_dir, "tokenizer.json"))
    wpe = "transformer.wpe.weight"
    original = safetensors_torch.load_file(f"{hf_models['gpt2']}/model.safetensors")[wpe]
    tuned = safetensors_torch.load_file(str(tmp_path / "gpt2_out" / "model.safetensors"))[wpe]
    assert tuned.shape == original.shape and torch.allclose(tuned[16:], original[16:], rtol=1e-3)
    assert hf_logits(str(tmp_path / "gpt2_out")).isfinite().all()  # transformers loads the table it describes

    from tokenizers import Tokenizer

    text, bpe = "def héllo(self):\n    return 1", Tokenizer.from_file(tokenizer_file)
    expected = {"llama": (list(text.encode()), 256), "gpt2": (bpe.encode(text).ids, bpe.token_to_id("</s>"))}
    for arch, (ids, eod) in expected.items():
        out = tmp_path / f"{arch}_out"
        theirs = transformers.AutoTokenizer.from_pretrained(str(out))
        assert theirs(text)["input_ids"] == ids and theirs.eos_token_id == theirs.bos_token_id == eod, arch
        generation = json.loads((out / "generation_config.json").read_text())
        for config in (_hf_config(out), generation):
            assert (config["bos_token_id"], config["eos_token_id"]) == (eod, eod), arch
    # imported, the export keeps its tokenizer: import-hf copies it beside the checkpoint
    main(["import-hf", str(tmp_path / "gpt2_out"), str(tmp_path / "reimported"), "model.seq_len=16"])
    with single_process_group():
        export_hf(str(tmp_path / "reimported"), str(tmp_path / "again"))
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (tmp_path / "gpt2_out" / "tokenizer.json").read_text()
    generated, _ = {}, capsys.readouterr()
    for source, extra in (("run", []), ("export", []), ("byte", ["--tokenizer", "byte"]),
                          ("given", ["--tokenizer", tokenizer_file])):  # fmt: skip
        folder = runs["gpt2"].run_dir if source != "export" else str(tmp_path / "gpt2_out")
        main(["generate", folder, "--prompt", "def ", "--max-new-tokens", "6", *extra])
        generated[source] = capsys.readouterr().out
    assert generated["run"] == generated["export"] == generated["given"] != generated["byte"]


def test_a_seq_len_beyond_the_source_context_is_refused(make_cfg, hf_models):
    for arch, path in hf_models.items():
        cfg = with_source_model(_cfg(make_cfg, f"model.init_from={path}", "model.seq_len=64", run=arch))
        with pytest.raises(ConfigError, match=r"model.seq_len=64 .*model.max_position_embeddings=32.*model.seq_len"):
            check_run(cfg, 1)


def test_import_hf_starts_the_ranks_its_layout_needs(hf_models, tmp_path, capfd):
    """`import-hf SRC DST parallel.tp=2` (no parallel.nproc) starts two ranks and writes a tp2 checkpoint,
    which resumes under tp2 and reshards to tp1, each giving the logits of `transformers`."""
    out = str(tmp_path / "tp2")
    main(["import-hf", hf_models["llama"], out, "parallel.tp=2"])
    assert "tp=2" in capfd.readouterr().out
    info = newest_checkpoint(out)
    assert (info.step, info.manifest["layout"]["tp"], info.manifest["layout"]["world_size"]) == (0, 2, 2)
    for tp in (2, 1):
        cfg = load_config(None, [f"model.init_from={out}", f"checkpoint.dir={out}", f"run_dir={tmp_path / f'r{tp}'}",
                                 f"parallel.nproc={tp}", f"parallel.tp={tp}", "model.seq_len=32"])  # fmt: skip
        launch_local(logits_entry, tp, cfg, str(tmp_path / f"tp{tp}.pt"), True)
        assert "resumed from" in capfd.readouterr().out, tp
        assert (torch.load(tmp_path / f"tp{tp}.pt") - hf_logits(hf_models["llama"])).abs().max() < TOL, tp


def test_a_checkpoint_that_does_not_match_is_named(hf_models):
    folder = HFFolder(hf_models["llama"])
    cfg = _model_cfg(folder)
    shapes = dict(folder.shapes)
    expected = _expected(cfg)
    plan_import(folder.adapter, cfg, shapes, expected)  # the folder as it is matches
    cases = {
        "missing tensor model.layers.1.mlp.up_proj.weight": lambda s: s.pop("model.layers.1.mlp.up_proj.weight"),
        "no place for: model.layers.0.extra.weight": lambda s: s.update({"model.layers.0.extra.weight": (4,)}),
        "model.layers.0.self_attn.k_proj.weight has shape (64, 64)": lambda s: s.update(
            {"model.layers.0.self_attn.k_proj.weight": (64, 64)}
        ),
    }
    for message, change in cases.items():
        changed = dict(shapes)
        change(changed)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            plan_import(folder.adapter, cfg, changed, expected)


# one architecture per family, every ARCH_FIELDS key set; Mixtral's experts as wide as the dense MLP, the one
# width its config.json has
ARCHITECTURES = {
    "llama": ModelConfig(arch="llama", vocab_size=VOCAB, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
                         ffn_hidden=160, rope_theta=5000.0, norm_eps=1e-5, tie_embeddings=False,
                         max_position_embeddings=32),
    "gpt2": ModelConfig(arch="gpt2", vocab_size=VOCAB, n_layers=2, n_heads=4, d_model=64, ffn_hidden=256,
                        norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=32),
}  # fmt: skip
EXPERTS = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden=160)


def test_every_adapter_round_trips_its_config():
    """Ours -> the transformers config (as save_pretrained writes it) -> ours gives back every architecture
    field the adapter maps; each ModelConfig finds its adapter, and a config.json of another model_type is
    refused naming the ones hpc_train reads."""
    for spec in MODEL_SPECS.values():
        for adapter in spec.hf:
            cfg = ARCHITECTURES[spec.name]
            cfg = dataclasses.replace(cfg, moe=EXPERTS) if adapter.experts else cfg
            assert hf_adapter_writing(cfg) is adapter
            written = transformers.AutoConfig.for_model(adapter.model_type, **adapter.to_hf_config(cfg)).to_dict()
            assert hf_adapter_reading(written) is adapter
            fields = model_fields(adapter, written)
            assert set(fields) <= set(ARCH_FIELDS) and with_model_fields(cfg, fields) == cfg, adapter.architecture
    known = "llama (LlamaForCausalLM), mixtral (MixtralForCausalLM), gpt2 (GPT2LMHeadModel)"
    with pytest.raises(ConfigError, match=re.escape(f"model_type='bert' is not supported; hpc_train reads {known}")):
        hf_adapter_reading({"model_type": "bert"})
    with pytest.raises(ConfigError, match="model.arch=gpt2 has no Hugging Face counterpart for model.moe"):
        hf_adapter_writing(dataclasses.replace(ARCHITECTURES["gpt2"], moe=EXPERTS))


def _model_cfg(folder: HFFolder):
    from hpc_train.config import ModelConfig

    return with_model_fields(ModelConfig(seq_len=16), folder.model_fields())


def _expected(cfg) -> dict[str, tuple[int, ...]]:
    from hpc_train.models import get_spec

    spec = get_spec(cfg.arch)
    with torch.device("meta"):
        whole = spec.build_stage(cfg)
    return {name: (cfg.vocab_size, *p.shape[1:]) if name in spec.vocab_params else tuple(p.shape)
            for name, p in whole.named_parameters()}  # fmt: skip


def test_a_run_from_mixtral_starts_at_its_loss_and_our_moe_exports_to_mixtral(make_cfg, hf_models, tmp_path):
    """model.init_from a Mixtral folder: the first step's loss is `transformers`' on that batch. An MoE trained
    from scratch (experts as wide as the dense MLP, the aux loss on), exported, loads in `transformers` as a
    MixtralForCausalLM with our logits; a run from its checkpoint takes the experts' shape and routing from
    it, not its balancing. Both runs split the experts over two ranks (dp2, ep2)."""
    ep2 = ["parallel.nproc=2", "parallel.ep=2"]
    from_hf = _cfg(make_cfg, f"model.init_from={hf_models['mixtral']}", "train.steps=1", *ep2, run="from_mixtral")
    moe = [f"model.vocab_size={VOCAB}", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=0.01"]
    scratch_args = [*moe, "train.steps=2", "checkpoint.interval=2", "optim.lr=1e-2"]
    scratch = _cfg(make_cfg, *scratch_args, *ep2, run="our_moe")
    launch_sequence(run_training, 2, [(from_hf,), (scratch,)])
    first_loss = [r["loss"] for r in read_metrics(from_hf.run_dir) if "loss" in r][0]
    train_set, _ = load_datasets(from_hf.data, with_source_model(from_hf).model, progress=False)
    t = from_hf.train
    batch_size = 2 * t.micro_batch_size  # both data-parallel ranks' micro-batches: the step's global batch
    indices = ResumableSampler(len(train_set), batch_size, batch_size, 0, 1, t.seed)
    batch = collate(train_set, indices.next_micro_batches()[0])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_models["mixtral"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = theirs(batch.tokens).logits
    assert first_loss == pytest.approx(F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item(), abs=TOL)

    ours = str(tmp_path / "our_moe.pt")
    launch_local(logits_entry, 1, _cfg(make_cfg, *scratch_args, run="our_moe"), ours, True)  # its ep2 checkpoint
    with single_process_group():
        export_hf(scratch.run_dir, str(tmp_path / "our_moe_hf"))
    config = _hf_config(tmp_path / "our_moe_hf")
    assert (config["architectures"], config["num_local_experts"], config["intermediate_size"]) == (
        ["MixtralForCausalLM"], 4, 192)  # fmt: skip
    assert (hf_logits(str(tmp_path / "our_moe_hf")) - torch.load(ours)).abs().max() < TOL

    again = with_source_model(_cfg(make_cfg, f"model.init_from={scratch.run_dir}", run="from_ours")).model
    assert again.moe == dataclasses.replace(scratch.model.moe, aux_loss_coef=0.0)


def test_what_mixtral_and_hpc_train_do_not_share_is_refused(make_cfg, hf_models, tmp_path):
    """Importing a Mixtral option hpc_train's model lacks, exporting an MoE Mixtral cannot express (shared
    experts, dense first layers, sigmoid scores, a routing bias moved by auxiliary-loss-free balancing), or
    init_from a source whose experts differ from the config's: each an error naming the key."""
    folder = HFFolder(hf_models["mixtral"])
    for key, value in {"sliding_window": 16, "router_jitter_noise": 0.1}.items():
        with pytest.raises(ConfigError, match=f"Hugging Face config {key}={value} is not supported"):
            model_fields(folder.adapter, {**folder.config, key: value})
    experts = "model.layers.1.block_sparse_moe.experts"
    cfg, shapes = _model_cfg(folder), dict(folder.shapes)
    del shapes[f"{experts}.3.w2.weight"]
    shapes[f"{experts}.2.w1.weight"] = (64, 96)
    with pytest.raises(ConfigError) as err:
        plan_import(folder.adapter, cfg, shapes, _expected(cfg))
    assert str(err.value).endswith(f"missing tensor {experts}.3.w2.weight; {experts}.2.w1.weight has shape "
                                   f"(64, 96), unlike {experts}.0.w1.weight's (96, 64)")  # fmt: skip
    conflicts = {"mixtral": ("model.moe.top_k=1", "model.moe.top_k=1 (it has 2)"),
                 "llama": ("model.moe.num_experts=4", "model.moe.num_experts=4 (it has 0)")}  # fmt: skip
    for arch, (override, message) in conflicts.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            with_source_model(_cfg(make_cfg, f"model.init_from={hf_models[arch]}", override, run=arch))
    run_choice = ["model.moe.aux_loss_coef=0.01", "model.moe.bias_update_rate=0.001", "model.moe.capacity_factor=1.5"]
    kept = with_source_model(_cfg(make_cfg, f"model.init_from={hf_models['mixtral']}", *run_choice, run="m")).model
    assert (kept.moe.aux_loss_coef, kept.moe.bias_update_rate, kept.moe.capacity_factor) == (0.01, 0.001, 1.5)
    assert (kept.moe.num_experts, kept.moe.top_k, kept.moe.expert_ffn_hidden) == (4, 2, 96)

    with single_process_group():
        cfg, state = load_whole(hf_models["mixtral"])
    adapter, moe = hf_adapter_writing(cfg.model), cfg.model.moe
    save_hf(tmp_path / "zero_bias", adapter, cfg.model, state)  # the routing bias is there, and zero
    unfit = dataclasses.replace(moe, num_shared_experts=1, first_dense_layers=1, score_func="sigmoid",
                                norm_topk_prob=False)  # fmt: skip
    with pytest.raises(ConfigError, match=r"num_shared_experts=1 .*first_dense_layers=1 .*score_func='sigmoid'"
                                          r".*norm_topk_prob=False \(Mixtral has True\)"):  # fmt: skip
        save_hf(tmp_path / "unfit", adapter, dataclasses.replace(cfg.model, moe=unfit), state)
    state["layers.1.mlp.router.expert_bias"][2] = 0.5
    with pytest.raises(ConfigError, match=r"no place for layers.1.mlp.router.expert_bias, which are not zero"):
        save_hf(tmp_path / "biased", adapter, cfg.model, state)
    assert not (tmp_path / "biased").exists() and (tmp_path / "zero_bias" / "model.safetensors").is_file()


LORA = ["finetune.method=lora", "finetune.lora_targets=[wq,wv,w2]", "finetune.lora_rank=4", "optim.lr=1e-2",
        "train.steps=3", "train.micro_batch_size=4", "train.grad_accum=2", "checkpoint.interval=3"]  # fmt: skip
LORA_LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.loss_chunk_tokens=32"],
    "pp2_recompute": ["parallel.pp=2", "model.recompute=selective", "model.loss_chunk_tokens=48"],
    "dp2_zero1": ["optim.zero_stage=1", "train.micro_batch_size=2"],
}


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> str:
    """Prompt/response pairs (consecutive lines of standard-library sources), byte-level, with a loss mask."""
    root = tmp_path_factory.mktemp("sft")
    lines = [line.strip() for path in stdlib_sources()[:20] for line in path.read_text().splitlines() if line.strip()]
    pairs = [{"prompt": a[:20] + "\n", "response": b[:8]} for a, b in zip(lines[::2], lines[1::2], strict=False)]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(pair) for pair in pairs[:600]))
    return prepare_data([root / "sft.jsonl"], str(root / "sft"), progress=False, max_tokens=32)["train"]


def _two_rank_layouts_match_one_process(make_cfg, base: list[str], layouts: dict, prefix: str):
    """One process on `base`, then each layout on 2 ranks: the same loss curve and final tensors. Returns the
    reference's config and final weights."""
    reference = _cfg(make_cfg, *base, run=f"{prefix}_single")
    launch_local(run_training, 1, reference)
    runs = {name: _cfg(make_cfg, *base, "parallel.nproc=2", *extra, run=f"{prefix}_{name}")
            for name, extra in layouts.items()}  # fmt: skip
    launch_sequence(run_training, 2, [(cfg,) for cfg in runs.values()])
    expected_losses = [r["loss"] for r in read_metrics(reference.run_dir) if "loss" in r]
    final = read_final_model(reference.run_dir)
    for name, cfg in runs.items():
        losses = [r["loss"] for r in read_metrics(cfg.run_dir) if "loss" in r]
        assert losses == pytest.approx(expected_losses, abs=TOL), name
        assert max_param_diff(read_final_model(cfg.run_dir), final) < TOL, name
    return reference, final


def test_lora_trains_like_one_process_and_exports(make_cfg, hf_models, instructions, tmp_path):
    """LoRA from imported weights on instruction data (the loss counts responses only, a mean over the
    global batch's counted targets): tp2, pp2 and dp2 with ZeRO-1 (other micro-batch splits) equal one
    process (loss curve, every final tensor); the base stays frozen; merged and adapters-only exports give
    the fine-tuned logits."""
    base = [f"model.init_from={hf_models['llama']}", *LORA, f"data.train_path={instructions}"]
    reference, final = _two_rank_layouts_match_one_process(make_cfg, base, LORA_LAYOUTS, "lora")

    imported = safetensors_torch.load_file(f"{hf_models['llama']}/model.safetensors")
    assert torch.equal(final["layers.1.attn.wq.weight"], imported["model.layers.1.self_attn.q_proj.weight"])
    assert final["layers.1.mlp.w2.lora_b"].abs().sum() > 0  # trained
    assert "layers.1.mlp.w1.lora_a" not in final  # not a target

    ours = str(tmp_path / "ours.pt")
    launch_local(logits_entry, 1, reference, ours, True)
    with single_process_group():
        export_hf(reference.run_dir, str(tmp_path / "merged"))
        export_hf(reference.run_dir, str(tmp_path / "adapters"), adapters_only=True)
    fine_tuned = torch.load(ours)
    assert (fine_tuned - hf_logits(hf_models["llama"])).abs().max() > 1e-3  # the adapters changed the model
    assert (hf_logits(str(tmp_path / "merged")) - fine_tuned).abs().max() < TOL
    assert (hf_logits(hf_models["llama"], str(tmp_path / "adapters")) - fine_tuned).abs().max() < TOL


def test_lora_on_an_imported_mixtral_trains_like_one_process_and_exports(make_cfg, hf_models, instructions, tmp_path):
    """LoRA on the attention of an imported Mixtral (the router and routed experts frozen, as the base):
    dp2 with ep2 and tp2 (routed experts replicated) equal one process; the merged export gives
    `transformers` the fine-tuned logits."""
    base = [f"model.init_from={hf_models['mixtral']}", *LORA, "finetune.lora_targets=[wq,wv]",
            f"data.train_path={instructions}"]  # fmt: skip
    layouts = {"dp2_ep2": ["parallel.ep=2", "train.micro_batch_size=2"], "tp2": ["parallel.tp=2"]}
    reference, final = _two_rank_layouts_match_one_process(make_cfg, base, layouts, "moe_lora")
    with single_process_group():
        _, imported = load_whole(hf_models["mixtral"])
        export_hf(reference.run_dir, str(tmp_path / "merged"))
    for frozen in ("layers.1.mlp.router.gate.weight", "layers.1.mlp.experts.w1", "layers.1.attn.wv.weight"):
        assert torch.equal(final[frozen], imported[frozen]), frozen
    assert final["layers.1.attn.wv.lora_b"].abs().sum() > 0  # trained
    ours = str(tmp_path / "ours.pt")
    launch_local(logits_entry, 1, reference, ours, True)
    fine_tuned = torch.load(ours)
    assert (fine_tuned - hf_logits(hf_models["mixtral"])).abs().max() > 1e-3  # the adapters changed the model
    assert (hf_logits(str(tmp_path / "merged")) - fine_tuned).abs().max() < TOL


QLORA = [*LORA, "finetune.method=qlora", "train.precision=bf16", "optim.decay_steps=3", "checkpoint.interval=2"]
QLORA_LAYOUTS = {
    "pp2": ["parallel.pp=2"],
    "dp2_zero1": ["optim.zero_stage=1", "train.micro_batch_size=2"],
    "dp2_zero2": ["optim.zero_stage=2", "train.micro_batch_size=2"],
}
BF16_TOL = 2e-3  # bf16 compute in another order (a pipeline's micro-batches, a dp all-reduce)


def test_qlora_trains_on_nf4_weights_in_any_layout_and_resumes(make_cfg, hf_models, tmp_path):
    """QLoRA's base projections are torchao NF4 tensors (about 0.52 bytes a weight), left out of its
    checkpoints and rebuilt from model.init_from, whose fingerprint the checkpoints record: pp2, and dp2 with
    ZeRO-1 and ZeRO-2, follow one process; a run stopped at step 2 resumes onto the same curve; a changed base is
    refused; the merged export is the dequantized base plus the adapters."""
    source = tmp_path / "base"
    shutil.copytree(hf_models["llama"], source)
    base = [f"model.init_from={source}", *QLORA]
    reference = _cfg(make_cfg, *base, run="q_single")
    launch_local(run_training, 1, reference)
    runs = {name: _cfg(make_cfg, *base, *extra, run=f"q_{name}") for name, extra in QLORA_LAYOUTS.items()}
    launch_sequence(run_training, 2, [(cfg,) for cfg in runs.values()])
    expected = [r["loss"] for r in read_metrics(reference.run_dir) if "loss" in r]
    for name, cfg in runs.items():
        losses = [r["loss"] for r in read_metrics(cfg.run_dir) if "loss" in r]
        assert losses == pytest.approx(expected, abs=BF16_TOL), name

    stopped = _cfg(make_cfg, *base, "train.steps=2", run="q_resumed")
    launch_local(run_training, 1, stopped)
    resumed = dataclasses.replace(stopped, train=dataclasses.replace(stopped.train, steps=3))
    launch_local(run_training, 1, resumed)
    assert [r["loss"] for r in read_metrics(stopped.run_dir) if "loss" in r] == expected

    ckpt = tmp_path / "q_single" / "checkpoints" / "step_0000002"
    saved = {key for key in _checkpoint_keys(ckpt) if key.startswith("model.")}
    assert "model.layers.0.attn.wq.lora_a" in saved and "model.layers.0.mlp_norm.weight" in saved
    assert not any(key.endswith(("wq.weight", "w2.weight")) for key in saved)  # the NF4 base is not saved

    with single_process_group():
        export_hf(reference.run_dir, str(tmp_path / "q_merged"))
    merged = safetensors_torch.load_file(str(tmp_path / "q_merged" / "model.safetensors"))
    original = safetensors_torch.load_file(str(source / "model.safetensors"))
    w1 = "model.layers.0.mlp.gate_proj.weight"  # not a target: its NF4 value, dequantized
    error = (merged[w1] - original[w1]).abs().max() / original[w1].abs().max()
    assert 0 < error < 0.2

    tensors = dict(original)
    tensors[w1] = tensors[w1] + 1
    safetensors_torch.save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="base weights"):
        launch_local(run_training, 1, resumed)


def _checkpoint_keys(path) -> set[str]:
    from hpc_train.checkpoint.safe_load import read_dcp_metadata

    files = {p.name for p in path.iterdir()}
    return set(read_dcp_metadata(path, files).state_dict_metadata)


def test_generate_greedy_follows_transformers(hf_models, capsys):
    prompt = TOKENS[0, :5].tolist()
    for arch in ("llama", "mixtral"):
        with single_process_group():
            _, model = load_model(hf_models[arch])
            ours = generate(model, prompt, 8)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_models[arch], dtype=torch.float32)
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert ours == expected[0, 5:].tolist(), arch
    main(["generate", hf_models["gpt2"], "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0.7",
          "--top-p", "0.9"])  # fmt: skip
    assert capsys.readouterr().out.startswith("def ")
