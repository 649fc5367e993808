"""Tokens/s of `prepare-data --slurm nodes=N`, from submission to the merged dataset (its index committed), for
each N, against one-process `prepare_data` of the same corpus in this process (the baseline of the ratio). The
corpus is the standard library's sources (`stdlib_sources`, --files: the first N of them), tokenized
byte-level and by a BPE tokenizer of 8000 tokens trained here on the corpus (byte-level costs almost nothing a
token, so its figures are the jobs' overhead; BPE's have work to spread). Each pipeline's dataset is checked
byte for byte against the baseline's. The seconds are split into the array (submission to the last part's
record) and the merge (then to the dataset: the merge job's start included).

python tools/bench_prepare_slurm.py                      # nodes 1,2,3; byte and bpe
python tools/bench_prepare_slurm.py --nodes 4,8 --dir /shared/scratch/bench   # a real cluster: a shared dir
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import io
import os
import tempfile
import time
from pathlib import Path

from hpc_train.data.indexed import read_index
from hpc_train.data.prepare import prepare_data, stdlib_sources
from hpc_train.launch import prepare_array


def bpe_tokenizer(files: list[Path], out: Path) -> str:
    """A BPE tokenizer.json of 8000 tokens (</s> ends a document) trained on the files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    tok.save(str(out))
    return str(out)


def one_process(files: list[Path], prefix: str, tokenizer: str) -> float:
    start = time.perf_counter()
    prepare_data(files, prefix, tokenizer, progress=False)
    return time.perf_counter() - start


def pipeline(
    files: list[Path], prefix: str, tokenizer: str, options: prepare_array.ArrayOptions
) -> tuple[float, float]:
    """Seconds from submission to every part's record, and to the merged dataset's index; the jobs followed to
    their end (a failed one raises)."""
    plan = prepare_array.make_plan(files, prefix, tokenizer, 0, None, 1, "text", options)
    todo = prepare_array.parts_to_run(plan)
    records = [Path(plan.part_prefix(part) + ".json") for part in todo]
    start, parts = time.perf_counter(), None
    array, merge = prepare_array.submit(plan, todo)
    while not Path(plan.output + ".idx").is_file():
        if parts is None and all(record.is_file() for record in records):
            parts = time.perf_counter() - start
        time.sleep(0.05)
    done = time.perf_counter() - start
    with contextlib.redirect_stdout(io.StringIO()):
        failure = prepare_array.follow(plan, todo, array, merge)
    if failure:
        raise RuntimeError(failure)
    return parts if parts is not None else done, done


def same_files(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + suffix, b + suffix, shallow=False) for suffix in (".bin", ".idx", ".tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,2,3", help="the array sizes (default 1,2,3)")
    parser.add_argument("--tokenizers", default="byte,bpe", help="byte, bpe or both (default)")
    parser.add_argument("--files", type=int, help="the first N standard-library files (default all)")
    parser.add_argument("--partition", help="--slurm partition= (default: the cluster's default)")
    parser.add_argument("--dir", help="where the datasets go; the jobs' nodes must see it (default: a temporary one)")
    args = parser.parse_args()
    files = stdlib_sources()[: args.files]
    print(f"corpus: {len(files)} standard-library files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB; "
          f"{os.cpu_count()} CPU(s) here", flush=True)  # fmt: skip
    print(f"{'tokenizer':<10} {'run':<12} {'seconds':>8} {'tokens/s':>11} {'vs one':>7}   array | merge (s)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.tokenizers.split(","):
            tokenizer = "byte" if name == "byte" else bpe_tokenizer(files, Path(tmp) / "bpe.json")
            base = f"{tmp}/{name}-one"
            seconds = one_process(files, base, tokenizer)
            tokens = read_index(base)[0]["num_tokens"]
            print(f"{name:<10} {'one process':<12} {seconds:>8.2f} {tokens / seconds:>11,.0f} {1:>6.2f}x", flush=True)
            for nodes in map(int, args.nodes.split(",")):
                prefix = f"{tmp}/{name}-n{nodes}"
                parts, done = pipeline(files, prefix, tokenizer, prepare_array.ArrayOptions(nodes, args.partition))
                identical = "" if same_files(prefix, base) else "   NOT byte-identical to one process's"
                print(f"{name:<10} {f'nodes={nodes}':<12} {done:>8.2f} {tokens / done:>11,.0f} {seconds / done:>6.2f}x"
                      f"   {parts:.1f} | {done - parts:.1f}{identical}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
