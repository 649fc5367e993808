"""Text, JSON lines and parquet files -> indexed token datasets (tokenized in worker processes, streamed),
the checks of the datasets a run reads, and the embedded default corpus.

The embedded corpus is the running interpreter's own standard library (`.py` sources found through
`sysconfig`), tokenized byte-level: it needs no download and is the same on every machine with the same
Python. It is built once into a cache directory under a file lock, so concurrent ranks never race.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import math
import multiprocessing
import os
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hpc_train.config import BUILTIN_DATA, ConfigError, DataConfig, ModelConfig
from hpc_train.data.blend import BlendedSource
from hpc_train.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    check_token_ids,
    read_index,
    recorded_tokenizer_file,
    replace_file,
)
from hpc_train.data.readers import iter_documents
from hpc_train.data.tokenizer import (
    EOD_CANDIDATES,
    TOKENIZER_FILE,
    Encoded,
    Tokenizer,
    build_tokenizer,
    encode_documents,
    quiet_tokenizers,
    tokenizer_json,
)

VALID_SUFFIX = "_valid"


def expand_inputs(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise FileNotFoundError(f"input '{pattern}' matches no file")
        files.extend(Path(m) for m in matches if Path(m).is_file())
    return files


@dataclass
class Tokenized:
    """What a pass over input files saw: its documents, whether any held text, and how many were cut to
    --max-tokens. A preparation spread over nodes (launch/prepare_array.py) sums its parts' to decide what
    one pass over all the files would have."""

    documents: int = 0
    text: bool = False
    cut: int = 0


def output_prefix(output: str) -> str:
    """The dataset prefix `--output` names: a file's name given for it (.bin, .idx) loses its suffix."""
    return output[:-4] if output.endswith((".bin", ".idx")) else output


def split_of(document: int, valid_every: int) -> str:
    """The split the `document`-th document of the corpus (counted from 0) goes to."""
    return "valid" if valid_every and document % valid_every == valid_every - 1 else "train"


def check_options(tokenizer: str, valid_every: int, max_tokens: int | None, workers: int) -> Tokenizer:
    """The options' refusals, before any file is read (and, --slurm, before anything is submitted); returns the
    tokenizer built."""
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens {max_tokens} must be at least 1 (use model.seq_len)")
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be at least 1")
    if valid_every < 0:
        raise ConfigError(f"--valid-every {valid_every} holds out none; use a value between 2 and the number of "
                          "documents, or 0 for no held-out split")  # fmt: skip
    tok = build_tokenizer(tokenizer)
    if tok.eod_id is None:
        raise ConfigError(f"--tokenizer {tokenizer} has no end-of-document token (none of {', '.join(EOD_CANDIDATES)})"
                          ", so its documents would run together: add one to it as a special token "
                          "(tokenizer.add_special_tokens(['</s>']), then save) and prepare the data again")  # fmt: skip
    return tok


def check_prepared(seen: Tokenized, files: int, valid_every: int, held_out: int) -> None:
    """After the last document, before anything is committed: the corpus held text, and --valid-every held
    some of it out (`held_out` documents). The whole corpus's figures: a part of it may hold neither."""
    if not seen.text:
        raise ConfigError(f"the {files} input file(s) hold no text: nothing to tokenize")
    if valid_every and not held_out:
        raise ConfigError(f"--valid-every {valid_every} with {seen.documents} document(s) holds out none; use "
                          "a value between 2 and the number of documents, or 0 for no held-out split")  # fmt: skip


def open_writers(output: str, tok: Tokenizer, tokenizer: str, valid_every: int) -> dict[str, IndexedDatasetWriter]:
    """The writers of the dataset's splits (`valid` with --valid-every), recording `tokenizer`'s tokenizer.json;
    `tok` is it built."""
    text = tokenizer_json(tokenizer)
    writers = {"train": IndexedDatasetWriter(output, tok.vocab_size, tok.name, tokenizer_json=text)}
    if valid_every:
        writers["valid"] = IndexedDatasetWriter(output + VALID_SUFFIX, tok.vocab_size, tok.name, tokenizer_json=text)
    return writers


