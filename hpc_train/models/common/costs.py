"""What the skeleton costs, for the planner and the MFU figure: training FLOPs per token and the bytes
one micro-batch keeps for backward (`StageActivations`), derived from the modules in decoder.py; a family's
norm and MLP say their own share (`Architecture.norm_saved_bytes`, `saved_widths`)."""

from __future__ import annotations

import math

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import Architecture, loss_chunk_rows, padded_vocab_size
from hpc_train.models.common.moe import expert_hidden, group_align, is_moe_layer, moe_block_weights, padded_length
from hpc_train.models.spec import ActivationShape, StageActivations


def loss_chunked(cfg: ModelConfig, shape: ActivationShape) -> bool:
    """Whether `Decoder.loss` cuts a micro-batch of this shape into several chunks (single tokens, or
    under sequence parallelism whole sequences)."""
    targets = (shape.tokens // cfg.seq_len, cfg.seq_len) if shape.sequence_parallel else (shape.tokens, 1)
    return loss_chunk_rows(cfg.loss_chunk_tokens, targets) < targets[0]


def block_matmul_weights(cfg: ModelConfig, arch: Architecture) -> int:
    """Elements of one block's projection weights (biases and norms left out)."""
    d = cfg.d_model
    kv = (cfg.n_kv_heads or cfg.n_heads) * (d // cfg.n_heads)
    mlp_matrices = len(arch.mlp.column_parallel) + 1
    return d * d * 2 + d * kv * 2 + mlp_matrices * d * arch.ffn_size(cfg)


def layer_matmul_weights(cfg: ModelConfig, arch: Architecture, layer_id: int, active: bool = True) -> int:
    """`block_matmul_weights` of block `layer_id`; an MoE block counts its router, shared experts and, when
    `active`, the top_k routed experts a token goes through (else all of them)."""
    weights = block_matmul_weights(cfg, arch)
    if not (arch.moe and is_moe_layer(cfg, layer_id)):
        return weights
    dense_mlp = (len(arch.mlp.column_parallel) + 1) * cfg.d_model * arch.ffn_size(cfg)
    return weights - dense_mlp + moe_block_weights(cfg, arch.ffn_size(cfg), active)


def decoder_flops_per_token(cfg: ModelConfig, *, arch: Architecture) -> int:
    """Training FLOPs per token, 6N + 12 * L * d * s (Megatron / nanoGPT / PaLM): N counts every weight
    that takes part in a matmul (the input embeddings are lookups; the head counts once, tied or not); in
    MoE blocks only the active ones (router, shared and top_k routed experts)."""
    d, layers, vocab = cfg.d_model, cfg.n_layers, padded_vocab_size(cfg)
    blocks = sum(layer_matmul_weights(cfg, arch, i) for i in range(layers))
    return 6 * (blocks + vocab * d) + 12 * layers * d * cfg.seq_len


def frozen_mlp_keeps(mlp: type, targets: set[str]) -> tuple[bool, int]:
    """What an MLP keeps for backward under LoRA `targets` (none: full training): whether its input (a
    projection reading it has an adapter, or trains), and how many of its `saved_widths` (the down
    projection's input only when that projection has an adapter)."""
    input_kept = not targets or bool(targets & set(mlp.column_parallel))
    down_input_dropped = bool(targets) and mlp.row_parallel not in targets
    return input_kept, mlp.saved_widths - down_input_dropped


def regathered(shape: ActivationShape) -> bool:
    """Whether the column-parallel projections keep the rank's slice of their input and gather it again in
    backward (models/common/regather.py `regathers`): where tensor parallelism has them do it, in full
    training, not compiled."""
    return shape.regather and not shape.compiled and not shape.lora_targets


def projection_input_bytes(shape: ActivationShape, d: int, kept: bool) -> int:
    """What the column-parallel projections reading one norm's output keep of it for backward (nothing when
    `kept` is False: all frozen, no adapter reads it): the input whole, in the compute dtype the norm
    returns (autocast's cast of it is the input itself); the rank's slice where `regathered`."""
    return kept * (shape.tokens // shape.tp if regathered(shape) else shape.tokens) * d * shape.element_bytes


def moe_extra_bytes(cfg: ModelConfig, arch: Architecture, shape: ActivationShape, casts: bool) -> int:
    """What an MoE block keeps for backward beyond a dense block (its saved-tensor trace on CPU, torch 2.13),
    with T tokens, A = T x top_k assignments (fewer under a capacity), E experts, h the expert width:

      router       its input in fp32 (T x d x 4; with bf16 weights a copy, and of its weight too), the scores
                   (T x E x 4), the chosen experts, gates and their sum (T x (12 top_k + 4))
      dispatch     the sort order, each assignment's token and gate (A x 20), the group offsets (E x 4)
      experts      the gathered rows (R x d), SwiGLU's widths (R x h each), all in the compute dtype;
                   with autocast over fp32 weights every expert weight's cast. R = A for the loop; the
                   grouped GEMM pads each expert's group to 16 bytes' worth of rows (R = A + E x
                   (16 / bytes - 1), rounded up to that) and keeps where each row went (A x 8)
      combine      the expert outputs back in token order, in fp32 (A x d x 4)
      shared       a dense MLP of the shared experts' width (tp-sharded like one), reading the block's input;
                   compiled, what inductor recomputes of an MLP is not kept (the routed experts stay eager)

    The routed experts are replicated over tp, so only the shared experts' part is divided by it; under
    sequence parallelism the router and routed experts see the rank's T / tp tokens, and the shared experts
    gather their own input (the router reads the rank's slice), which they keep as `projection_input_bytes`
    says. With LoRA
    (`shape.lora_targets`; the router and routed experts frozen) neither the router's input nor the routed
    rows and their down projection's input are kept, and the dense and shared MLPs keep what
    `decoder_activations` says a frozen MLP keeps. Returned as the difference to the dense MLP
    `decoder_activations` counts in every block."""
    m, tokens, tp, e = cfg.moe, shape.tokens, shape.tp, shape.element_bytes
    d, f, mlp = cfg.d_model, arch.ffn_size(cfg), arch.mlp
    hidden, shared = expert_hidden(cfg, f), expert_hidden(cfg, f) * m.num_shared_experts
    matrices = len(mlp.column_parallel) + 1
    lora = set(shape.lora_targets)
    input_kept, widths = frozen_mlp_keeps(mlp, lora)  # the dense and shared MLPs', as decoder_activations counts
    widths -= mlp.recomputed_when_compiled * shape.compiled  # in a compiled block (the routed experts run eager)
    routed_tokens = tokens // tp if shape.sequence_parallel else tokens  # what the router sees
    assigned = routed_tokens * m.top_k
    if m.capacity_factor:
        assigned = min(assigned, m.num_experts * math.ceil(m.capacity_factor * assigned / m.num_experts))
    mlp_input = projection_input_bytes(shape, d, input_kept)  # what the dense MLP keeps of its input
    dense = mlp_input + widths * tokens * f * e // tp
    copies = e != 4 and not casts  # bf16 weights: the router reads an fp32 copy of its input and weight
    router = routed_tokens * (d * 4 * (not lora) + m.num_experts * 4 + 12 * m.top_k + 4)
    router += copies * d * m.num_experts * 4
    rows = padded_length(assigned, m.num_experts, group_align(e)) if m.grouped_mm else assigned
    routed = (
        assigned * 20
        + m.num_experts * 4
        + rows * d * e * (not lora)
        + (mlp.saved_widths - bool(lora)) * rows * hidden * e
    )
    routed += assigned * 8 if m.grouped_mm else 0
    routed += assigned * d * 4 + (matrices * m.num_experts * d * hidden * e if casts else 0)
    moe = router + routed
    if shared:  # its input: the fp32 router input itself (the rank's slice under sequence parallelism, where
        # it is gathered again in backward), or its own (bf16, LoRA, sequence parallelism keeping the gathered input)
        own_input = e != 4 or casts or bool(lora) or (shape.sequence_parallel and not regathered(shape))
        moe += mlp_input * own_input + widths * tokens * shared * e // tp
    return moe - dense


def decoder_activations(cfg: ModelConfig, shape: ActivationShape, *, arch: Architecture) -> StageActivations:
    """Derived from the block's saved-tensor trace, in units of T x d elements (T tokens on the rank, d
    model width, a heads, f the MLP width) per block:

      two norms       arch.norm_saved_bytes each (the family's module says what its norm keeps)
      matmul inputs   2 (the normed input of attention and of the MLP, in the activation dtype); under
                      sequence parallelism the rank's slice of each, 2/tp (`projection_input_bytes`)
      q, k, v         1 + 2 kv/a (after RoPE where rotary), kept by SDPA
      attention out   1 (shared with wo's input; 2 with `shape.core_output_copy`), plus SDPA's fp32
                      logsumexp of T x a
      document mask   packed documents: nothing kept (the core builds each query tile's bias again in
                      backward); one tile's bias and its boolean (`shape.document_tile` elements, e + 2
                      bytes each) live while a block's backward runs
      MLP             mlp.saved_widths x f/d (e.g. SwiGLU: w1 and w3 outputs, silu output, their product)

    Biases keep nothing; learned positions are a slice of a parameter. Fused SDPA never keeps the s x s
    attention matrix, so Korthikanti et al.'s 5as/h term does not exist here, and `selective` recompute
    saves only the logsumexp; `full` keeps only the block's input. Under tp everything after the
    column-parallel matmuls is divided by tp; with sequence parallelism the norm regions are too, and where
    `regathered` the matmul inputs as well (Megatron's 32/tp without dropout for GPT-2 with selective
    recompute): they are gathered again in backward, which holds one of them, whole, while a block's
    backward runs (`regathered_input`), and a block recomputed whole keeps them whole while its backward
    runs (`regather_saving`).

    With LoRA (`shape.lora_targets`) a frozen projection keeps no input and a frozen norm no output: only
    the inputs of adapted projections are kept (once per input, however many adapters read it), plus
    each adapter's rank-wide hidden; the frozen embeddings let the first block's first norm keep nothing,
    and the frozen head keeps no input.

    Compiled blocks (`shape.compiled`): inductor's partitioner recomputes cheap pointwise results in
    backward rather than keeping them; the family's norm and MLP say which (calibrated against CPU
    inductor, torch 2.13), and selective recompute's attention output is recomputed with its core.

    Autocast over fp32 weights (`shape.autocast_casts`): the residual stream is in the compute dtype all the
    same (the embeddings' output is cast, the norms return their input's dtype), so each projection's cast
    of its input is the input itself; autocast's cast of each weight is kept once for the whole step
    (`weight_casts_block`, not an activation: autocast caches it for every micro-batch). Float8
    projections (`shape.float8`) keep the parameter itself, no cast of the weight."""
    tokens, tp, e = shape.tokens, shape.tp, shape.element_bytes
    d, a, kv, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, arch.ffn_size(cfg)
    mlp, targets = arch.mlp, set(shape.lora_targets)
    norm_tokens = tokens // tp if shape.sequence_parallel else tokens
    casts = shape.autocast_casts and not targets
    norm = arch.norm_saved_bytes(norm_tokens, d, e, not targets, shape.compiled)
    final_norm = arch.norm_saved_bytes(norm_tokens, d, e, not targets, False)  # outside compiled blocks
    # with LoRA a frozen projection keeps no input: only an adapter's matmul does (and its rank-wide output)
    mlp_input_kept, mlp_widths = frozen_mlp_keeps(mlp, targets)
    attention_input_kept = not targets or bool(targets & {"wq", "wk", "wv"})
    inputs = projection_input_bytes(shape, d, attention_input_kept) + projection_input_bytes(shape, d, mlp_input_kept)
    inputs_whole = (attention_input_kept + mlp_input_kept) * tokens * d * e  # kept by a block recomputed whole
    mlp_widths -= mlp.recomputed_when_compiled * shape.compiled
    attention_out = tokens * d * e // tp  # kept by SDPA, or else for wo (not for a frozen wo without adapter)
    selective = (
        2 * norm
        + inputs
        + tokens * d * e * (1 + 2 * kv / a) // tp
        + mlp_widths * tokens * f * e // tp
        + len(targets) * tokens * shape.lora_rank * e
    )
    vocab, chunked = padded_vocab_size(cfg, tp), loss_chunked(cfg, shape)
    # per token, the loss keeps its fp32 log-softmax; compiled (only without tp: loss_parallel does not compile)
    # it keeps the logits and writes their gradient over them. Chunked, one chunk's recomputed logits and
    # its fp32 log-softmax and gradient live while the chunk's backward runs (measured on CPU, 8 and e bytes)
    loss_compiled = shape.compiled and tp == 1
    logits_kept = tokens * vocab // tp * (e if loss_compiled else 4) * (not chunked)
    if chunked:
        length = cfg.seq_len if shape.sequence_parallel else 1  # whole sequences under sp, else tokens
        chunk_tokens = loss_chunk_rows(cfg.loss_chunk_tokens, (0, length)) * length
        loss_backward = chunk_tokens * vocab // tp * (e if loss_compiled else 8)
    else:
        # nll_loss's gradient and log_softmax's, fp32; loss_parallel's (tp) takes three (measured on CPU)
        loss_backward = tokens * vocab // tp * (0 if loss_compiled else 12 if tp > 1 else 8)
    # frozen embeddings keep no token ids, and the first block's first norm has no gradient to pass back
    first = tokens * 8 if not targets else -norm * (shape.first_block_recompute != "full")
    moe_block = moe_extra_bytes(cfg, arch, shape, casts) if arch.moe and cfg.moe.num_experts else 0
    return StageActivations(
        layer={
            "none": int(selective + attention_out * (1 + shape.core_output_copy) + tokens * a * 4 // tp),
            # compiled, the selective region's output is recomputed with it rather than kept for wo
            "selective": int(selective + attention_out * (not targets or "wo" in targets) * (not shape.compiled)),
            "full": norm_tokens * d * e,
        },
        every_stage=2 * (shape.rope_rows or cfg.seq_len) * (d // a) * 4 if arch.rotary else 0,  # fp32 cos, sin
        first_stage=first,
        # the head's input (not for a frozen head), the loss's (none when chunked: each chunk is recomputed in
        # backward) and the targets
        last_stage=final_norm + tokens * d * e * (not targets) + logits_kept + tokens * 8,
        loss_backward=loss_backward,
        block_backward=tokens * f * e // tp + norm_tokens * d * e + shape.document_tile * (e + 2),
        regathered_input=regathered(shape) * tokens * d * e,
        regather_saving=inputs_whole - inputs,
        moe_block=moe_block,
        # wq, wk, wv; wo and the MLP's row-parallel output whole; its column-parallel outputs; the two norms
        weight_grads_block=(
            tokens * d * (1 + 2 * kv / a) // tp
            + 2 * tokens * d
            + len(mlp.column_parallel) * tokens * f // tp
            + 2 * norm_tokens * d
        )
        * e,
        # the logits' gradient, chunked too (each chunk's stays for the head's weight half), and the final norm's
        weight_grads_last_stage=(tokens * vocab // tp + norm_tokens * d) * e,
        weight_casts_block=block_matmul_weights(cfg, arch) * e // tp * (casts and not shape.float8),
        moe_weight_casts=moe_weight_cast_bytes(cfg, arch, shape) * (casts and not shape.float8),
        weight_casts_last_stage=vocab * d * e // tp * casts,
    )


def moe_weight_cast_bytes(cfg: ModelConfig, arch: Architecture, shape: ActivationShape) -> int:
    """What autocast's casts of an MoE block's linear weights take beyond a dense block's: its shared
    experts' instead of the dense MLP (the routed experts cast their own weights at each forward, kept as
    activations: `moe_extra_bytes`)."""
    if not (arch.moe and cfg.moe.num_experts):
        return 0
    f, matrices = arch.ffn_size(cfg), len(arch.mlp.column_parallel) + 1
    shared = expert_hidden(cfg, f) * cfg.moe.num_shared_experts
    return matrices * cfg.d_model * (shared - f) * shape.element_bytes // shape.tp
