"""On-disk token format in the spirit of Megatron's indexed dataset.

`PREFIX.bin` holds the token ids of all documents back to back (uint16, or uint32 for vocabularies over
65535); `PREFIX.idx` holds a magic string, a JSON header (dtype, vocab size, token and document counts,
tokenizer, and the content fingerprint a resume compares) and the int64 document start offsets. Instruction
data adds `PREFIX.mask`, one uint8 per token:
1 where the token is a target the loss counts (a response, its end-of-document), 0 where it is not (a
prompt); the header says so (`loss_mask`, and `longest_document`: a sample must hold a whole one, so that
none is all prompt). All are read through `numpy.memmap`, never loaded whole.
Writers go to temporary names and rename on close, so a crash never leaves a half-written dataset.
`PREFIX.tokenizer.json` is the tokenizer the dataset was prepared with (a copy of its tokenizer.json; the
byte-level one's own, data/tokenizer.py), its digest in the header: a copy that does not match (left by an
earlier preparation under the same prefix) is not this dataset's.
Megatron-LM's `MMIDIDX` datasets (data/megatron.py) are read by the same class, told apart by their magic.

The fingerprint is xxh3-128 over the digests of the document offsets, the tokens and the mask, hashed as
they are written: computed once, when the dataset is prepared, so that a resume can tell a dataset prepared
again (or edited and prepared again) with the same token and document counts from the one it trained on,
without reading the .bin at every start. Datasets written before it have none; a resume compares their
counts only, and says so.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from hpc_train.data import megatron
from hpc_train.data.batch import Batch, collate

MAGIC = b"HPCTIDX1"
TOKENIZER_SUFFIX = ".tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


class IndexedDatasetWriter:
    """Append documents, then `close()` to commit the .bin/.idx pair atomically."""

    def __init__(
        self,
        prefix: str | os.PathLike,
        vocab_size: int,
        tokenizer: str,
        loss_mask: bool = False,
        tokenizer_json: str | None = None,
    ):
        """`tokenizer`: its name in the header; `tokenizer_json`: its tokenizer.json, written beside the data."""
        self.prefix = str(prefix)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.tokenizer_json = tokenizer_json
        self.dtype = token_dtype(vocab_size)
        self.offsets = [0]
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = f"{self.prefix}.bin.tmp{os.getpid()}"
        self._bin = open(self._bin_tmp, "wb")
        self._mask_tmp = f"{self.prefix}.mask.tmp{os.getpid()}" if loss_mask else None
        self._mask = open(self._mask_tmp, "wb") if loss_mask else None
        self._bin_hash, self._mask_hash = xxhash.xxh3_128(), xxhash.xxh3_128()

    def add_document(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """`mask`: which tokens the loss counts (all of them when left out). The first document whose mask
        leaves a token out gives the dataset a loss mask (the documents before it count every token)."""
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) in document {len(self.offsets) - 1}")
        if self._mask is None and mask is not None and not mask.all():
            self._start_mask()
        raw = np.asarray(ids, dtype=self.dtype).tobytes()
        self._bin.write(raw)
        self._bin_hash.update(raw)
        if self._mask is not None:
            self._write_mask(np.ones(len(ids), np.uint8) if mask is None else mask.astype(np.uint8))
        self.offsets.append(self.offsets[-1] + len(ids))

    def _write_mask(self, mask: np.ndarray) -> None:
        raw = mask.tobytes()
        self._mask.write(raw)
        self._mask_hash.update(raw)

    def _start_mask(self, chunk: int = 1 << 24) -> None:
        """A loss mask from here on: every token written so far counts."""
        self._mask_tmp = f"{self.prefix}.mask.tmp{os.getpid()}"
        self._mask = open(self._mask_tmp, "wb")
        for start in range(0, self.offsets[-1], chunk):
            self._write_mask(np.ones(min(chunk, self.offsets[-1] - start), np.uint8))

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def abort(self) -> None:
        """Close and delete what was written: nothing of it is committed."""
        for f, path in ((self._bin, self._bin_tmp), (self._mask, self._mask_tmp)):
            if f is not None:
                f.close()
                Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        for f in filter(None, (self._bin, self._mask)):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        offsets = np.asarray(self.offsets, dtype=np.int64).tobytes()
        parts = [xxhash.xxh3_128_digest(offsets), self._bin_hash.digest()]
        parts += [self._mask_hash.digest()] if self._mask is not None else []
        fields = {
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "num_tokens": self.offsets[-1],
            "num_docs": len(self.offsets) - 1,
            "tokenizer": self.tokenizer,
            "fingerprint": "xxh3_128:" + xxhash.xxh3_128_hexdigest(b"".join(parts)),
        }
        if self._mask is not None:
            fields.update(loss_mask=True, longest_document=int(np.diff(self.offsets).max(initial=0)))
        if self.tokenizer_json is not None:
            fields["tokenizer_digest"] = tokenizer_digest(self.tokenizer_json.encode())
            replace_file(self.prefix + TOKENIZER_SUFFIX, self.tokenizer_json.encode())
        header = json.dumps(fields).encode()
        idx_tmp = f"{self.prefix}.idx.tmp{os.getpid()}"
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(b"\0" * (-f.tell() % 8))  # align the offsets for memmap
            f.write(offsets)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        if self._mask_tmp is not None:
            os.replace(self._mask_tmp, self.prefix + ".mask")
        os.replace(idx_tmp, self.prefix + ".idx")  # last: the index commits the dataset


def tokenizer_digest(data: bytes) -> str:
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """`path` holds `data`, written to a temporary name, synced and renamed: never half-written."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def recorded_tokenizer_file(prefix: str, header: dict) -> str | None:
    """PREFIX.tokenizer.json if it is the one the header records (its digest), else None."""
    path = prefix + TOKENIZER_SUFFIX
    digest = header.get("tokenizer_digest")
    if not digest or not os.path.isfile(path):
        return None
    return path if tokenizer_digest(Path(path).read_bytes()) == digest else None


