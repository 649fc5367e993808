"""Weighted blends of datasets (data.sources): the mixture's exactness, the same global order in every
layout, exact resume after a kill, a new phase of the mix without repeats, per-source evaluation and
token counts, and bad sources refused before any rank starts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hpc_train.config import ConfigError
from hpc_train.data.blend import BlendedSampler, BlendedSource, next_sources, normalised, share_bound
from hpc_train.data.indexed import IndexedDataset, IndexedDatasetWriter
from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local, launch_sequence
from hpc_train.train.loop import run_training
from tests.conftest import TINY_MODEL, read_metrics, run_cli


def test_realised_shares_stay_within_the_stated_bound():
    """After every n samples each source's count is within (1 + K w_s) / 2 of w_s n, however the stream is
    cut into global batches; Megatron-like exactness, not a random draw (whose error grows like sqrt(n))."""
    rng = np.random.default_rng(0)
    for k in (2, 3, 5):
        weights = normalised(rng.uniform(0.05, 1.0, k).tolist())
        picks = next_sources(np.zeros(k, np.int64), weights, 3000)
        counts = np.cumsum(picks[:, None] == np.arange(k)[None, :], axis=0)  # (n, k) after each sample
        n = np.arange(1, 3001)[:, None]
        assert (np.abs(counts - weights * n) <= (1 + k * weights) / 2 + 1e-9).all()
        assert (np.abs(counts / n - weights) <= share_bound(weights, 1) / n + 1e-12).all()
        batched, state = [], np.zeros(k, np.int64)
        for size in (7, 64, 1, 1000, 1928):  # cut into batches: the same stream
            part = next_sources(state, weights, size)
            state += np.bincount(part, minlength=k)
            batched.append(part)
        assert np.array_equal(np.concatenate(batched), picks)


def dataset(path, tokens: int, vocab: int = 257) -> IndexedDataset:
    w = IndexedDatasetWriter(path, vocab_size=vocab, tokenizer="test")
    w.add_document(np.arange(tokens) % vocab)
    w.close()
    return IndexedDataset(path, 4)


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> BlendedSource:
    base = tmp_path_factory.mktemp("blend")
    return BlendedSource({"web": dataset(base / "web", 4 * 500 + 1), "code": dataset(base / "code", 4 * 300 + 1),
                          "math": dataset(base / "math", 4 * 200 + 1)})  # fmt: skip


def stream(blend, weights, steps, dp=1, micro=2, state=None, notes=None) -> tuple[list[np.ndarray], dict]:
    """Global batches of 8 as the dp ranks read them (their slices put together), and the final state."""
    report = print if notes is None else notes.append  # rank 0's, as the builder gives it
    ranks = [BlendedSampler(blend, weights, 8, micro, r, dp, 3, report if r == 0 else print) for r in range(dp)]
    for r in ranks:
        if state is not None:
            r.load_state_dict(state)
    batches = [np.concatenate([np.concatenate(r.next_micro_batches()) for r in ranks]) for _ in range(steps)]
    return batches, ranks[0].state_dict()


def test_every_layout_reads_the_same_global_sequence_and_resumes_it(blend):
    """dp1 (micro-batches of 2 or 8), dp2 and dp4 read one global sequence: a tp2 x pp2 layout is dp1 with
    more micro-batches, so its sequence is dp1's; a sampler resumed from a state continues it exactly."""
    weights = [0.5, 0.3, 0.2]
    reference, _ = stream(blend, weights, 20)
    for dp, micro in ((1, 8), (2, 2), (2, 4), (4, 1)):
        batches, _ = stream(blend, weights, 20, dp, micro)
        assert all(np.array_equal(a, b) for a, b in zip(batches, reference, strict=True))
    _, state = stream(blend, weights, 7)
    for dp in (2, 8):
        resumed, _ = stream(blend, weights, 13, dp=dp, micro=8 // dp, state=state)
        assert all(np.array_equal(a, b) for a, b in zip(resumed, reference[7:], strict=True))
    # skipped ranges (data.skip_samples, spike rollbacks) are read past at any dp: the batches after them are
    # the same, and the range stays skipped after a resume
    skipping = [BlendedSampler(blend, weights, 8, 2, r, 2, 3, skipped=[[24, 40]]) for r in range(2)]
    batches = [np.concatenate([np.concatenate(r.next_micro_batches()) for r in skipping]) for _ in range(3)]
    later, _ = stream(blend, weights, 15, dp=4, state=skipping[0].state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(batches + later, reference[:3] + reference[5:], strict=True))
    assert skipping[0].describe(np.array([blend.offsets[1] + 5, 3, blend.offsets[1] + 2])) == {
        "code": [5, 2],
        "web": [3],
    }
    sources = np.array([blend.source_of(int(i)) for i in np.concatenate(reference)])
    assert np.bincount(sources).tolist() == [80, 48, 32]  # 160 samples at 0.5 / 0.3 / 0.2
    other_seed = BlendedSampler(blend, weights, 8, 8, 0, 1, seed=4).next_global_batch()
    assert not np.array_equal(other_seed, reference[0])


def test_a_new_mix_on_resume_repeats_no_sample(blend):
    """Changing the weights, then adding a source, at a resume: each source continues after the samples it
    already gave (no repeats before its epoch ends), the change is reported, the new shares hold within
    the bound from the phase's start."""
    notes: list[str] = []
    two = BlendedSource({"web": blend.datasets[0], "code": blend.datasets[1]})
    first, state = stream(two, [0.8, 0.2], 10)
    second, state = stream(two, [0.2, 0.8], 15, dp=2, state=state, notes=notes)
    assert "data mix changed at sample 80: weights web 0.8, code 0.2 -> web 0.2, code 0.8" in notes[0]
    third, state = stream(blend, [1, 1, 2], 20, state=state, notes=notes)
    assert "-> web 0.25, code 0.25, math 0.5" in notes[1]
    seen = {name: [] for name in blend.names}
    for batch, source in ((first, two), (second, two), (third, blend)):
        for i in np.concatenate(batch):
            s = source.source_of(int(i))
            seen[source.names[s]].append(int(i) - source.offsets[s])
    assert {n: len(v) for n, v in seen.items()} == {"web": 64 + 24 + 40, "code": 16 + 96 + 40, "math": 80}
    assert all(len(set(v)) == len(v) for v in seen.values())  # nothing read twice
    assert state["taken"] == {"web": 128, "code": 152, "math": 80}
    phase = next_sources(np.zeros(2, np.int64), normalised([0.2, 0.8]), 120)
    assert np.bincount(phase).tolist() == [24, 96]


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory, small_corpus) -> dict[str, str]:
    other = str(tmp_path_factory.mktemp("other") / "other")
    prepare_data(stdlib_sources()[40:60], other, "byte", valid_every=10, progress=False)
    return {"code": small_corpus, "other": other}


