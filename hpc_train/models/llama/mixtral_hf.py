"""The Llama family's adapter for `MixtralForCausalLM`, which model.moe configs export to: Llama's attention
(hf.py); every block's MLP a softmax-routed top-k of SwiGLU experts with the gates renormalized over the
chosen ones, no shared experts. What Mixtral can be but hpc_train's model cannot, and what an hpc_train MoE
can be but Mixtral cannot, is refused here, by key."""

from __future__ import annotations

import torch

from hpc_train.config import ModelConfig
from hpc_train.models.common.hf import HFAdapter, TensorRule, listed, unsupported
from hpc_train.models.common.moe import expert_hidden, normalizes_gates
from hpc_train.models.llama.hf import attention_config, attention_fields, attention_rules, refuse_attention
from hpc_train.models.llama.model import ffn_size

ROUTER_BIAS = (".mlp.router.expert_bias",)  # hpc_train's auxiliary-loss-free balancing; Mixtral has none


def _refuse_import(config: dict) -> list[str]:
    return [*refuse_attention(config), *unsupported(config, "sliding_window", (None,)),
            *unsupported(config, "router_jitter_noise", (0, 0.0), 0.0)]  # fmt: skip


def _refuse_export(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> list[str]:
    """Shared experts, dense first layers, other scores, raw gates, and routing biases moved from zero:
    Mixtral would compute another model (without the biases, it would choose other experts)."""
    m = cfg.moe
    unfit = {"model.moe.num_shared_experts": (m.num_shared_experts, 0),
             "model.moe.first_dense_layers": (m.first_dense_layers, 0),
             "model.moe.score_func": (m.score_func, "softmax"),
             "model.moe.norm_topk_prob": (normalizes_gates(cfg), True)}  # fmt: skip
    problems = [f"{key}={value!r} (Mixtral has {fit!r})" for key, (value, fit) in unfit.items() if value != fit]
    if biased := sorted(name for name, t in state.items() if name.endswith(ROUTER_BIAS) and t.any()):
        problems.append(f"it has no place for {listed(biased)}, which are not zero (auxiliary-loss-free balancing "
                        "moved them: model.moe.bias_update_rate > 0), and its routing without them would "
                        "differ")  # fmt: skip
    return problems


def _model_fields(config: dict) -> dict:
    """MixtralForCausalLM's config.json -> ModelConfig fields: every block MoE, each expert as wide as
    intermediate_size, the gates renormalized (norm_topk_prob's default at top_k > 1; said at top_k=1)."""
    return {**attention_fields(config), "moe.num_experts": config["num_local_experts"],
            "moe.top_k": config["num_experts_per_tok"], "moe.num_shared_experts": 0,
            "moe.expert_ffn_hidden": config["intermediate_size"], "moe.first_dense_layers": 0,
            "moe.score_func": "softmax",
            "moe.norm_topk_prob": True if config["num_experts_per_tok"] == 1 else None}  # fmt: skip


def _hf_config(cfg: ModelConfig) -> dict:
    m = cfg.moe
    return {**attention_config(cfg), "intermediate_size": expert_hidden(cfg, ffn_size(cfg)),
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, "sliding_window": None,
            "router_jitter_noise": 0.0}  # fmt: skip


def _rules(cfg: ModelConfig) -> list[TensorRule]:
    """Each expert's w1 (gate), w3 (up) and w2 (down), stored (out, in) per expert under the names of the
    Hub's Mixtral checkpoints (what transformers' save_pretrained writes and from_pretrained reads), make our
    stacked (experts, in, out) weights."""
    rules = attention_rules(cfg, {"mlp.router.gate": "block_sparse_moe.gate"})
    for i in range(cfg.n_layers):
        experts = f"model.layers.{i}.block_sparse_moe.experts"
        rules += [TensorRule((f"layers.{i}.mlp.experts.{w}",),
                             tuple(f"{experts}.{e}.{w}.weight" for e in range(cfg.moe.num_experts)), "stack")
                  for w in ("w1", "w3", "w2")]  # fmt: skip
    return rules


MIXTRAL_HF = HFAdapter("mixtral", "MixtralForCausalLM", _model_fields, _hf_config, _rules,
                       refuse_import=_refuse_import, refuse_export=_refuse_export, derived=("rotary_emb.inv_freq",),
                       zero_buffers=ROUTER_BIAS, experts=True)  # fmt: skip
