"""Megatron-LM's indexed datasets (the `MMIDIDX` .bin/.idx pairs its `preprocess_data.py` writes through
megatron-core's `IndexedDatasetBuilder`), read where they lie, through the same memory maps as our own
format: teams bring corpora that took days to tokenize, and a conversion step would copy terabytes.

Its index holds the magic, a version (1), a token dtype code, the sequence count S and the count of document
boundaries (D + 1 for D documents), then S int32 sequence lengths, S int64 byte pointers into the .bin and
the D + 1 int64 boundaries (sequence indices: 0 first, S last). A document is one or more sequences (its
sentences, when it was split); the builder writes the sequences back to back, so the .bin as a whole is the
token stream our samples cut, and a document starts at its first sequence's pointer: Megatron's documents
are our documents (data.reset_position_ids / data.document_mask). The index records no vocabulary, tokenizer
or loss mask: the vocabulary is the model's (model.vocab_size), and every token counts in the loss.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document boundaries: 34 bytes
# megatron-core's DType codes; its float codes are not token ids, and are refused
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FLOAT_CODES = {6: "float64", 7: "float32"}


@dataclass(frozen=True)
class MegatronIndex:
    """Where the arrays of one index lie (byte offsets into the .idx), read through memory maps on demand."""

    path: str
    dtype: np.dtype
    sequences: int
    documents: int
    tokens: int  # the .bin's length in tokens, where its last sequence ends

    @property
    def lengths_at(self) -> int:
        return HEADER.size

    @property
    def pointers_at(self) -> int:
        return HEADER.size + 4 * self.sequences

    @property
    def boundaries_at(self) -> int:
        return HEADER.size + 12 * self.sequences

    def lengths(self) -> np.ndarray:
        return self._array(np.int32, self.lengths_at, self.sequences)

    def pointers(self) -> np.ndarray:
        return self._array(np.int64, self.pointers_at, self.sequences)

    def boundaries(self) -> np.ndarray:
        return self._array(np.int64, self.boundaries_at, self.documents + 1)

    def _array(self, dtype: type, offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_megatron_index(idx_path: str, bin_path: str) -> MegatronIndex:
    """The index of a Megatron-LM dataset, its sizes checked against each other and against the .bin (a few
    reads, whatever its size); ValueError naming the file and what is wrong."""
    size = os.path.getsize(idx_path)
    if size < HEADER.size:
        raise ValueError(f"{idx_path} has {size} bytes, fewer than a Megatron-LM index header's {HEADER.size}: "
                         "truncated")  # fmt: skip
    with open(idx_path, "rb") as f:
        magic, version, code, sequences, boundaries = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron-LM index (magic {magic!r})")
    if version != VERSION:
        raise ValueError(f"{idx_path}: Megatron-LM index version {version}; this reader knows version {VERSION}")
    if code not in DTYPES:
        what = f"{FLOAT_CODES[code]}, not token ids" if code in FLOAT_CODES else "unknown"
        raise ValueError(f"{idx_path}: Megatron-LM dtype code {code} ({what})")
    if boundaries < 1:
        raise ValueError(f"{idx_path}: a Megatron-LM index with no document boundary (not even the first): damaged")
    dtype = np.dtype(DTYPES[code])
    index = MegatronIndex(idx_path, dtype, sequences, boundaries - 1, 0)
    expected = index.boundaries_at + 8 * boundaries
    if size == expected + sequences and sequences:
        raise ValueError(f"{idx_path} holds sequence modes (a multimodal Megatron-LM dataset): only token datasets "
                         "are read")  # fmt: skip
    if size != expected:
        raise ValueError(f"{idx_path} has {size} bytes, its header ({sequences} sequences, {boundaries - 1} "
                         f"documents) implies {expected}: truncated or damaged")  # fmt: skip
    first_last = index.boundaries()[[0, -1]].tolist()
    if first_last != [0, sequences]:
        raise ValueError(f"{idx_path}: its document boundaries run from sequence {first_last[0]} to "
                         f"{first_last[1]}, not 0 to {sequences} (a document left without end_document?)")  # fmt: skip
    end = int(index.pointers()[-1]) + int(index.lengths()[-1]) * dtype.itemsize if sequences else 0
    if os.path.getsize(bin_path) != end:
        raise ValueError(f"{bin_path} has {os.path.getsize(bin_path)} bytes but its index's sequences end at byte "
                         f"{end}: truncated, or the index of another corpus")  # fmt: skip
    return dataclasses.replace(index, tokens=end // dtype.itemsize)


def megatron_header(index: MegatronIndex) -> dict:
    """The fields our reader takes from a header: no vocabulary, tokenizer or content fingerprint."""
    return {"format": "megatron", "dtype": index.dtype.name, "vocab_size": None, "tokenizer": None,
            "num_tokens": index.tokens, "num_docs": index.documents, "sequences": index.sequences}  # fmt: skip


def document_offsets(index: MegatronIndex) -> np.ndarray:
    """Each document's first token (D + 1 int64: the last is the token count), as our index holds them.
    Built in memory (8 bytes a sequence while it is built), so it is asked for only when documents are
    (data.reset_position_ids, data.document_mask, the checks before a run)."""
    starts = np.append(np.asarray(index.pointers()) // index.dtype.itemsize, index.tokens)
    return starts[np.asarray(index.boundaries())]


def check_sequences(index: MegatronIndex, chunk: int = 2**24) -> None:
    """Every sequence right after the one before it (the token stream is the whole .bin) and the document
    boundaries in order: ValueError otherwise. One pass over the index, in chunks."""
    itemsize, ends = index.dtype.itemsize, 0
    lengths, pointers = index.lengths(), index.pointers()
    for start in range(0, index.sequences, chunk):
        length = np.asarray(lengths[start : start + chunk], dtype=np.int64)
        expected = ends + np.concatenate([[0], np.cumsum(length[:-1])]) * itemsize
        if length.min() < 0 or not np.array_equal(np.asarray(pointers[start : start + chunk]), expected):
            raise ValueError(f"{index.path}: its sequences do not lie back to back in the .bin (a sequence pointer "
                             f"from sequence {start} on disagrees with the lengths before it)")  # fmt: skip
        ends = int(expected[-1]) + int(length[-1]) * itemsize
    boundaries = index.boundaries()
    for start in range(0, index.documents + 1, chunk):
        if np.any(np.diff(np.asarray(boundaries[max(start - 1, 0) : start + chunk])) < 0):
            raise ValueError(f"{index.path}: its document boundaries go backwards (from document {start} on)")
