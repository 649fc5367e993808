"""Tokenizers: byte-level by default (no files needed), or a Hugging Face `tokenizer.json`.

The byte-level tokenizer also has a `tokenizer.json` of its own (`BYTE_JSON`: each byte its own token, as
GPT-2's byte-level alphabet spells it, and `<|endoftext|>` as id 256), written here without the `tokenizers`
package: a dataset and a run record it like any other, `build_tokenizer` knows it by its text, and an export
hands it to `transformers`, which then encodes text to the ids training saw."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
TOKENIZER_FILE = "tokenizer.json"  # what a run directory and a Hugging Face folder hold
BYTE_EOD = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int | None
    eod_token: str | None

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, id 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eod_id: int | None = 256
    eod_token: str | None = BYTE_EOD

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
        self.eod_token = next((t for t in EOD_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        self.eod_id = None if self.eod_token is None else self._tok.token_to_id(self.eod_token)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _byte_json() -> str:
    """The byte-level tokenizer as a Hugging Face tokenizer.json: byte b is GPT-2's printable stand-in for it
    (its `bytes_to_unicode`, which the ByteLevel pre-tokenizer and decoder apply), with id b; no merges."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    eod = {"id": 256, "content": BYTE_EOD, "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}  # fmt: skip
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [eod],
                       "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                                 "vocab": {char[b]: b for b in range(256)}, "merges": []}}, indent=1)  # fmt: skip


BYTE_JSON = _byte_json()


def is_byte_json(path: str | os.PathLike) -> bool:
    """The file is `BYTE_JSON` (as recorded beside a dataset or in a run directory)."""
    path = Path(path)
    return path.stat().st_size == len(BYTE_JSON.encode()) and path.read_text() == BYTE_JSON


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte`, or the path of a Hugging Face tokenizer.json (`BYTE_JSON`'s file: the byte-level tokenizer)."""
    return ByteTokenizer() if spec == "byte" or is_byte_json(spec) else HFTokenizer(spec)


def tokenizer_json(spec: str) -> str:
    """The text of the tokenizer.json of `build_tokenizer(spec)`."""
    return BYTE_JSON if spec == "byte" else Path(spec).read_text()


def special_tokens(spec: str) -> dict[str, tuple[str, int]]:
    """`bos` and `eos` of a tokenizer as (token, id), which an export writes: eos is its end-of-document token;
    bos is the special token its post-processor puts before a text (Llama's `<s>`), else the end-of-document
    token too (GPT-2's convention), since packed data puts one before every document but the first. ValueError
    for a tokenizer without an end-of-document token."""
    tok = build_tokenizer(spec)
    if tok.eod_id is None:
        raise ValueError(f"{spec} has no end-of-document token (none of {', '.join(EOD_CANDIDATES)})")
    eos = (tok.eod_token, tok.eod_id)
    processors = [json.loads(tokenizer_json(spec)).get("post_processor") or {}]
    processors += processors[0].get("processors") or []  # a Sequence's (Llama 3: ByteLevel, then the template)
    for processor in processors:
        first = (processor.get("single") or [{}])[0] if processor.get("type") == "TemplateProcessing" else {}
        if "SpecialToken" in first:
            token = first["SpecialToken"]["id"]
            return {"bos": (token, processor["special_tokens"][token]["ids"][0]), "eos": eos}
    return {"bos": eos, "eos": eos}


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
