import json
import subprocess
import sys

import numpy as np
import pytest

from hpc_train.data.indexed import IndexedDataset, IndexedDatasetWriter
from hpc_train.data.prepare import builtin_corpus, dataset_tokenizer, record_run_tokenizer
from hpc_train.data.sampler import ResumableSampler
from hpc_train.data.tokenizer import ByteTokenizer, build_tokenizer
from tests.conftest import ROOT, TINY_MODEL, run_cli


def test_indexed_roundtrip_and_dtypes(tmp_path):
    docs = [np.arange(10), np.arange(5) + 100, np.array([70000, 1])]
    w = IndexedDatasetWriter(tmp_path / "big", vocab_size=70001, tokenizer="test")
    for d in docs:
        w.add_document(d)
    w.close()
    ds = IndexedDataset(tmp_path / "big", seq_len=4)
    assert ds.tokens.dtype == np.uint32 and ds.header["num_docs"] == 3
    assert list(ds.doc_offsets) == [0, 10, 15, 17]
    assert np.array_equal(np.asarray(ds.tokens), np.concatenate(docs))
    batch = ds.batch(np.array([0, 3]))
    x, y = batch.tokens, batch.labels
    assert x.tolist() == [[0, 1, 2, 3], [102, 103, 104, 70000]]
    assert y[0].tolist() == [1, 2, 3, 4]
    small = IndexedDatasetWriter(tmp_path / "small", vocab_size=257, tokenizer="byte")
    small.add_document(np.array([1, 2, 3]))
    small.close()
    assert IndexedDataset(tmp_path / "small", 1).tokens.dtype == np.uint16
    with pytest.raises(ValueError, match="token id out of range"):
        IndexedDatasetWriter(tmp_path / "bad", vocab_size=10, tokenizer="x").add_document(np.array([10]))


def test_truncated_dataset_is_refused(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", vocab_size=257, tokenizer="byte")
    w.add_document(np.arange(100))
    w.close()
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(50)
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "d", 8)


def test_sampler_resume_and_dp_invariance():
    def make(dp_rank=0, dp=1, consumed=0, mbs=2):
        s = ResumableSampler(
            num_samples=37, global_batch_size=8, micro_batch_size=mbs, dp_rank=dp_rank, dp_size=dp, seed=5
        )
        s.load_state_dict({"consumed_samples": consumed})
        return s

    full = make()
    steps = [np.concatenate(full.next_micro_batches()) for _ in range(12)]  # crosses two epoch boundaries
    assert sorted(np.concatenate(steps[:5])[:37].tolist()) == list(range(37))  # epoch 0 is a permutation
    resumed = make(consumed=5 * 8)
    assert all(np.array_equal(np.concatenate(resumed.next_micro_batches()), steps[k]) for k in range(5, 12))
    ranks = [make(dp_rank=r, dp=2) for r in range(2)]
    for k in range(12):  # dp=2: the ranks' slices put together are dp=1's global batch
        assert np.array_equal(np.concatenate([np.concatenate(r.next_micro_batches()) for r in ranks]), steps[k])
    assert [len(m) for m in make(mbs=4).next_micro_batches()] == [4, 4]