def blend_cfg(run_dir, corpora, weights, steps, *extra):
    sources = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(corpora.values(), weights, strict=True))
    names = [p.rsplit("/", 1)[-1] for p in corpora.values()]
    valid = ", ".join(f"{{path: {p}_valid, name: {n}}}" for p, n in zip(corpora.values(), names, strict=True))
    return load_config(None, [*TINY_MODEL, f"data.sources=[{sources}]", f"data.valid_sources=[{valid}]",
                              f"run_dir={run_dir}", f"train.steps={steps}", "train.micro_batch_size=2",
                              "parallel.nproc=2", "checkpoint.interval=2", "train.eval_interval=3",
                              *extra])  # fmt: skip


@pytest.fixture(scope="module")
def blend_runs(tmp_path_factory, two_corpora, monkeypatch_module):
    """dp2, 6 steps: uninterrupted and then resumed with new weights for 2 more; and killed (rank 1, step 5)
    and restarted in the job from its step-4 checkpoint."""
    base = tmp_path_factory.mktemp("blend_runs")
    full, killed = base / "full", base / "killed"
    launch_sequence(run_training, 2, [(blend_cfg(full, two_corpora, [3, 1], 6),),
                                      (blend_cfg(full, two_corpora, [1, 3], 8),)])  # fmt: skip
    monkeypatch_module.setenv("HPC_TRAIN_FAULT", "mid_step@5@1")
    launch_local(run_training, 2, blend_cfg(killed, two_corpora, [3, 1], 6, "parallel.max_restarts=1"), max_restarts=1)
    monkeypatch_module.delenv("HPC_TRAIN_FAULT")
    return {"full": read_metrics(full), "killed": read_metrics(killed), "killed_dir": killed, "full_dir": full}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_a_killed_blend_resumes_bit_exactly(blend_runs):
    full, killed = blend_runs["full"][:6], blend_runs["killed"]
    assert [m["step"] for m in killed] == [1, 2, 3, 4, 5, 6]
    assert [m["resumed_from"]["step"] for m in killed if "resumed_from" in m] == [4]
    assert [m["loss"] for m in killed] == [m["loss"] for m in full]
    assert [m.get("eval_loss/other") for m in killed] == [m.get("eval_loss/other") for m in full]
    manifest = json.loads((blend_runs["killed_dir"] / "checkpoints/step_0000006/manifest.json").read_text())
    assert manifest["data"]["sources"].keys() == {"small", "other"}  # each source's identity, by name
    assert manifest["data"]["sources"]["small"]["tokens"] > manifest["data"]["sources"]["other"]["tokens"] > 0