def _read_header(idx_path: str) -> tuple[dict, int]:
    """The index's JSON header and where its offsets start; ValueError naming what is wrong."""
    with open(idx_path, "rb") as f:
        f.seek(len(MAGIC))
        raw = f.read(8)
        header_len = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < header_len < 2**20:
            raise ValueError(f"{idx_path} has a damaged header; re-run prepare-data")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{idx_path} has a damaged header; re-run prepare-data") from None
        offsets_at = f.tell() + (-f.tell() % 8)
    types = {"dtype": str, "vocab_size": int, "num_tokens": int, "num_docs": int}
    if not isinstance(header, dict) or any(not isinstance(header.get(k), t) for k, t in types.items()):
        raise ValueError(f"{idx_path}: header lacks dtype/vocab_size/num_tokens/num_docs; re-run prepare-data")
    if not isinstance(header.get("fingerprint", ""), str):
        raise ValueError(f"{idx_path}: header holds a fingerprint that is not a string; re-run prepare-data")
    if header["dtype"] not in ("uint16", "uint32") or header["vocab_size"] < 1 or header["num_docs"] < 0:
        raise ValueError(f"{idx_path}: header holds impossible values {header}; re-run prepare-data")
    expected = offsets_at + 8 * (header["num_docs"] + 1)
    if os.path.getsize(idx_path) != expected:
        raise ValueError(f"{idx_path} has {os.path.getsize(idx_path)} bytes, its header implies {expected}: truncated")
    return header, offsets_at


def read_index(prefix: str) -> tuple[dict, int, megatron.MegatronIndex | None]:
    """PREFIX.idx's header, where its document offsets start, and (a Megatron-LM index, told apart by its
    magic) the Megatron index itself; ValueError naming the file and what is wrong."""
    idx_path = prefix + ".idx"
    with open(idx_path, "rb") as f:
        magic = f.read(len(megatron.MAGIC))
    if magic.startswith(MAGIC):
        return *_read_header(idx_path), None
    if magic == megatron.MAGIC:
        index = megatron.read_megatron_index(idx_path, prefix + ".bin")
        return megatron.megatron_header(index), 0, index
    raise ValueError(f"{idx_path} is not an hpc_train index (bad magic), nor a Megatron-LM one (it starts "
                     f"{magic!r}); re-run prepare-data")  # fmt: skip


