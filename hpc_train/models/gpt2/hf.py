"""The GPT-2 family's adapter for `GPT2LMHeadModel`: its config keys, its tensor names, and the HF options
hpc_train's GPT-2 does not implement."""

from __future__ import annotations

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import ties_embeddings
from hpc_train.models.common.hf import HFAdapter, TensorRule, unsupported
from hpc_train.models.gpt2.model import ARCH, ffn_size


def _refuse_import(config: dict) -> list[str]:
    """Another activation, unscaled or layer-scaled attention, cross-attention."""
    return [*unsupported(config, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new"),
            *unsupported(config, "scale_attn_weights", (True,), True),
            *unsupported(config, "scale_attn_by_inverse_layer_idx", (False,), False),
            *unsupported(config, "add_cross_attention", (False,), False)]  # fmt: skip


def _model_fields(config: dict) -> dict:
    """GPT2LMHeadModel's config.json -> ModelConfig fields (the learned positions' count too: n_positions)."""
    return {"arch": "gpt2", "vocab_size": config["vocab_size"], "n_layers": config["n_layer"],
            "n_heads": config["n_head"], "n_kv_heads": None, "d_model": config["n_embd"],
            "ffn_hidden": config.get("n_inner") or 4 * config["n_embd"],
            "norm_eps": float(config["layer_norm_epsilon"]),
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "max_position_embeddings": config["n_positions"]}  # fmt: skip


def _hf_config(cfg: ModelConfig) -> dict:
    """n_positions: the rows of the position table exported (model.context_len), whatever seq_len trained."""
    return {"vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": ffn_size(cfg), "n_positions": cfg.context_len, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "tie_word_embeddings": ties_embeddings(cfg, ARCH)}  # fmt: skip


def _rules(cfg: ModelConfig) -> list[TensorRule]:
    """HF's GPT-2 keeps its projections as Conv1D, (in, out), and q, k, v fused in c_attn."""
    rules = [TensorRule(("tok_embeddings.weight",), "transformer.wte.weight"),
             TensorRule(("pos_embeddings.weight",), "transformer.wpe.weight")]  # fmt: skip
    rules += [TensorRule((f"norm.{p}",), f"transformer.ln_f.{p}") for p in ("weight", "bias")]
    if not ties_embeddings(cfg, ARCH):
        rules.append(TensorRule(("output.weight",), "lm_head.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for p in ("weight", "bias"):
            rules += [
                TensorRule((f"{ours}.attn_norm.{p}",), f"{theirs}.ln_1.{p}"),
                TensorRule((f"{ours}.mlp_norm.{p}",), f"{theirs}.ln_2.{p}"),
                TensorRule(tuple(f"{ours}.attn.{w}.{p}" for w in ("wq", "wk", "wv")), f"{theirs}.attn.c_attn.{p}",
                           "split"),
                TensorRule((f"{ours}.attn.wo.{p}",), f"{theirs}.attn.c_proj.{p}", "transpose"),
                TensorRule((f"{ours}.mlp.fc.{p}",), f"{theirs}.mlp.c_fc.{p}", "transpose"),
                TensorRule((f"{ours}.mlp.proj.{p}",), f"{theirs}.mlp.c_proj.{p}", "transpose"),
            ]  # fmt: skip
    return rules


GPT2_HF = HFAdapter("gpt2", "GPT2LMHeadModel", _model_fields, _hf_config, _rules, refuse_import=_refuse_import,
                    derived=(".attn.bias", ".attn.masked_bias"))  # fmt: skip
