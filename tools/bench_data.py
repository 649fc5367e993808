"""The data path at two corpus sizes (--scale apart): prepare-data's tokenize throughput per process and
its peak RSS (a Hugging Face BPE tokenizer trained here, parquet input), and the loader's samples/s for a
blend of three sources against one source, with its peak RSS.

Each measurement runs in a process of its own, so its peak RSS is its own: prepare-data's is the largest of
the main process and its workers (each worker's VmHWM, polled; the main process streams, writing as batches
come).
The loader reads the same number of samples at both sizes: its peak includes the token-file pages it
touched (mapped, not loaded); `anon` is its heap (RssAnon), which is what would grow if a dataset were
loaded whole. The loader reads single and blended global batches alternately; each side's median is kept.

python tools/bench_data.py --small-mb 4 --scale 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FILE_MB = 1  # each parquet file holds about this much text


def write_corpus(directory: Path, megabytes: int, seed: int) -> None:
    """`megabytes` of pseudo-text (words drawn from a fixed list, Zipf-like) in parquet files of FILE_MB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(5000)]
    p = 1 / np.arange(1, len(words) + 1)
    p /= p.sum()
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(megabytes // FILE_MB):
        docs, size = [], 0
        while size < FILE_MB * 2**20:
            doc = " ".join(np.array(words)[rng.choice(len(words), rng.integers(100, 600), p=p)])
            docs.append(doc)
            size += len(doc)
        pq.write_table(pa.table({"text": docs}), directory / f"part-{f:04d}.parquet")


def train_tokenizer(corpus: Path, out: Path) -> str:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    sample = pq.read_table(next(corpus.glob("*.parquet"))).column("text").to_pylist()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "</s>"]))
    tok.save(str(out))
    return str(out)


def child(command: list[str]) -> dict:
    """Run this tool's `--child` mode in a fresh process; its JSON result."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one thread per process: tokens/s per process
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(command)], cwd=ROOT, check=True,
                         capture_output=True, text=True, env=env)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss_mb() -> tuple[float, float]:
    """(this process's peak RSS, the largest peak of its finished children), MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children_peak_mb(stop: threading.Event, peak: list[float]) -> None:
    """Until `stop`: the largest VmHWM of this process's children (the tokenizing workers), polled. (The
    rusage of children would count a worker's pages from before its exec, its parent's.)"""
    me = os.getpid()
    while not stop.wait(0.1):
        for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            hwm = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0")
            peak[0] = max(peak[0], int(hwm) / 1024)


def run_prepare(corpus: str, output: str, tokenizer: str, workers: int) -> dict:
    from hpc_train.data.indexed import IndexedDataset
    from hpc_train.data.prepare import expand_inputs, prepare_data

    files = expand_inputs([f"{corpus}/*.parquet"])
    stop, children = threading.Event(), [0.0]
    poll = threading.Thread(target=children_peak_mb, args=(stop, children))
    poll.start()
    start = time.perf_counter()
    prepare_data(files, output, tokenizer, progress=False, workers=workers)
    seconds = time.perf_counter() - start
    stop.set()
    poll.join()
    own, children = peak_rss_mb()[0], children[0]
    ds = IndexedDataset(output, 1)
    text_mb = sum(f.stat().st_size for f in files) / 2**20
    return {"seconds": seconds, "tokens": int(ds.header["num_tokens"]), "docs": int(ds.header["num_docs"]),
            "peak_mb": max(own, children), "main_mb": own, "worker_mb": children, "parquet_mb": text_mb}  # fmt: skip


def run_loader(prefix: str, seq_len: int, batches: int, rounds: int) -> dict:
    """samples/s of the single-source and the blended loader (sampler + collate, as the train loop reads):
    global batches of 64 read alternately, one of each in turn, and each side's median batch time kept, so
    that the machine's drift and bursts hit both alike."""
    from hpc_train.data.blend import BlendedSampler, BlendedSource
    from hpc_train.data.indexed import IndexedDataset
    from hpc_train.data.sampler import ResumableSampler

    single = IndexedDataset(prefix, seq_len)
    blend = BlendedSource({name: IndexedDataset(prefix, seq_len) for name in ("web", "code", "math")})
    gb, micro = 64, 8
    samplers = {"single": ResumableSampler(len(single), gb, micro, 0, 1, 0),
                "blended": BlendedSampler(blend, [0.5, 0.3, 0.2], gb, micro, 0, 1, 0)}  # fmt: skip
    sources = {"single": single, "blended": blend}
    for dataset in (single, *blend.datasets):  # every page mapped once: steady state for both (the blend maps
        int(np.asarray(dataset.tokens).sum())  # the one file three times, which a blend of three files would not)
    times: dict[str, list[float]] = {"single": [], "blended": []}
    for _ in range(rounds * batches):
        for name in ("single", "blended"):
            sampler, source = samplers[name], sources[name]
            start = time.perf_counter()
            for indices in sampler.next_micro_batches():
                source.batch(indices)
            times[name].append(time.perf_counter() - start)
    own, _ = peak_rss_mb()
    rates = {name: gb / statistics.median(t) for name, t in times.items()}
    return {**rates, "peak_mb": own, "anon_mb": rss_anon_mb(), "samples": int(len(single))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-mb", type=int, default=4, help="text in the small corpus (MB)")
    parser.add_argument("--scale", type=int, default=10, help="the large corpus is this many times the small")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, default=100, help="global batches of 64 per loader round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = json.loads(args.child)
        print(json.dumps({"prepare": run_prepare, "loader": run_loader}[name](*rest)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        sizes = {"small": args.small_mb, "large": args.small_mb * args.scale}
        for size, mb in sizes.items():
            write_corpus(base / size, mb, seed=0)
        tokenizer = train_tokenizer(base / "small", base / "tokenizer.json")
        print("prepare-data (parquet in, HF BPE tokenizer, vocab 8000, one thread per process)")
        print(f"{'corpus':>8} {'text MB':>8} {'parquet MB':>10} {'tokens':>11} {'workers':>7} {'s':>7} "
              f"{'tok/s/proc':>11} {'peak RSS MB':>11} {'main':>7} {'worker':>7}")  # fmt: skip
        for size in sizes:
            for workers in args.workers:
                r = child(["prepare", str(base / size), str(base / f"{size}_w{workers}"), tokenizer, workers])
                print(f"{size:>8} {sizes[size]:>8} {r['parquet_mb']:>10.1f} {r['tokens']:>11,} {workers:>7} "
                      f"{r['seconds']:>7.2f} {r['tokens'] / r['seconds'] / workers:>11,.0f} {r['peak_mb']:>11.1f} "
                      f"{r['main_mb']:>7.1f} {r['worker_mb']:>7.1f}")  # fmt: skip
        w = args.workers[0]
        print(f"\nloader: global batches of 64, median of {args.rounds * args.batches} batches each, alternating; "
              "blended: three sources at 0.5 / 0.3 / 0.2")  # fmt: skip
        print(f"{'corpus':>8} {'seq_len':>7} {'samples':>9} {'single/s':>10} {'blended/s':>10} {'ratio':>6} "
              f"{'peak RSS MB':>11} {'anon MB':>8}")  # fmt: skip
        for seq_len in args.seq_len:
            for size in sizes:
                r = child(["loader", str(base / f"{size}_w{w}"), seq_len, args.batches, args.rounds])
                print(f"{size:>8} {seq_len:>7} {r['samples']:>9,} {r['single']:>10,.0f} {r['blended']:>10,.0f} "
                      f"{r['blended'] / r['single']:>5.3f}x {r['peak_mb']:>11.1f} {r['anon_mb']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
