"""Hugging Face folders (what `save_pretrained` writes: config.json and safetensors, one file or sharded
with an index) read lazily, tensor by tensor, and written so that `AutoModelForCausalLM.from_pretrained`
loads them. Only safetensors are read: a pickled pytorch_model.bin could run code."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.data.tokenizer import build_tokenizer, special_tokens, tokenizer_json
from hpc_train.models import hf_adapter_reading
from hpc_train.models.common.hf import HFAdapter, export_state, model_fields

CONFIG, INDEX, WEIGHTS = "config.json", "model.safetensors.index.json", "model.safetensors"


def require_module(module: str) -> Any:
    """An optional dependency of Hugging Face interop, or an error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"Hugging Face interop needs {module.split('.')[0]}: pip install 'hpc_train[finetune]'"
        ) from None


def is_hf_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG).is_file()


class HFFolder:
    """A Hugging Face model folder: its config, the adapter of the class that wrote it, its tensors' shapes,
    and each tensor read on demand."""

    def __init__(self, path: str | os.PathLike):
        safe_open = require_module("safetensors").safe_open
        self.path = Path(path)
        if not is_hf_folder(self.path):
            raise ConfigError(f"'{self.path}' is not a Hugging Face model folder (no {CONFIG})")
        self.config = json.loads((self.path / CONFIG).read_text())
        self.adapter = hf_adapter_reading(self.config)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / WEIGHTS).is_file():
            files = [WEIGHTS]
        else:
            raise ConfigError(f"'{self.path}' holds no {WEIGHTS} (nor {INDEX}); hpc_train reads safetensors only: "
                              "re-save the model with save_pretrained(..., safe_serialization=True)")  # fmt: skip
        self.handles, self.file_of, self.shapes, self._last = [], {}, {}, None
        for file in files:
            if not (self.path / file).is_file():
                raise ConfigError(f"'{self.path / file}', listed in {INDEX}, does not exist")
            handle = safe_open(str(self.path / file), framework="pt")
            self.handles.append(handle)
            names = handle.keys()  # a safetensors handle is not iterable
            for name in names:
                self.file_of[name] = handle
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())

    def model_fields(self) -> dict[str, Any]:
        return model_fields(self.adapter, self.config)

    def read(self, name: str) -> torch.Tensor:
        """The last tensor read is kept: GPT-2's fused q, k, v is asked for three times in a row."""
        if self._last is None or self._last[0] != name:
            self._last = (name, self.file_of[name].get_tensor(name))
        return self._last[1]


def save_hf(
    out: str | os.PathLike,
    adapter: HFAdapter,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: str | None = None,
) -> Path:
    """Whole, unpadded hpc_train tensors -> a Hugging Face folder at `out` through `adapter`, written beside it
    and renamed into place (an existing `out` is replaced only once the new one is complete). `tokenizer` (as
    data/tokenizer.py's `build_tokenizer` takes it): its files too (`save_tokenizer`), and its bos and eos ids
    in config.json and generation_config.json."""
    transformers, save_file = require_module("transformers"), require_module("safetensors.torch").save_file
    tensors = export_state(adapter, cfg, state)  # refuses what the HF class cannot express
    special = check_tokenizer(tokenizer, cfg.vocab_size) if tokenizer else None
    ids = {f"{name}_token_id": special[name][1] for name in ("bos", "eos")} if special else {}
    config = transformers.AutoConfig.for_model(adapter.model_type, **{**adapter.to_hf_config(cfg), **ids})
    config.architectures = [adapter.architecture]
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    with written_into(out) as tmp:
        config.save_pretrained(tmp)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer:
            transformers.GenerationConfig(**ids).save_pretrained(tmp)
            save_tokenizer(tmp, tokenizer, special, cfg.context_len)
    return Path(out)


def check_tokenizer(tokenizer: str, vocab_size: int) -> dict[str, tuple[str, int]]:
    """The tokenizer's bos and eos (token, id), once it is known to fit a model of `vocab_size` and to end
    documents."""
    tok = build_tokenizer(tokenizer)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens, more than the model's vocabulary "
                          f"({vocab_size}): it is not the tokenizer this model was trained with")  # fmt: skip
    try:
        return special_tokens(tokenizer)
    except ValueError as err:
        raise ConfigError(f"tokenizer {err}: an export names its end-of-document token as eos") from None


def save_tokenizer(
    folder: str | os.PathLike, tokenizer: str, special: dict[str, tuple[str, int]], context: int
) -> None:
    """What `transformers.AutoTokenizer.from_pretrained(folder)` loads (tokenizer.json, tokenizer_config.json),
    written by transformers' fast tokenizer over `tokenizer`'s tokenizer.json, with its bos and eos tokens
    (`special`, as `check_tokenizer` gives them) and `context` as its model_max_length."""
    transformers, tokenizers = require_module("transformers"), require_module("tokenizers")
    backend = tokenizers.Tokenizer.from_str(tokenizer_json(tokenizer))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special["bos"][0],
                                                eos_token=special["eos"][0], model_max_length=context)  # fmt: skip
    fast.save_pretrained(folder)


@contextmanager
def written_into(out: str | os.PathLike) -> Iterator[Path]:
    """A folder to write into beside `out`, renamed to `out` once the block has written all of it (an
    existing `out` is replaced only then)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
