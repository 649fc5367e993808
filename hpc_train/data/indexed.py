"""On-disk token format in the spirit of Megatron's indexed dataset.

`PREFIX.bin` holds the token ids of all documents back to back (uint16, or uint32 for vocabularies over
65535); `PREFIX.idx` holds a magic string, a JSON header (dtype, vocab size, token and document counts,
tokenizer) and the int64 document start offsets. Both are read through `numpy.memmap`, never loaded whole.
Writers go to temporary names and rename on close, so a crash never leaves a half-written dataset.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

MAGIC = b"HPCTIDX1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


class IndexedDatasetWriter:
    """Append documents, then `close()` to commit the .bin/.idx pair atomically."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, tokenizer: str):
        self.prefix = str(prefix)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.dtype = token_dtype(vocab_size)
        self.offsets = [0]
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = f"{self.prefix}.bin.tmp{os.getpid()}"
        self._bin = open(self._bin_tmp, "wb")

    def add_document(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) in document {len(self.offsets) - 1}")
        self._bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.offsets.append(self.offsets[-1] + len(ids))

    def close(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        header = json.dumps(
            {
                "dtype": self.dtype.name,
                "vocab_size": self.vocab_size,
                "num_tokens": self.offsets[-1],
                "num_docs": len(self.offsets) - 1,
                "tokenizer": self.tokenizer,
            }
        ).encode()
        idx_tmp = f"{self.prefix}.idx.tmp{os.getpid()}"
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(b"\0" * (-f.tell() % 8))  # align the offsets for memmap
            f.write(np.asarray(self.offsets, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")


class IndexedDataset:
    """Fixed-length training samples over the token stream: sample i is tokens[i*s : i*s + s + 1],
    giving inputs x = [:-1] and next-token targets y = [1:]. Documents are separated by their EOD token."""

    def __init__(self, prefix: str | os.PathLike, seq_len: int):
        self.prefix = str(prefix)
        with open(self.prefix + ".idx", "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{self.prefix}.idx is not an hpc_train index (bad magic); re-run prepare-data")
            (header_len,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(header_len))
            offsets_at = f.tell() + (-f.tell() % 8)
        self.doc_offsets = np.memmap(self.prefix + ".idx", dtype=np.int64, mode="r", offset=offsets_at)
        self.tokens = np.memmap(self.prefix + ".bin", dtype=np.dtype(self.header["dtype"]), mode="r")
        if len(self.tokens) != self.header["num_tokens"]:
            raise ValueError(
                f"{self.prefix}.bin holds {len(self.tokens)} tokens but its index says {self.header['num_tokens']}: "
                "the dataset is truncated or from another run; re-run prepare-data"
            )
        self.vocab_size: int = self.header["vocab_size"]
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{self.prefix} has {len(self.tokens)} tokens, fewer than one sample of {seq_len + 1}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([self[int(i)] for i in indices]).astype(np.int64))
        return rows[:, :-1], rows[:, 1:]
