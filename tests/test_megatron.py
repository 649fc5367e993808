"""Megatron-LM's datasets read as they are: a corpus written by megatron-core's own IndexedDatasetBuilder
trains on the loss curve of our prepared copy of the same token ids, its blend string is data.sources' list
form, and bad files are refused naming the file and the problem."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_train.config import ConfigError
from hpc_train.data.blend import SOURCE_SHIFT
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import check_datasets, load_datasets
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL


def megatron_builder() -> type:
    """megatron-core's IndexedDatasetBuilder, its module imported alone: the package's __init__ imports most
    of megatron-core (seconds), while the dataset module needs only megatron.core.utils's log_single_rank
    (itself a heavy module), given here from megatron.core._rank_utils, where megatron-core defines it. The
    stand-in packages leave sys.modules afterwards."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core (the dev extra) is not installed")
    if "megatron.core" in sys.modules:  # imported in full already
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        return IndexedDatasetBuilder
    root = Path(importlib.util.find_spec("megatron").submodule_search_locations[0])
    try:
        for name in ("megatron", "megatron.core", "megatron.core.datasets"):
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
        from megatron.core._rank_utils import log_single_rank

        utils = sys.modules["megatron.core.utils"] = types.ModuleType("megatron.core.utils")
        utils.log_single_rank = log_single_rank
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        return IndexedDatasetBuilder
    finally:
        for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
            del sys.modules[name]


