"""Tokenizers: byte-level by default (no files needed), or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, id 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eod_id: int | None = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` or the path of a Hugging Face tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


@functools.lru_cache(maxsize=2)
def cached_tokenizer(spec: str) -> Tokenizer:
    """One tokenizer per process and spec: a tokenizing worker builds it once, not per batch."""
    return build_tokenizer(spec)


@dataclass
class Encoded:
    """A batch of documents tokenized: their ids back to back, each one's length and its prompt's."""

    ids: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    cut: int  # documents cut to max_tokens


def encode_documents(spec: str, documents: list[tuple[str | None, str]], max_tokens: int | None) -> Encoded:
    """Tokenize (prompt, text) documents, each followed by the end-of-document id; a document longer than
    `max_tokens` keeps its last `max_tokens` tokens (an example's response and its end). Runs in workers."""
    tok = cached_tokenizer(spec)
    prompts = tok.encode_batch([p or "" for p, _ in documents])
    texts = tok.encode_batch([t for _, t in documents])
    eod = np.zeros(0, np.int64) if tok.eod_id is None else np.array([tok.eod_id], np.int64)
    ids, lengths, prompt_lengths, cut = [], [], [], 0
    for prompt, text in zip(prompts, texts, strict=True):
        doc, n_prompt = np.concatenate([prompt, text, eod]), len(prompt)
        if max_tokens is not None and len(doc) > max_tokens:
            doc, n_prompt, cut = doc[-max_tokens:], max(0, n_prompt - (len(doc) - max_tokens)), cut + 1
        ids.append(doc)
        lengths.append(len(doc))
        prompt_lengths.append(n_prompt)
    return Encoded(np.concatenate(ids) if ids else np.zeros(0, np.int64), np.array(lengths, np.int64),
                   np.array(prompt_lengths, np.int64), cut)  # fmt: skip


def quiet_tokenizers() -> None:
    """A worker process tokenizes on its one thread (the processes are the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