def test_prepare_data_cli_byte_and_hf(tmp_path):
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"hello world number {i}\n" * 20)
    # the script itself once (its only test); then `hpc-train prepare-data`, the same main, in this process
    run = lambda *a: subprocess.run(
        [sys.executable, "tools/prepare_data.py", *a], cwd=ROOT, check=True, capture_output=True, text=True
    )
    out = run(str(tmp_path / "doc*.txt"), "--output", str(tmp_path / "byte"), "--valid-every", "3").stdout
    train, valid = IndexedDataset(tmp_path / "byte", 8), IndexedDataset(tmp_path / "byte_valid", 8)
    assert (train.header["num_docs"], valid.header["num_docs"]) == (4, 2)
    first = bytes(np.asarray(train.tokens[: train.doc_offsets[1] - 1]).astype(np.uint8)).decode()
    assert first == "hello world number 0\n" * 20 and train.tokens[train.doc_offsets[1] - 1] == 256
    assert f"train: {tmp_path}/byte.bin / {tmp_path}/byte.idx: 4 documents, 1,684 tokens\n" in out  # 4 x (420 + 1)
    assert f"valid: {tmp_path}/byte_valid.bin / {tmp_path}/byte_valid.idx: 2 documents, 842 tokens\n" in out
    # a run that would read these 52 samples of 32 tokens more than once is told so before it starts
    assert len(IndexedDataset(tmp_path / "byte", 32)) == 52
    dry = run_cli("submit", *TINY_MODEL, f"data.train_path={tmp_path / 'byte'}", "train.steps=10",
                  "train.micro_batch_size=8", f"run_dir={tmp_path / 'run'}", "--dry-run")  # fmt: skip
    assert dry.returncode == 0 and dry.stderr == (
        f"hpc-train: note: data.train_path={tmp_path / 'byte'}: the run reads 80 of its 52 samples (1.5 epochs): "
        "they repeat from about step 7\n"
    ), dry.stderr
    for prefix in ("byte", "byte_valid"):  # the byte-level tokenizer's own tokenizer.json, recorded
        assert dataset_tokenizer(str(tmp_path / prefix)) == f"{tmp_path / prefix}.tokenizer.json"
        assert isinstance(build_tokenizer(f"{tmp_path / prefix}.tokenizer.json"), ByteTokenizer)

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(p) for p in tmp_path.glob("doc*.txt")], trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    prepared = run_cli("prepare-data", str(tmp_path / "doc*.txt"), "--output", str(tmp_path / "hf.bin"),
                       "--tokenizer", str(tmp_path / "tokenizer.json"))  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    assert sorted(p.name for p in tmp_path.glob("hf*")) == ["hf.bin", "hf.idx", "hf.tokenizer.json"]  # .bin dropped
    assert (tmp_path / "hf.tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    hf = IndexedDataset(tmp_path / "hf", 4)
    # the run records its data's tokenizer; a copy that is not the one the index records is none
    assert record_run_tokenizer(hf, tmp_path / "run") == tmp_path / "run" / "tokenizer.json"
    assert (tmp_path / "run" / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "byte.tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    assert dataset_tokenizer(str(tmp_path / "byte")) == "byte"  # as before datasets recorded theirs
    assert hf.vocab_size == tok.get_vocab_size() and hf.header["num_docs"] == 6
    assert hf.tokens[hf.doc_offsets[1] - 1] == tok.token_to_id("</s>")
    assert tok.decode(np.asarray(hf.tokens[:4]).tolist()) == "hello world number 0"
    bad = run_cli("prepare-data", str(tmp_path / "*.nothing"), "--output", "x")
    assert bad.returncode == 2 and "matches no file" in bad.stderr


def test_prepare_data_refuses_a_tokenizer_without_an_end_of_document_and_names_the_text_key(tmp_path):
    """A tokenizer.json without an end-of-document token would glue the documents together: refused in one
    line naming the fix, nothing written. JSON lines holding their text under another key: the error names
    the --text-key that reads it, which then does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    (tmp_path / "notes.txt").write_text("one document\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["one document"], trainers.BpeTrainer(special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "no_eod.json"))
    refused = run_cli("prepare-data", str(tmp_path / "notes.txt"), "--output", str(tmp_path / "glued"),
                      "--tokenizer", str(tmp_path / "no_eod.json"))  # fmt: skip
    assert refused.returncode == 2 and refused.stderr == (
        f"hpc-train: error: --tokenizer {tmp_path / 'no_eod.json'} has no end-of-document token (none of "
        "<|endoftext|>, </s>, <eos>, <|end_of_text|>), so its documents would run together: add one to it as a "
        "special token (tokenizer.add_special_tokens(['</s>']), then save) and prepare the data again\n"
    )
    assert not list(tmp_path.glob("glued*"))

    (tmp_path / "chat.jsonl").write_text('{"id": 1, "content": "first"}\n\n{"id": 2, "content": "second"}\n')
    wrong_key = run_cli("prepare-data", str(tmp_path / "chat.jsonl"), "--output", str(tmp_path / "chat"))
    assert wrong_key.returncode == 2 and wrong_key.stderr == (
        f'hpc-train: error: {tmp_path / "chat.jsonl"}:1 has no "text" string, nor "prompt" and "response" strings: '
        'to read its text from "content", give --text-key content\n'
    )
    right_key = run_cli("prepare-data", str(tmp_path / "chat.jsonl"), "--output", str(tmp_path / "chat"),
                        "--text-key", "content")  # fmt: skip
    assert right_key.returncode == 0 and IndexedDataset(tmp_path / "chat", 1).header["num_docs"] == 2


def test_builtin_corpus_is_built_once(tmp_path):
    train, valid = builtin_corpus(str(tmp_path), progress=False)
    ds, held_out = IndexedDataset(train, 128), IndexedDataset(valid, 128)
    assert ds.vocab_size == 257 and len(ds) > 10 * len(held_out) > 0
    stamp = (tmp_path.glob("*/train.bin").__next__()).stat().st_mtime_ns
    assert builtin_corpus(str(tmp_path), progress=False) == (train, valid)
    assert next(tmp_path.glob("*/train.bin")).stat().st_mtime_ns == stamp


def test_instruction_jsonl_keeps_a_loss_mask_on_the_responses(tmp_path):
    """{prompt, response} lines: only the response and its end-of-document count; {text} lines count
    whole; an example longer than a sample is refused at load, or cut to its last --max-tokens."""
    from hpc_train.data.batch import IGNORE
    from hpc_train.data.prepare import prepare_data

    lines = [{"prompt": "Q: two? ", "response": "A: 2"}, {"text": "plain"}, {"prompt": "x" * 40, "response": "yz"}]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    prepare_data([tmp_path / "sft.jsonl"], str(tmp_path / "sft"), progress=False, max_tokens=13)
    ds = IndexedDataset(tmp_path / "sft", 13)
    assert ds.header["loss_mask"] and ds.header["longest_document"] == 13
    tokens, mask = bytes(np.asarray(ds.tokens[:13]).astype(np.uint8)), np.asarray(ds.loss_mask)
    assert tokens[:12] == b"Q: two? A: 2" and mask[:8].sum() == 0 and mask[8:13].all()  # + end-of-document
    assert mask[13:19].all() and mask[19:29].sum() == 0 and mask[29:].all()  # "plain" + EOD; 40 x's cut to 10
    targets = ds.batch(np.array([0])).labels
    assert (targets[0] == IGNORE).tolist() == [True] * 7 + [False] * 6  # targets are the next tokens
    with pytest.raises(ValueError, match="longer than a sample"):
        IndexedDataset(tmp_path / "sft", 8)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "no response"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl:1 has no "text" string, nor "prompt" and "response" strings$'):
        prepare_data([tmp_path / "bad.jsonl"], str(tmp_path / "bad"), progress=False)


def test_prepare_data_reads_parquet_jsonl_and_text_in_worker_processes(tmp_path):
    """Parquet (a glob of two files; other columns ignored), JSON lines and a text file, tokenized by a Hugging
    Face tokenizer in two worker processes: the same dataset as one process writes, each record a document in
    input order; a file without a text column is refused by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hpc_train.config import ConfigError
    from hpc_train.data.prepare import expand_inputs, prepare_data

    rows = [f"row {i} says hello to parquet" for i in range(30)]
    pq.write_table(pa.table({"id": list(range(20)), "text": rows[:20]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"id": list(range(10)), "text": rows[20:]}), tmp_path / "part-1.parquet")
    (tmp_path / "lines.jsonl").write_text(
        "".join(json.dumps({"text": f"json line {i}", "n": i}) + "\n" for i in range(5))
    )
    (tmp_path / "notes.txt").write_text("a whole text file\nis one document\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(rows + ["json line", "a whole text file is one document"],
                            trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    files = expand_inputs([str(tmp_path / "*.parquet"), str(tmp_path / "lines.jsonl"), str(tmp_path / "notes.txt")])
    for workers in (1, 2):
        prepare_data(files, str(tmp_path / f"w{workers}"), str(tmp_path / "tokenizer.json"), progress=False,
                     workers=workers)  # fmt: skip
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    ds = IndexedDataset(tmp_path / "w2", 4)
    assert ds.header["num_docs"] == 30 + 5 + 1 and not (tmp_path / "w2.mask").exists()
    docs = np.split(np.asarray(ds.tokens), ds.doc_offsets[1:-1])
    assert tok.decode(docs[0][:-1].tolist()) == rows[0] and docs[0][-1] == tok.token_to_id("</s>")
    assert tok.decode(docs[29][:-1].tolist()) == rows[29] and tok.decode(docs[34][:-1].tolist()) == "json line 4"
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ConfigError, match=r"other.parquet has columns \['body'\]: it needs a 'text' column"):
        prepare_data([tmp_path / "other.parquet"], str(tmp_path / "bad"), progress=False)
    prepare_data([tmp_path / "other.parquet"], str(tmp_path / "body"), progress=False, text_key="body")
    assert IndexedDataset(tmp_path / "body", 1).header["num_docs"] == 1