class IndexedDataset:  # a data.batch.Source
    """Fixed-length training samples over the token stream: sample i is tokens[i*s : i*s + s + 1],
    giving inputs x = [:-1] and next-token targets y = [1:]. Documents are separated by their EOD token."""

    def __init__(self, prefix: str | os.PathLike, seq_len: int):
        self.prefix = str(prefix)
        self.header, self._offsets_at, self.megatron = read_index(self.prefix)
        dtype = np.dtype(self.header["dtype"])
        size = os.path.getsize(self.prefix + ".bin")
        if size % dtype.itemsize or size == 0:
            raise ValueError(f"{self.prefix}.bin has {size} bytes, not a whole number of {dtype} tokens: damaged")
        self.tokens = np.memmap(self.prefix + ".bin", dtype=dtype, mode="r")
        if len(self.tokens) != self.header["num_tokens"]:
            raise ValueError(
                f"{self.prefix}.bin holds {len(self.tokens)} tokens but its index says {self.header['num_tokens']}: "
                "the dataset is truncated or from another run; re-run prepare-data"
            )
        self.vocab_size: int | None = self.header["vocab_size"]  # None: a Megatron-LM corpus (model.vocab_size)
        self.loss_mask = None
        if self.header.get("loss_mask"):
            self.loss_mask = np.memmap(self.prefix + ".mask", dtype=np.uint8, mode="r")
            if len(self.loss_mask) != len(self.tokens):
                raise ValueError(f"{self.prefix}.mask holds {len(self.loss_mask)} entries for {len(self.tokens)} "
                                 "tokens: damaged; re-run prepare-data")  # fmt: skip
            if self.header["longest_document"] > seq_len:
                raise ValueError(f"{self.prefix} holds an example of {self.header['longest_document']} tokens, longer "
                                 f"than a sample (model.seq_len={seq_len}): a sample could hold only its prompt; "
                                 f"raise model.seq_len or re-run prepare-data with --max-tokens {seq_len}")  # fmt: skip
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{self.prefix} has {len(self.tokens)} tokens, fewer than one sample of {seq_len + 1}")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Sample i's tokens, and the loss mask of its next-token labels (None without one)."""
        start = i * self.seq_len
        mask = None if self.loss_mask is None else self.loss_mask[start + 1 : start + self.seq_len + 1]
        return self.tokens[start : start + self.seq_len + 1], mask

    def samples(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [self.sample(i) for i in indices.tolist()]

    @functools.cached_property
    def doc_offsets(self) -> np.ndarray:
        """Each document's first token, and the token count last (D + 1 int64)."""
        if self.megatron is not None:
            return megatron.document_offsets(self.megatron)
        return np.memmap(self.prefix + ".idx", dtype=np.int64, mode="r", offset=self._offsets_at)

    def identity(self) -> dict[str, int | str]:
        """The token and document counts, and the content fingerprint where the header holds one."""
        counts: dict[str, int | str] = {"tokens": len(self.tokens), "documents": self.header["num_docs"]}
        return {**counts, "fingerprint": self.header["fingerprint"]} if "fingerprint" in self.header else counts

    def identity_notes(self) -> list[str]:
        """What the log says when the identity lacks a fingerprint: a resume compares the counts only."""
        if "fingerprint" in self.header:
            return []
        why = ("a Megatron-LM corpus, which records none (hashing its .bin at every start would be slow)"
               if self.megatron is not None else "prepared before datasets recorded one; prepare it again to "
               "record one")  # fmt: skip
        return [f"dataset {self.prefix} has no content fingerprint ({why}): a resume recognises it by its token "
                "and document counts only"]  # fmt: skip

    def documents(self, indices: np.ndarray) -> np.ndarray:
        """The document of each input token of each sample, counted from the one the sample starts in: a
        new one at each document offset inside the sample (two binary searches per sample)."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        first = np.searchsorted(self.doc_offsets, starts, side="right")
        last = np.searchsorted(self.doc_offsets, starts + self.seq_len - 1, side="right")
        out = np.empty((len(starts), self.seq_len), dtype=np.int64)
        position = np.arange(self.seq_len)
        for row, (start, lo, hi) in enumerate(zip(starts.tolist(), first.tolist(), last.tolist(), strict=True)):
            out[row] = np.searchsorted(np.asarray(self.doc_offsets[lo:hi]) - start, position, side="right")
        return out

    def batch(self, indices: np.ndarray) -> Batch:
        return collate(self, indices)


def check_token_ids(dataset: IndexedDataset, vocab_size: int, chunk: int = 2**26) -> None:
    """Every token id in [0, `vocab_size`) and the document offsets consistent (a Megatron-LM corpus: its
    sequences back to back too): ValueError otherwise. One pass over the file, in chunks (a few seconds per
    GB). A Megatron-LM corpus records no vocabulary: `vocab_size` is the model's, and the error names it."""
    if dataset.megatron is not None:
        megatron.check_sequences(dataset.megatron)
    offsets = dataset.doc_offsets
    if offsets[0] != 0 or offsets[-1] != len(dataset.tokens) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{dataset.prefix}.idx: document offsets do not cover the tokens; re-run prepare-data")
    signed = np.issubdtype(dataset.tokens.dtype, np.signedinteger)
    for start in range(0, len(dataset.tokens), chunk):
        part = dataset.tokens[start : start + chunk]
        if signed and (low := int(part.min())) < 0:
            raise ValueError(f"{dataset.prefix}.bin holds token id {low}: token ids are never negative (damaged?)")
        top = int(part.max())
        if top >= vocab_size and dataset.megatron is not None:
            raise ValueError(f"{dataset.prefix}.bin holds token id {top}, beyond model.vocab_size={vocab_size}: a "
                             "Megatron-LM corpus records no vocabulary, so the model's is used; set model.vocab_size "
                             f"to its tokenizer's (at least {top + 1})")  # fmt: skip
        if top >= vocab_size:
            raise ValueError(
                f"{dataset.prefix}.bin holds token id {top}, beyond the vocabulary of {vocab_size} "
                "(a dataset from another tokenizer?); re-run prepare-data with the model's tokenizer"
            )
