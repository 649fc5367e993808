"""Shared fixtures: a small tokenized corpus and tiny-model configs."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.job import JobConfig, load_config

ROOT = Path(__file__).resolve().parents[1]

TINY_MODEL = [
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_model=64",
    "model.seq_len=32",
    "train.eval_interval=0",
    "logging.progress=none",
    "optim.warmup_steps=2",
]


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, the code under test) is never garbage: frozen, the collection each
    in-process run makes at its end (bootstrap.distributed) skips it, as in the launcher's rank processes."""
    gc.freeze()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """About 40 standard-library files, byte-level: enough samples for every test, built in well under 1 s."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "small")
    prepare_data(stdlib_sources()[:40], prefix, "byte", valid_every=10, progress=False)
    return prefix


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory) -> str:
    """Lines of standard-library files as JSON-lines documents (about 30 bytes each): most samples of a tiny
    model hold several documents (data.reset_position_ids / data.document_mask)."""
    base = tmp_path_factory.mktemp("short_documents")
    lines = [line for path in stdlib_sources()[:4] for line in path.read_text().splitlines() if line.strip()]
    (base / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:3000]))
    return prepare_data([base / "lines.jsonl"], str(base / "lines"), "byte", progress=False)["train"]


@pytest.fixture
def make_cfg(tmp_path, small_corpus):
    def make(*overrides: str, run: str = "run") -> JobConfig:
        base = [*TINY_MODEL, f"data.train_path={small_corpus}", f"run_dir={tmp_path / run}"]
        return load_config(None, base + list(overrides))

    return make


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_final_model(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model_final.pt", weights_only=True)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
