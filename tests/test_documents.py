"""Document boundaries inside packed samples (data.reset_position_ids, data.document_mask): with both on,
every document of a packed sample gets the logits it gets when forwarded alone; with them off it does not.
The documents come from the dataset's offsets (the test slices them from the documents' own lengths).
Attention with documents never builds the S x S mask: query tiles on the CPU (FlexAttention on CUDA) give
the explicit mask's output and gradients."""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from hpc_train.config import ModelConfig
from hpc_train.data.batch import collate
from hpc_train.data.blend import BlendedSource
from hpc_train.data.indexed import IndexedDataset, IndexedDatasetWriter
from hpc_train.models.common.decoder import causal_attention, init_weights
from hpc_train.models.common.document_attention import (
    document_mask,
    flex_document_attention,
    tiled_document_attention,
)
from hpc_train.models.gpt2 import GPT2
from hpc_train.models.llama import LLAMA

SEQ = 16
LENGTHS = [5, 9, 3, 11, 4, 8, 2, 6, 7]  # sample 1 starts inside the third document, sample 2 at the sixth
TOL = 1e-5
VOCAB = 257


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[IndexedDataset, list[np.ndarray]]:
    gen = np.random.default_rng(0)
    docs = [gen.integers(0, 256, n) for n in LENGTHS]
    writer = IndexedDatasetWriter(tmp_path_factory.mktemp("docs") / "packed", vocab_size=VOCAB, tokenizer="byte")
    for doc in docs:
        writer.add_document(doc)
    writer.close()
    return IndexedDataset(writer.prefix, SEQ), docs


def segments(docs: list[np.ndarray], row: int) -> list[tuple[int, int]]:
    """(start, end) in sample `row`'s inputs of each document piece, from the documents' lengths."""
    ends = np.cumsum([len(d) for d in docs]) - row * SEQ
    cuts = [0, *(int(e) for e in ends if 0 < e < SEQ), SEQ]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def worst_document(model, ds: IndexedDataset, docs, reset: bool, mask: bool) -> float:
    """The largest difference between a document's logits in its packed sample and forwarded alone."""
    rows = np.arange(3)
    batch = collate(ds, rows, reset_position_ids=reset, document_mask=mask)
    with torch.no_grad():
        packed = model(batch.tokens, positions=batch.positions, documents=batch.documents)
        worst = 0.0
        for row in rows.tolist():
            for start, end in segments(docs, row):
                alone = model(batch.tokens[row : row + 1, start:end])[0, :, :VOCAB]  # (padding rows are -inf)
                worst = max(worst, (packed[row, start:end, :VOCAB] - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("family", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_each_packed_document_matches_its_separate_forward(packed, family):
    ds, docs = packed
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, seq_len=SEQ, vocab_size=VOCAB, arch=family.name)
    model = family.build_stage(cfg).eval()
    init_weights(model, 0)
    assert worst_document(model, ds, docs, reset=True, mask=True) <= TOL
    assert worst_document(model, ds, docs, reset=False, mask=False) > 1e-3  # attention crosses documents
    assert worst_document(model, ds, docs, reset=True, mask=False) > 1e-3
    # RoPE depends on relative positions only: the mask alone isolates a llama document; learned ones need both
    only_mask = worst_document(model, ds, docs, reset=False, mask=True)
    assert only_mask <= TOL if family is LLAMA else only_mask > 1e-3


def test_document_ids_and_positions_come_from_the_offsets(packed, tmp_path):
    ds, docs = packed
    batch = collate(ds, np.arange(3), reset_position_ids=True, document_mask=True)
    for row in range(3):
        for number, (start, end) in enumerate(segments(docs, row)):
            assert batch.documents[row, start:end].tolist() == [number] * (end - start)
            assert batch.positions[row, start:end].tolist() == list(range(end - start))
    plain = collate(ds, np.arange(3))
    assert plain.positions is None and plain.documents is None and torch.equal(plain.tokens, batch.tokens)
    # a blend asks each sample's own source
    blend = BlendedSource({"a": ds, "b": ds})
    indices = np.array([blend.offsets[1] + 2, 1])
    assert np.array_equal(blend.documents(indices), ds.documents(np.array([2, 1])))


def test_document_attention_keeps_no_mask_and_matches_the_explicit_one():
    """Query tiles of 8 and 13 rows (every tile spans its documents' keys; one ends mid-document, one holds
    a one-token document), and causal_attention's default path with grouped-query k, v: the explicit mask's
    output and gradients, while autograd keeps nothing of seq x seq. FlexAttention's block mask (the CUDA
    path; its CPU backward does not exist) gives the same forward."""
    seq = 48
    first = torch.cat([torch.full((n,), i) for i, n in enumerate([27, 1, 5, seq])])[:seq]
    documents = torch.stack([first, torch.arange(seq) // 3])
    gen = torch.Generator().manual_seed(0)
    q, dout = torch.randn(2, 4, seq, 8, generator=gen), torch.randn(2, 4, seq, 8, generator=gen)
    k, v = torch.randn(2, 2, seq, 8, generator=gen), torch.randn(2, 2, seq, 8, generator=gen)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = document_mask(documents)
    ref = torch.nn.functional.scaled_dot_product_attention(
        ref_in[0], *(t.repeat_interleave(2, 1) for t in ref_in[1:]), attn_mask=mask
    )
    ref.backward(dout)
    cores = {"tiles of 8": lambda *t: tiled_document_attention(t[0], *(x.repeat_interleave(2, 1) for x in t[1:]),
                                                               documents, 8),
             "tiles of 13": lambda *t: tiled_document_attention(t[0], *(x.repeat_interleave(2, 1) for x in t[1:]),
                                                                documents, 13),
             "causal_attention": lambda *t: causal_attention(*t, documents)}  # fmt: skip
    saved: list[int] = []
    for name, core in cores.items():
        saved.clear()
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = core(*mine)
        out.backward(dout)
        assert max(saved) < mask.numel(), (name, saved)  # q, k, v, the output: nothing seq x seq
        assert (out - ref).abs().max() <= TOL, name
        for got, want in zip(mine, ref_in, strict=True):
            assert (got.grad - want.grad).abs().max() <= TOL, name
    with torch.no_grad():
        flex = flex_document_attention(q, k, v, documents, kernel=flex_attention)
    assert (flex - ref).abs().max() <= TOL
