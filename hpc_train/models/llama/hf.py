"""The Llama family's adapter for `LlamaForCausalLM`: its config keys, its tensor names, and the HF options
hpc_train's Llama does not implement. The attention, norms and embeddings it shares with Mixtral
(mixtral_hf.py) are here, public for that file."""

from __future__ import annotations

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import ties_embeddings
from hpc_train.models.common.hf import HFAdapter, TensorRule, unsupported
from hpc_train.models.llama.model import ARCH, ffn_size


def refuse_attention(config: dict) -> list[str]:
    """What a Llama or Mixtral config.json can say that hpc_train's attention and MLP cannot do: another
    activation, biases, rope scaling, a head_dim other than d_model / n_heads."""
    rope = config.get("rope_parameters") or {}
    heads, width = config["num_attention_heads"], config["hidden_size"]
    return [*unsupported(config, "hidden_act", ("silu",)), *unsupported(config, "attention_bias", (False,), False),
            *unsupported(config, "mlp_bias", (False,), False),
            *unsupported(rope, "rope_type", ("default",), "default"), *unsupported(config, "rope_scaling", (None,)),
            *unsupported(config, "head_dim", (width // heads, None))]  # fmt: skip


def attention_fields(config: dict) -> dict:
    """The keys Llama and Mixtral share -> ModelConfig fields."""
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    heads, width = config["num_attention_heads"], config["hidden_size"]
    return {"arch": "llama", "vocab_size": config["vocab_size"], "n_layers": config["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads, "d_model": width,
            "ffn_hidden": config["intermediate_size"], "rope_theta": float(rope["rope_theta"]),
            "norm_eps": float(config["rms_norm_eps"]), "tie_embeddings": bool(config.get("tie_word_embeddings")),
            "max_position_embeddings": config.get("max_position_embeddings")}  # fmt: skip


def attention_config(cfg: ModelConfig) -> dict:
    """The source's context (model.max_position_embeddings), not the length a fine-tune trained on."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
            "head_dim": cfg.d_model // cfg.n_heads, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.context_len, "tie_word_embeddings": ties_embeddings(cfg, ARCH),
            "hidden_act": "silu"}  # fmt: skip


def attention_rules(cfg: ModelConfig, mlp: dict[str, str]) -> list[TensorRule]:
    """HF's Llama applies RoPE in the same rotate-half form as decoder.apply_rotary: no q/k permutation.
    `mlp`: our names in a block -> theirs, for the block's weights besides attention and norms."""
    rules = [TensorRule(("tok_embeddings.weight",), "model.embed_tokens.weight"),
             TensorRule(("norm.weight",), "model.norm.weight")]  # fmt: skip
    if not ties_embeddings(cfg, ARCH):
        rules.append(TensorRule(("output.weight",), "lm_head.weight"))
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
             "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
             **mlp}  # fmt: skip
    for i in range(cfg.n_layers):
        rules += [TensorRule((f"layers.{i}.{ours}.weight",), f"model.layers.{i}.{theirs}.weight")
                  for ours, theirs in names.items()]  # fmt: skip
    return rules


def _model_fields(config: dict) -> dict:
    """LlamaForCausalLM's config.json -> ModelConfig fields: a dense model."""
    return {**attention_fields(config), "moe.num_experts": 0}


def _hf_config(cfg: ModelConfig) -> dict:
    return {**attention_config(cfg), "intermediate_size": ffn_size(cfg), "attention_bias": False, "mlp_bias": False}


def _rules(cfg: ModelConfig) -> list[TensorRule]:
    return attention_rules(cfg, {"mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj"})


LLAMA_HF = HFAdapter("llama", "LlamaForCausalLM", _model_fields, _hf_config, _rules, refuse_import=refuse_attention,
                     derived=("rotary_emb.inv_freq",))  # fmt: skip