@contextmanager
def committed(writers: dict[str, IndexedDatasetWriter]) -> Iterator[None]:
    """Every split committed when the block ends, or (on any error, ^C included) none: each writer aborted."""
    try:
        yield
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.close()


def note_cut(seen: Tokenized, max_tokens: int | None) -> None:
    if seen.cut:
        print(f"{seen.cut} example(s) longer than {max_tokens} tokens kept their last {max_tokens}")


def prepare_data(
    files: list[Path],
    output: str,
    tokenizer: str = "byte",
    valid_every: int = 0,
    progress: bool = True,
    max_tokens: int | None = None,
    workers: int = 1,
    text_key: str = "text",
) -> dict[str, str]:
    """Tokenize the documents of `files` (data/readers.py: parquet and JSON lines by record, other files whole)
    into OUTPUT.bin/.idx, streamed: `workers` processes tokenize batches of documents while this one writes
    them in order, so memory stays flat as the corpus grows. Instruction examples give the dataset a .mask
    (only response tokens count in the loss). With `valid_every=N`, every N-th document goes to the held-out
    OUTPUT_valid instead. `max_tokens`: longer documents keep their last `max_tokens` tokens (an example's
    response and its end). Each prefix records the tokenizer (PREFIX.tokenizer.json), which must have an
    end-of-document token. An `output` ending in .bin or .idx names the prefix before it. Returns the
    prefixes written."""
    tok = check_options(tokenizer, valid_every, max_tokens, workers)
    writers = open_writers(output_prefix(output), tok, tokenizer, valid_every)
    with committed(writers):
        seen = tokenize_into(writers, files, tokenizer, valid_every, progress, max_tokens, workers, text_key)
        check_prepared(seen, len(files), valid_every, writers["valid"].num_docs if valid_every else 0)
    if progress:
        note_cut(seen, max_tokens)
    return {split: writer.prefix for split, writer in writers.items()}


def tokenize_into(
    writers: dict[str, IndexedDatasetWriter],
    files: list[Path],
    tokenizer: str,
    valid_every: int,
    progress: bool,
    max_tokens: int | None,
    workers: int,
    text_key: str,
) -> Tokenized:
    """Every document of `files`, in order, tokenized into its split's writer (nothing committed: the caller
    decides); returns what was seen."""
    seen = Tokenized()

    def batches() -> Iterator[list[tuple[str | None, str]]]:
        for path in files:
            for batch in iter_documents(path, text_key):
                seen.text = seen.text or any(prompt or text for prompt, text in batch)
                yield batch

    bar = None  # shown from the first batch on: input refused at once prints its error alone
    for encoded in encoded_batches(batches(), tokenizer, max_tokens, workers):
        if bar is None:
            bar = tqdm(desc="tokenizing", unit="doc", disable=not progress, delay=1)  # a quick run: none
        ends = np.cumsum(encoded.lengths)
        for end, length, n_prompt in zip(ends, encoded.lengths, encoded.prompt_lengths, strict=True):
            split = split_of(seen.documents, valid_every)
            seen.documents += 1
            mask = np.arange(length) >= n_prompt if n_prompt else None
            writers[split].add_document(encoded.ids[end - length : end], mask)
        seen.cut += encoded.cut
        bar.update(len(encoded.lengths))
    if bar is not None:
        bar.close()
    return seen