def write_megatron(prefix: Path, documents: list[np.ndarray], dtype: type = np.uint16) -> str:
    """The documents as Megatron-LM's preprocess_data.py writes them: every other one split in two sequences
    (its --split-sentences), the others one sequence each."""
    builder = megatron_builder()(str(prefix) + ".bin", dtype=dtype)
    for i, doc in enumerate(documents):
        if i % 2 and len(doc) > 1:
            builder.add_document(doc.astype(np.int64), [len(doc) // 2, len(doc) - len(doc) // 2])
        else:
            builder.add_item(torch.from_numpy(doc.astype(np.int64)))
            builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture(scope="module")
def megatron_corpus(tmp_path_factory, small_corpus) -> str:
    """The small corpus's training split, document by document, written by megatron-core."""
    ours = IndexedDataset(small_corpus, 32)
    documents = np.split(np.asarray(ours.tokens), ours.doc_offsets[1:-1])
    return write_megatron(tmp_path_factory.mktemp("megatron") / "megatron", documents)


def test_a_megatron_corpus_trains_on_the_loss_curve_of_our_copy(tmp_path, small_corpus, megatron_corpus, capfd):
    """The same tokens, the same documents (positions restart at each one: data.reset_position_ids), the
    same 20 losses; the dataset passes the checks before a run, and the log says it has no fingerprint."""
    ours, theirs = IndexedDataset(small_corpus, 32), IndexedDataset(megatron_corpus, 32)
    assert np.array_equal(theirs.tokens, ours.tokens) and np.array_equal(theirs.doc_offsets, ours.doc_offsets)
    assert theirs.identity() == {key: value for key, value in ours.identity().items() if key != "fingerprint"}
    assert theirs.vocab_size is None and theirs.loss_mask is None
    picks = np.arange(0, len(ours), 50)
    assert np.array_equal(theirs.documents(picks), ours.documents(picks))  # data.document_mask's documents
    checked = load_config(None, [*TINY_MODEL, f"data.train_path={megatron_corpus}"])
    check_datasets(checked.data, checked.model)  # its sequences back to back, its token ids in the vocabulary
    losses = {}
    for name, path in (("ours", small_corpus), ("megatron", megatron_corpus)):
        run = [f"data.train_path={path}", f"run_dir={tmp_path / name}", "train.steps=20", "train.micro_batch_size=2"]
        cfg = load_config(None, [*TINY_MODEL, *run, "data.reset_position_ids=true"])
        losses[name] = launch_local(run_training, 1, cfg).losses
    assert len(losses["ours"]) == 20 and losses["megatron"] == losses["ours"]
    out = capfd.readouterr().out
    assert f"dataset {megatron_corpus} has no content fingerprint (a Megatron-LM corpus" in out
    assert f"dataset {small_corpus} has no content fingerprint" not in out


def test_the_blend_string_is_the_list_form(tmp_path, small_corpus, megatron_corpus):
    """`data.sources='0.3 /a 0.7 /b'` (command line or YAML) loads as the list form; paths alone weigh the
    same; anything else is refused naming the key. A Megatron-LM corpus blends with ours."""
    listed = load_config(None, [*TINY_MODEL, f"data.sources=[{{path: {small_corpus}, weight: 0.3}}, "
                                             f"{{path: {megatron_corpus}, weight: 0.7}}]"])  # fmt: skip
    string = load_config(None, [*TINY_MODEL, f"data.sources=0.3 {small_corpus} 0.7 {megatron_corpus}"])
    (tmp_path / "run.yaml").write_text(f"data:\n  sources: '0.3 {small_corpus} 0.7 {megatron_corpus}'\n")
    assert string.data.sources == listed.data.sources == load_config(tmp_path / "run.yaml").data.sources
    equal = load_config(None, [f"data.sources={small_corpus} {megatron_corpus}"]).data.sources
    assert [(s.path, s.weight) for s in equal] == [(small_corpus, 1.0), (megatron_corpus, 1.0)]
    with pytest.raises(ConfigError, match=r"data.sources='0.3 /a 0.7' \(from command line\) is not a blend string"):
        load_config(None, ["data.sources=0.3 /a 0.7"])
    check_datasets(string.data, string.model)
    blend = load_datasets(string.data, string.model, progress=False)[0]
    assert blend.names == ["small", "megatron"] and blend.vocab_size == 257
    identity = blend.identity()["sources"]  # by name; only ours has a content fingerprint
    assert identity["small"]["fingerprint"].startswith("xxh3_128:") and "fingerprint" not in identity["megatron"]
    assert len(blend.batch(np.array([0, 1, 1 << SOURCE_SHIFT])).tokens) == 3


def test_bad_megatron_files_are_refused_naming_the_file(tmp_path, megatron_corpus):
    """An unknown magic, a truncated index or token file, and token ids beyond model.vocab_size (a Megatron-LM
    corpus records no vocabulary: the error names the key to set)."""
    idx = Path(megatron_corpus + ".idx").read_bytes()
    cases = {
        "magic": (b"NOTANIDX\x00" + idx[9:], None, "is not an hpc_train index (bad magic), nor a Megatron-LM one"),
        "short": (idx[:20], None, "has 20 bytes, fewer than a Megatron-LM index header's 34: truncated"),
        "cut": (idx[:-8], None, f"has {len(idx) - 8} bytes, its header "),
        "bin": (idx, 100, "bin has 100 bytes but its index's sequences end at byte"),
    }
    for name, (index, bin_size, message) in cases.items():
        shutil.copy(megatron_corpus + ".bin", tmp_path / f"{name}.bin")
        (tmp_path / f"{name}.idx").write_bytes(index)
        if bin_size is not None:
            with open(tmp_path / f"{name}.bin", "r+b") as f:
                f.truncate(bin_size)
        with pytest.raises(ValueError) as err:
            IndexedDataset(tmp_path / name, 32)
        assert str(tmp_path / name) in str(err.value) and message in str(err.value), name
    wide = write_megatron(tmp_path / "wide", [np.arange(300), np.arange(40)], dtype=np.int32)
    cfg = load_config(None, [*TINY_MODEL, f"data.train_path={wide}"])
    with pytest.raises(ConfigError, match=r"holds token id 299, beyond model.vocab_size=257: a Megatron-LM corpus "
                                          r"records no vocabulary.*set model.vocab_size to its tokenizer's \(at least "
                                          r"300\)"):  # fmt: skip
        check_datasets(cfg.data, cfg.model)
    wider = load_config(None, [*TINY_MODEL, f"data.train_path={wide}", "model.vocab_size=300"])
    check_datasets(wider.data, wider.model)
