"""Document boundaries inside packed samples (data.reset_position_ids, data.document_mask): with both on,
every document of a packed sample gets the logits it gets when forwarded alone; with them off it does not.
The documents come from the dataset's offsets (the test slices them from the documents' own lengths)."""

import numpy as np
import pytest
import torch

from hpc_train.config import ModelConfig
from hpc_train.data.batch import collate
from hpc_train.data.blend import BlendedSource
from hpc_train.data.indexed import IndexedDataset, IndexedDatasetWriter
from hpc_train.models.common.decoder import init_weights
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