def encoded_batches(
    batches: Iterator[list[tuple[str | None, str]]], tokenizer: str, max_tokens: int | None, workers: int
) -> Iterator[Encoded]:
    """The batches tokenized, in order: here, or by `workers` processes with at most two batches each in
    flight (a pool's imap would read the whole corpus ahead). The workers import data/tokenizer.py alone
    (not torch)."""
    if workers == 1:
        for batch in batches:
            yield encode_documents(tokenizer, batch, max_tokens)
        return
    pending: deque = deque()
    with multiprocessing.get_context("spawn").Pool(workers, initializer=quiet_tokenizers) as pool:
        for batch in batches:
            pending.append(pool.apply_async(encode_documents, (tokenizer, batch, max_tokens)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def dataset_tokenizer(prefix: str) -> str | None:
    """The tokenizer a dataset was prepared with, as `build_tokenizer` takes it: its PREFIX.tokenizer.json,
    or "byte" for the embedded corpus and a byte-level dataset prepared before datasets recorded theirs; None
    when it records none (a Megatron-LM corpus, an older dataset of a tokenizer.json) or cannot be read."""
    if prefix == BUILTIN_DATA:
        return "byte"
    try:
        header = read_index(prefix)[0]
    except (OSError, ValueError):
        return None
    return recorded_tokenizer_file(prefix, header) or ("byte" if header.get("tokenizer") == "byte" else None)


def record_run_tokenizer(train_set: IndexedDataset | BlendedSource, run_dir: str | os.PathLike) -> Path | None:
    """RUN_DIR/tokenizer.json: the tokenizer the run's training data was prepared with (a blend's: its first
    source's that records one), written atomically, so that `generate` and `export-hf` find it in the run
    when the data has moved. Rank 0 calls it at the run's start; a dataset recording none leaves the file as
    it is. Returns the path written, if any."""
    for dataset in getattr(train_set, "datasets", [train_set]):
        spec = dataset_tokenizer(dataset.prefix)
        if spec is not None:
            path = Path(run_dir) / TOKENIZER_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(path, tokenizer_json(spec).encode())
            return path
    return None


def data_keys(cfg: DataConfig) -> list[tuple[str, str | None]]:
    """(config key, dataset prefix) of every dataset the run reads."""
    train = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.sources)] or [("data.train_path",
                                                                                          cfg.train_path)]  # fmt: skip
    valid = [(f"data.valid_sources[{i}].path", s.path) for i, s in enumerate(cfg.valid_sources)]
    return [*train, ("data.valid_path", cfg.valid_path), *valid]


def check_datasets(cfg: DataConfig, model: ModelConfig) -> dict[str, IndexedDataset]:
    """Before any rank starts: every dataset the run reads has a sound index, whole token file and token ids
    inside the model's vocabulary (the embedded corpus is built by this code and skipped); a blend's sources
    come from one tokenizer. Returns the datasets checked, by their config key."""
    seen: dict[str, IndexedDataset] = {}
    for key, prefix in data_keys(cfg):
        if prefix in (None, BUILTIN_DATA):
            continue
        try:
            dataset = IndexedDataset(prefix, model.seq_len)
        except ValueError as err:
            raise ConfigError(f"{key}={prefix!r}: {err}") from None
        check_vocabulary(dataset, model)
        try:
            check_token_ids(dataset, model.vocab_size if dataset.vocab_size is None else dataset.vocab_size)
        except ValueError as err:
            raise ConfigError(f"{key}={prefix!r}: {err}") from None
        seen[key] = dataset
    check_same_tokenizer(seen)
    return seen


def repeats(cfg: DataConfig, datasets: dict[str, IndexedDataset], samples: int, global_batch: int) -> list[str]:
    """A line for each training dataset a run of `samples` samples reads more than once (a blend's source: its
    weight's share of them), with the step it starts again at; datasets not checked (the embedded corpus)
    are left out."""
    weights = {f"data.sources[{i}].path": s.weight for i, s in enumerate(cfg.sources)} or {"data.train_path": 1.0}
    lines = []
    for key, weight in weights.items():
        if (dataset := datasets.get(key)) is None:
            continue
        share = samples * weight / sum(weights.values())
        if share > len(dataset):
            again = math.ceil(len(dataset) * sum(weights.values()) / weight / global_batch)
            lines.append(f"{key}={dataset.prefix}: the run reads {share:,.0f} of its {len(dataset):,} samples "
                         f"({share / len(dataset):.1f} epochs): they repeat from about step {again}")  # fmt: skip
    return lines