def test_shares_evaluation_and_a_new_phase_in_the_metrics(blend_runs):
    """Per-source token counts follow the weights (global batch 4 x 32 tokens: 3:1, then 1:3 from step 7),
    eval_loss/<name> for each of data.valid_sources with eval_loss their mean, and the new phase continues
    the same run (its first six steps are the uninterrupted run's)."""
    records = blend_runs["full"]
    assert [m["step"] for m in records] == list(range(1, 9))
    tokens = [(m["train_tokens/small"], m["train_tokens/other"]) for m in records]
    assert tokens[5] == (18 * 32, 6 * 32) and tokens[7] == (18 * 32 + 2 * 32, 6 * 32 + 6 * 32)
    assert all(a + b == 4 * 32 * m["step"] for (a, b), m in zip(tokens, records, strict=True))
    evals = [m for m in records if "eval_loss" in m]
    assert [m["step"] for m in evals] == [3, 6, 8]
    for m in evals:
        assert m["eval_loss"] == pytest.approx((m["eval_loss/small"] + m["eval_loss/other"]) / 2)
        assert m["eval_loss/small"] != m["eval_loss/other"]
    assert [m["resumed_from"]["step"] for m in records if "resumed_from" in m] == [6]


def test_plot_run_shows_per_source_curves(blend_runs, tmp_path):
    """plot_run draws each source's share of the training tokens and its eval loss."""
    import matplotlib.pyplot as plt

    from tools.plot_run import per_source, plot, read

    fig, (share_ax, loss_ax) = plt.subplots(1, 2)
    per_source(share_ax, loss_ax, {blend_runs["full_dir"]: read(blend_runs["full_dir"])})
    shares = {line.get_label(): line.get_ydata()[-1] for line in share_ax.lines}
    assert shares == {"full other": 12 / 32, "full small": 20 / 32}  # after step 8
    assert sorted(line.get_label() for line in loss_ax.lines) == ["full eval other", "full eval small"]
    plt.close(fig)
    png = plot([blend_runs["full_dir"]], tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_blend_resumes_at_another_dp_size_reading_the_same_samples(two_corpora, tmp_path):
    """A dp4 blend (global batch 8) saved at step 4 resumes at dp2 (train.grad_accum=2 keeps the global batch)
    and at dp8 (micro-batches of 1), each through `hpc-train train`: each reads on the samples the dp4 run
    read, none repeated, none skipped (each source's tokens and the samples consumed agree at every step; the
    losses, the same global batch's mean summed in another order, within 1e-5), and records where it resumed."""
    sources = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(two_corpora.values(), (3, 1), strict=True))
    common = [*TINY_MODEL, f"data.sources=[{sources}]", "train.steps=6", "checkpoint.interval=4"]
    layouts = {"dp4": ["parallel.nproc=4", "train.micro_batch_size=2"],
               "dp2": ["parallel.nproc=2", "train.micro_batch_size=2", "train.grad_accum=2"],
               "dp8": ["parallel.nproc=8", "train.micro_batch_size=1"]}  # fmt: skip
    run_cli("train", *common, *layouts["dp4"], f"run_dir={tmp_path / 'dp4'}")
    full = read_metrics(tmp_path / "dp4")
    for name in ("dp2", "dp8"):
        shutil.copytree(tmp_path / "dp4/checkpoints/step_0000004", tmp_path / name / "checkpoints/step_0000004")
        run_cli("train", *common, *layouts[name], f"run_dir={tmp_path / name}")
        records = read_metrics(tmp_path / name)
        assert [r["step"] for r in records] == [5, 6]
        resumed = records[0]["resumed_from"]
        assert (resumed["step"], resumed["layout"]["dp"], resumed["consumed_samples"]) == (4, 4, 32)
        assert resumed["skipped_samples"] == []
        for r, ref in zip(records, full[4:], strict=True):
            counts = ("consumed_samples", "train_tokens/small", "train_tokens/other")
            assert [r[k] for k in counts] == [ref[k] for k in counts]
            assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)


