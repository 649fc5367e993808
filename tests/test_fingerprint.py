"""A dataset's content fingerprint: written once by prepare-data, recorded in each checkpoint's manifest, and
compared on resume, so that a dataset prepared again with the same token and document counts is refused;
datasets without one (earlier versions', Megatron-LM's) are compared by their counts, and the log says so."""

from __future__ import annotations

import pytest

from hpc_train.checkpoint.ownership import data_differences
from hpc_train.checkpoint.safe_load import CheckpointError
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import prepare_data
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.train.loop import run_training
from tests.conftest import ROOT, TINY_MODEL


def prepare(tmp_path, text: str) -> str:
    (tmp_path / "doc.txt").write_text(text)
    return prepare_data([tmp_path / "doc.txt"], str(tmp_path / "data"), "byte", progress=False)["train"]


def test_a_dataset_prepared_again_with_the_same_counts_is_refused_on_resume(tmp_path):
    """Train 2 steps and checkpoint; prepare the dataset again from other text of the same length (the same
    token and document counts): the resume is refused naming the dataset. The same text prepared again
    gives the same fingerprint."""
    prefix = prepare(tmp_path, "a" * 3000)
    first = IndexedDataset(prefix, 32).identity()
    run = [*TINY_MODEL, f"data.train_path={prefix}", f"run_dir={tmp_path / 'run'}", "checkpoint.interval=2"]
    launch_local(run_training, 1, load_config(None, [*run, "train.steps=2", "train.micro_batch_size=2"]))
    assert IndexedDataset(prepare(tmp_path, "a" * 3000), 32).identity() == first
    other = IndexedDataset(prepare(tmp_path, "b" * 3000), 32)
    with pytest.raises(CheckpointError) as err:
        launch_local(run_training, 1, load_config(None, [*run, "train.steps=4", "train.micro_batch_size=2"]))
    other = other.identity()
    assert {**other, "fingerprint": None} == {**first, "fingerprint": None} and other != first
    assert (f"training data: the same 3001 tokens and 1 document(s) but other content (fingerprint "
            f"{first['fingerprint']} in the checkpoint, {other['fingerprint']} here): prepared again or edited "
            f"since (data.train_path={prefix})") in str(err.value)  # fmt: skip


def test_without_a_fingerprint_on_either_side_the_counts_decide():
    """A blend's source compared by name, with its fingerprint; a checkpoint or a dataset from before
    fingerprints (the dataset of an earlier release's fixture has none) is compared by its counts, and the
    dataset's note says so."""
    old = {"tokens": 100, "documents": 3}
    new, edited = {**old, "fingerprint": "xxh3_128:aa"}, {**old, "fingerprint": "xxh3_128:bb"}
    assert data_differences({"sources": {"web": new}}, {"sources": {"web": edited}}) == [
        "training data source 'web': the same 100 tokens and 3 document(s) but other content (fingerprint "
        "xxh3_128:aa in the checkpoint, xxh3_128:bb here): prepared again or edited since (give a changed source "
        "another name)"
    ]
    assert data_differences(old, edited) == data_differences(new, old) == data_differences(new, new) == []
    assert data_differences(new, {**edited, "tokens": 101}) == [
        f"training data: {new} in the checkpoint, {{'tokens': 101, 'documents': 3, 'fingerprint': 'xxh3_128:bb'}} here"
    ]
    fixture = IndexedDataset(ROOT / "tests/fixtures/checkpoint_08c1275/data", 32)
    assert "fingerprint" not in fixture.identity()
    assert fixture.identity_notes() == [
        f"dataset {fixture.prefix} has no content fingerprint (prepared before datasets recorded one; prepare it "
        "again to record one): a resume recognises it by its token and document counts only"
    ]