def check_same_tokenizer(datasets: dict[str, IndexedDataset]) -> None:
    """Datasets read by one run hold the same vocabulary size and token dtype (one tokenizer's). Megatron-LM
    corpora record no vocabulary and are left out (their token ids are checked against model.vocab_size)."""
    datasets = {key: ds for key, ds in datasets.items() if ds.vocab_size is not None}
    described = {key: (ds.vocab_size, ds.header["dtype"]) for key, ds in datasets.items()}
    if len(set(described.values())) > 1:
        listed = "; ".join(f"{key}: vocabulary {v} ({datasets[key].header.get('tokenizer')}), {d} tokens"
                           for key, (v, d) in described.items())  # fmt: skip
        raise ConfigError(f"the datasets of this run come from different tokenizers ({listed}): every source must be "
                          "prepared with one tokenizer; re-run prepare-data with the same --tokenizer")  # fmt: skip


def check_vocabulary(dataset: IndexedDataset | BlendedSource, model: ModelConfig) -> None:
    if dataset.vocab_size is not None and dataset.vocab_size > model.vocab_size:
        raise ConfigError(
            f"dataset {dataset.prefix} has vocabulary size {dataset.vocab_size} but model.vocab_size="
            f"{model.vocab_size}; set model.vocab_size={dataset.vocab_size}"
        )


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def builtin_corpus(cache_dir: str, progress: bool = True) -> tuple[str, str]:
    """(train prefix, valid prefix) of the embedded corpus, building it on first use."""
    files = stdlib_sources()
    digest = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(os.path.expanduser(cache_dir)) / f"stdlib-py{version}-{digest}"
    train, valid = str(base / "train"), str(base / "train") + VALID_SUFFIX
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (Path(valid + ".idx").is_file() and Path(train + ".idx").is_file()):
            prepare_data(files, train, "byte", valid_every=50, progress=progress)
    return train, valid


def dataset_prefixes(train_path: str, valid_path: str | None, cache_dir: str, progress: bool) -> tuple[str, str | None]:
    """Resolve `data.train_path` / `data.valid_path` to dataset prefixes, building the embedded corpus
    when it is asked for (its held-out split is the default validation set)."""
    if BUILTIN_DATA not in (train_path, valid_path):
        return train_path, valid_path
    builtin_train, builtin_valid = builtin_corpus(cache_dir, progress)
    train = builtin_train if train_path == BUILTIN_DATA else train_path
    if valid_path == BUILTIN_DATA or (valid_path is None and train_path == BUILTIN_DATA):
        return train, builtin_valid
    return train, valid_path


def load_datasets(
    cfg: DataConfig, model: ModelConfig, progress: bool
) -> tuple[IndexedDataset | BlendedSource, IndexedDataset | None]:
    """The training (one dataset, or the blend of data.sources) and (if any) held-out datasets, checked
    against the model's vocabulary."""
    if cfg.sources:
        train_set = BlendedSource({s.label: load_source(s.path, cfg, model, progress) for s in cfg.sources})
        valid_prefix = cfg.valid_path  # no default held-out set: data.valid_sources evaluate each source
        if valid_prefix == BUILTIN_DATA:
            valid_prefix = builtin_corpus(cfg.cache_dir, progress)[1]
    else:
        train_prefix, valid_prefix = dataset_prefixes(cfg.train_path, cfg.valid_path, cfg.cache_dir, progress)
        train_set = IndexedDataset(train_prefix, model.seq_len)
    valid_set = IndexedDataset(valid_prefix, model.seq_len) if valid_prefix else None
    for ds in filter(None, (train_set, valid_set)):
        check_vocabulary(ds, model)
    return train_set, valid_set


def load_source(path: str, cfg: DataConfig, model: ModelConfig, progress: bool) -> IndexedDataset:
    """One dataset of data.sources / data.valid_sources ("stdlib": the embedded corpus's training split)."""
    prefix = builtin_corpus(cfg.cache_dir, progress)[0] if path == BUILTIN_DATA else path
    dataset = IndexedDataset(prefix, model.seq_len)
    check_vocabulary(dataset, model)
    return dataset


def load_valid_sources(cfg: DataConfig, model: ModelConfig, progress: bool) -> dict[str, IndexedDataset]:
    """data.valid_sources by name, each evaluated alone."""
    return {s.label: load_source(s.path, cfg, model, progress) for s in cfg.valid_sources}
