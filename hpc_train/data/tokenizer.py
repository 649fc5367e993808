"""Tokenizers: byte-level by default (no files needed), or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, id 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eod_id: int | None = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError("a tokenizer.json needs the `tokenizers` package: pip install 'hpc_train[hf]'") from err
        self._tok = _HF.from_file(path)
        self.name = f"hf:{path}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = (self._tok.token_to_id(t) for t in EOD_CANDIDATES)
        self.eod_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` or the path of a Hugging Face tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