BAD_SOURCES = [
    ("{path: /nonexistent/x, weight: 1}", "data.sources[0].path='/nonexistent/x': '/nonexistent/x.bin' does not"),
    ("{path: CORPUS, weight: 0}", "data.sources[0].weight=0.0 must be a finite number > 0"),
    ("{path: CORPUS, weight: -2}", "data.sources[0].weight=-2.0 must be a finite number > 0"),
    ("{path: CORPUS, weight: .nan}", "data.sources[0].weight=nan must be a finite number > 0"),
    ("{path: CORPUS, weight: .inf}", "data.sources[0].weight=inf must be a finite number > 0"),
    ("{path: CORPUS, weight: abc}", "invalid config key 'weight' of a list's element (from command line): Value 'abc'"),
    ("{path: CORPUS}, {path: CORPUS}", "data.sources name small more than once"),
    ("{path: TINY}", "data.sources[0].path='TINY': TINY has 20 tokens, fewer than one sample of 33"),
    ("{path: CORPUS}, {path: WIDE}", "come from different tokenizers (data.sources[0].path: vocabulary 257"),
]


@pytest.mark.parametrize(
    "sources, message",
    BAD_SOURCES,
    ids=["missing", "zero", "negative", "nan", "inf", "not_a_number", "twice", "too_small", "two_tokenizers"],
)
def test_bad_sources_are_refused_before_any_rank_starts(tmp_path, small_corpus, sources, message):
    """What `hpc-train train` checks before it starts a process (cli.check_inputs): a missing source, a weight
    <= 0 or non-finite, a name given twice, a source smaller than one sample, sources of two tokenizers."""
    from hpc_train.cli import check_inputs

    dataset(tmp_path / "tiny", 20)
    dataset(tmp_path / "wide", 4 * 100, vocab=70000)
    paths = {"CORPUS": small_corpus, "TINY": str(tmp_path / "tiny"), "WIDE": str(tmp_path / "wide")}
    for key, path in paths.items():
        sources, message = sources.replace(key, path), message.replace(key, path)
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, [*TINY_MODEL, f"data.sources=[{sources}]", f"run_dir={tmp_path / 'run'}",
                                 "model.vocab_size=70000"])  # fmt: skip
        check_inputs(cfg, 1, starts_here=True)
    assert message in str(err.value)


def test_a_source_changed_under_its_name_is_refused():
    """The manifest's data identity, per source: sources on both sides must match by name; an added or a left
    out source is a new phase; one dataset (data.train_path) and a blend are different data."""
    from hpc_train.checkpoint.ownership import data_differences

    web, code = {"tokens": 100, "documents": 3}, {"tokens": 50, "documents": 2}
    saved = {"sources": {"web": web, "code": code}}
    assert data_differences(saved, {"sources": {"web": web, "math": code}}) == []
    assert data_differences(saved, {"sources": {"web": web, "code": web}}) == [
        "training data source 'code': {'tokens': 50, 'documents': 2} in the checkpoint, {'tokens': 100, "
        "'documents': 3} here (give a changed source another name)"
    ]
    assert data_differences(web, saved) and data_differences(web, web) == []


def test_bench_data_blends_distinct_files_and_reads_them_cold(tmp_path):
    """tools/bench_data.py's blend is three datasets of their own files (the corpus's files dealt among them,
    none left out), none of them the single source's; its cold runs drop those pages first and say how many
    stayed (it once blended one file three times, from a warm page cache)."""
    import os

    from tools.bench_data import SOURCES, deal, run_loader

    files = [tmp_path / f"part{i}.txt" for i in range(7)]
    for i, path in enumerate(files):
        path.write_text(f"document {i} " * 2000)
    dealt = deal(files, list(SOURCES))
    assert sorted(f for part in dealt.values() for f in part) == sorted(files) and all(dealt.values())
    prepared = lambda name, part: prepare_data(part, str(tmp_path / name), "byte", progress=False)["train"]
    single, prefixes = prepared("single", files), [prepared(name, part) for name, part in dealt.items()]
    r = run_loader(single, prefixes, 32, 2, 1, True)
    read = {side: [os.stat(f).st_ino for f in paths] for side, paths in r["files"].items()}
    assert len(read["blended"]) == 2 * len(SOURCES) and len(set(read["blended"])) == len(read["blended"])
    assert not set(read["blended"]) & set(read["single"])
    assert r["single"] > 0 and r["blended"] > 0 and r["resident_after_drop"] is not None
