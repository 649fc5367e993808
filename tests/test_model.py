import torch

from hpc_train.config import ModelConfig
from hpc_train.models.common.decoder import count_params, init_weights, padded_vocab_size
from hpc_train.models.llama import LLAMA

GPT = LLAMA.build_stage
flops_per_token = LLAMA.flops_per_token


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{"n_layers": 2, "n_heads": 4, "d_model": 64, "seq_len": 16, **kw})


def test_init_is_deterministic_and_scaled():
    a, b, c = GPT(tiny()), GPT(tiny()), GPT(tiny())
    init_weights(a, 1)
    init_weights(b, 1)
    init_weights(c, 2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.wq.weight"], sc["layers.0.attn.wq.weight"])
    std_q, std_o = sa["layers.0.attn.wq.weight"].std(), sa["layers.0.attn.wo.weight"].std()
    assert abs(std_o / std_q - 0.5) < 0.05  # residual projections scaled by 1/sqrt(2 * n_layers) = 1/2
    assert torch.equal(sa["norm.weight"], torch.ones(64))


def test_meta_built_model_initializes_to_the_eager_values():
    """What `parallelize` does: build on meta, allocate with to_empty, init in place; the tie survives."""
    cfg = tiny(vocab_size=257, tie_embeddings=True)
    eager = GPT(cfg)
    init_weights(eager, 3)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    init_weights(lazy, 3)
    assert lazy.output.weight is lazy.tok_embeddings.weight
    for name, value in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[name], value), name
    for name, value in eager.named_buffers():
        assert torch.equal(dict(lazy.named_buffers())[name], value), name


def test_causal_and_padded_vocab():
    cfg = tiny(vocab_size=257)
    assert padded_vocab_size(cfg) == 384 and padded_vocab_size(cfg, tp=4) == 512
    model = GPT(cfg)
    init_weights(model, 0)
    tokens = torch.randint(0, 257, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 257
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 16, 384) and torch.isneginf(logits[..., 257:]).all()  # padding: -inf logits
    assert torch.allclose(logits[:, :10, :257], logits_changed[:, :10, :257], atol=1e-6)
    assert not torch.allclose(logits[:, 10:, :257], logits_changed[:, 10:, :257])


def test_grouped_query_attention_and_tied_head():
    model = GPT(tiny(n_kv_heads=2, tie_embeddings=True))
    init_weights(model, 0)
    assert model.layers["0"].attn.wk.weight.shape == (32, 64)
    assert model.output.weight is model.tok_embeddings.weight
    loss = model(torch.randint(0, 257, (2, 16)), torch.randint(0, 257, (2, 16)))
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.2  # near-uniform at init


def test_flops_per_token_counts_matmul_weights():
    cfg = tiny()
    model = GPT(cfg)
    matmul_params = count_params(model) - model.tok_embeddings.weight.numel()  # untied: lookup not counted
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    expected = 6 * (matmul_params - norms) + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    assert flops_per_token(cfg) == expected
