"""The Llama family's Hugging Face counterparts: `LlamaForCausalLM`, and for model.moe configs
`MixtralForCausalLM` (Llama's attention; every block's MLP a softmax-routed top-k of SwiGLU experts with the
gates renormalized over the chosen ones, no shared experts): their config keys and tensor names."""

from __future__ import annotations

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.models.common.decoder import ties_embeddings
from hpc_train.models.common.hf import HFFormat, TensorRule, require
from hpc_train.models.common.moe import expert_hidden
from hpc_train.models.llama.model import ARCH, ffn_size


def _attention_fields(config: dict) -> dict:
    """The keys Llama and Mixtral share -> ModelConfig fields."""
    require(config, "hidden_act", ("silu",))
    require(config, "attention_bias", (False,), False)
    require(config, "mlp_bias", (False,), False)
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    require(rope, "rope_type", ("default",), "default")
    require(config, "rope_scaling", (None,))
    heads, width = config["num_attention_heads"], config["hidden_size"]
    require(config, "head_dim", (width // heads, None))
    return {"arch": "llama", "vocab_size": config["vocab_size"], "n_layers": config["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads, "d_model": width,
            "ffn_hidden": config["intermediate_size"], "rope_theta": float(rope["rope_theta"]),
            "norm_eps": float(config["rms_norm_eps"]), "tie_embeddings": bool(config.get("tie_word_embeddings")),
            "max_position_embeddings": config.get("max_position_embeddings")}  # fmt: skip


def _model_fields(config: dict) -> dict:
    """LlamaForCausalLM's config.json -> ModelConfig fields: a dense model."""
    return {**_attention_fields(config), "moe.num_experts": 0}


def _attention_config(cfg: ModelConfig) -> dict:
    """The source's context (model.max_position_embeddings), not the length a fine-tune trained on."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
            "head_dim": cfg.d_model // cfg.n_heads, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.context_len, "tie_word_embeddings": ties_embeddings(cfg, ARCH),
            "hidden_act": "silu"}  # fmt: skip


def _hf_config(cfg: ModelConfig) -> dict:
    return {**_attention_config(cfg), "intermediate_size": ffn_size(cfg), "attention_bias": False, "mlp_bias": False}


def _attention_rules(cfg: ModelConfig, mlp: dict[str, str]) -> list[TensorRule]:
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


def _hf_rules(cfg: ModelConfig) -> list[TensorRule]:
    return _attention_rules(cfg, {"mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj"})


def _mixtral_fields(config: dict) -> dict:
    """MixtralForCausalLM's config.json -> ModelConfig fields: every block MoE, each expert as wide as
    intermediate_size. What Mixtral can be but hpc_train's model cannot is refused."""
    require(config, "sliding_window", (None,))
    require(config, "router_jitter_noise", (0, 0.0), 0.0)
    return {**_attention_fields(config), "moe.num_experts": config["num_local_experts"],
            "moe.top_k": config["num_experts_per_tok"], "moe.num_shared_experts": 0,
            "moe.expert_ffn_hidden": config["intermediate_size"], "moe.first_dense_layers": 0,
            "moe.score_func": "softmax"}  # fmt: skip


def _mixtral_config(cfg: ModelConfig) -> dict:
    """An MoE config Mixtral cannot express is refused, naming each key."""
    m = cfg.moe
    unfit = {"model.moe.num_shared_experts": (m.num_shared_experts, 0),
             "model.moe.first_dense_layers": (m.first_dense_layers, 0),
             "model.moe.score_func": (m.score_func, "softmax")}  # fmt: skip
    if problems := [f"{key}={value!r} (Mixtral has {fit!r})" for key, (value, fit) in unfit.items() if value != fit]:
        raise ConfigError(f"cannot export to MixtralForCausalLM: {', '.join(problems)}")
    return {**_attention_config(cfg), "intermediate_size": expert_hidden(cfg, ffn_size(cfg)),
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, "sliding_window": None,
            "router_jitter_noise": 0.0}  # fmt: skip


def _mixtral_rules(cfg: ModelConfig) -> list[TensorRule]:
    """Each expert's w1 (gate), w3 (up) and w2 (down), stored (out, in) per expert under the names of the
    Hub's Mixtral checkpoints (what transformers' save_pretrained writes and from_pretrained reads), make our
    stacked (experts, in, out) weights."""
    rules = _attention_rules(cfg, {"mlp.router.gate": "block_sparse_moe.gate"})
    for i in range(cfg.n_layers):
        experts = f"model.layers.{i}.block_sparse_moe.experts"
        rules += [TensorRule((f"layers.{i}.mlp.experts.{w}",),
                             tuple(f"{experts}.{e}.{w}.weight" for e in range(cfg.moe.num_experts)), "stack")
                  for w in ("w1", "w3", "w2")]  # fmt: skip
    return rules


MIXTRAL = HFFormat("mixtral", "MixtralForCausalLM", _mixtral_fields, _mixtral_config, _mixtral_rules,
                   derived=("rotary_emb.inv_freq",), zero_buffers=(".mlp.router.expert_bias",))  # fmt: skip
HF = HFFormat("llama", "LlamaForCausalLM", _model_fields, _hf_config, _hf_rules, derived=("rotary_emb.inv_freq",),
              moe=MIXTRAL)  # fmt: skip
