"""The data path at two corpus sizes (--scale apart): prepare-data's tokenize throughput per process and
its peak RSS (a Hugging Face BPE tokenizer trained here, parquet input), and the loader's samples/s for a
blend of three distinct sources against one source, with its peak RSS.

Each measurement runs in a process of its own, so its peak RSS is its own: prepare-data's is the largest of
the main process and its workers (each worker's VmHWM, polled; the main process streams, writing as batches
come).
The blend's three sources are three datasets of their own files: the corpus's parquet files dealt among
them in turn, each prepared apart, so together they hold what the one source (the whole corpus) holds. The
loader reads the same number of samples at both sizes: its peak includes the token-file pages it touched
(mapped, not loaded); `anon` is its heap (RssAnon), which is what would grow if a dataset were loaded whole.
Runs of single and blended global batches alternate; each side's median run is kept. By default each run
starts cold: its datasets are opened anew after their files' pages were dropped from the page cache (fsync,
then posix_fadvise DONTNEED), and the share of their pages still resident after the drop is measured (mincore)
and printed, since the drop is only advice. With --warm every page is read once before the runs instead.

python tools/bench_data.py --small-mb 4 --scale 10
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FILE_MB = 1  # each parquet file holds about this much text
SOURCES = {"web": 0.5, "code": 0.3, "math": 0.2}  # the blend: its sources and their weights


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


def run_prepare(inputs: list[str], output: str, tokenizer: str, workers: int) -> dict:
    from hpc_train.data.indexed import IndexedDataset
    from hpc_train.data.prepare import prepare_data

    files = [Path(f) for f in inputs]
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


def deal(files: list[Path], names: list[str]) -> dict[str, list[Path]]:
    """`files` dealt in turn among `names`: sources of distinct files that together hold them all."""
    return {name: files[i :: len(names)] for i, name in enumerate(names)}


def dataset_files(prefix: str) -> list[Path]:
    """The files a dataset is read from: its tokens, its index and any loss mask."""
    return [Path(prefix + suffix) for suffix in (".bin", ".idx", ".mask") if Path(prefix + suffix).is_file()]


def drop_pages(path: Path) -> None:
    """Ask the kernel to drop `path`'s pages from the page cache (written back first: a dirty page stays).
    Advice only: a page still mapped by a process stays, and so does a tmpfs file's (see `resident_share`)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def resident_share(path: Path) -> float | None:
    """The share of `path`'s pages in the page cache: mincore(2) on a fresh private mapping reports the cache
    for the pages it has not touched. None where libc's mincore cannot be called."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        anchor = ctypes.c_char.from_buffer(mapped)  # the mapping's address
        failed = mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor  # the mapping closes only once nothing points into it
    return None if failed else sum(v & 1 for v in vec) / pages


def run_loader(single_prefix: str, source_prefixes: list[str], seq_len: int, batches: int, rounds: int,
               cold: bool) -> dict:  # fmt: skip
    """samples/s of the single-source and the blended loader (sampler + collate, as the train loop reads):
    `rounds` runs of `batches` global batches of 64 on each side, the sides alternating and each side's median
    run kept, so that the machine's drift and bursts hit both alike. `cold`: each run opens its datasets anew
    after their files' pages were dropped; else they stay open, every page read once before the runs."""
    from hpc_train.data.blend import BlendedSampler, BlendedSource
    from hpc_train.data.indexed import IndexedDataset
    from hpc_train.data.sampler import ResumableSampler

    gb, micro = 64, 8
    named = dict(zip(SOURCES, source_prefixes, strict=True))
    opens: dict[str, Callable] = {
        "single": lambda: IndexedDataset(single_prefix, seq_len),
        "blended": lambda: BlendedSource({name: IndexedDataset(prefix, seq_len) for name, prefix in named.items()}),
    }
    opened = {name: open_side() for name, open_side in opens.items()}
    files = {"single": dataset_files(opened["single"].prefix),  # what the datasets read, as opened
             "blended": [f for d in opened["blended"].datasets for f in dataset_files(d.prefix)]}  # fmt: skip
    samples = len(opened["single"])
    samplers = {"single": ResumableSampler(samples, gb, micro, 0, 1, 0),
                "blended": BlendedSampler(opened["blended"], list(SOURCES.values()), gb, micro, 0, 1, 0)}  # fmt: skip
    if cold:
        opened.clear()  # unmapped: the kernel keeps a page that is mapped
    else:
        for dataset in (opened["single"], *opened["blended"].datasets):
            int(np.asarray(dataset.tokens).sum())  # every page read once: steady state for both
    rates: dict[str, list[float]] = {"single": [], "blended": []}
    resident: list[float | None] = []
    for _ in range(rounds):
        for name in ("single", "blended"):
            if cold:
                for path in files[name]:
                    drop_pages(path)
                resident += [resident_share(path) for path in files[name]]
            source = opened[name] if name in opened else opens[name]()
            start = time.perf_counter()
            for _ in range(batches):
                for indices in samplers[name].next_micro_batches():
                    source.batch(indices)
            rates[name].append(batches * gb / (time.perf_counter() - start))
            del source
    own, _ = peak_rss_mb()
    known = [share for share in resident if share is not None]
    return {**{name: statistics.median(r) for name, r in rates.items()}, "peak_mb": own, "anon_mb": rss_anon_mb(),
            "samples": samples, "files": {name: [str(f) for f in fs] for name, fs in files.items()},
            "resident_after_drop": max(known) if known else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-mb", type=int, default=4, help="text in the small corpus (MB)")
    parser.add_argument("--scale", type=int, default=10, help="the large corpus is this many times the small")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, default=100, help="global batches of 64 per loader run")
    parser.add_argument("--rounds", type=int, default=5, help="loader runs of each side")
    parser.add_argument("--warm", action="store_true", help="loader runs from the page cache (default: cold)")
    parser.add_argument("--dir", help="where the corpora and datasets are written (default: the system's temp)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = json.loads(args.child)
        print(json.dumps({"prepare": run_prepare, "loader": run_loader}[name](*rest)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:  # on a tmpfs no page can be dropped: see `resident`
        base = Path(tmp)
        sizes = {"small": args.small_mb, "large": args.small_mb * args.scale}
        for size, mb in sizes.items():
            write_corpus(base / size, mb, seed=0)
        tokenizer = train_tokenizer(base / "small", base / "tokenizer.json")
        print("prepare-data (parquet in, HF BPE tokenizer, vocab 8000, one thread per process)")
        print(f"{'corpus':>8} {'text MB':>8} {'parquet MB':>10} {'tokens':>11} {'workers':>7} {'s':>7} "
              f"{'tok/s/proc':>11} {'peak RSS MB':>11} {'main':>7} {'worker':>7}")  # fmt: skip
        for size in sizes:
            files = [str(f) for f in sorted((base / size).glob("*.parquet"))]
            for workers in args.workers:
                r = child(["prepare", files, str(base / f"{size}_w{workers}"), tokenizer, workers])
                print(f"{size:>8} {sizes[size]:>8} {r['parquet_mb']:>10.1f} {r['tokens']:>11,} {workers:>7} "
                      f"{r['seconds']:>7.2f} {r['tokens'] / r['seconds'] / workers:>11,.0f} {r['peak_mb']:>11.1f} "
                      f"{r['main_mb']:>7.1f} {r['worker_mb']:>7.1f}")  # fmt: skip
        w = args.workers[0]
        sources = {size: [] for size in sizes}  # the blend's datasets: the corpus's files dealt among them
        for size in sizes:
            for name, files in deal(sorted((base / size).glob("*.parquet")), list(SOURCES)).items():
                sources[size].append(str(base / f"{size}_{name}"))
                child(["prepare", [str(f) for f in files], sources[size][-1], tokenizer, w])
        how = "warm: every page read once before the runs"
        if not args.warm:
            how = "cold: each run opens its datasets after their pages were dropped (fsync, posix_fadvise DONTNEED)"
        weights = " / ".join(f"{name} {weight}" for name, weight in SOURCES.items())
        print(f"\nloader: global batches of 64, median of {args.rounds} runs of {args.batches} batches each, sides "
              f"alternating; {how}\none source: the whole corpus; blended: three datasets of distinct files (the "
              f"corpus's files dealt among them), {weights}")  # fmt: skip
        print(f"{'corpus':>8} {'seq_len':>7} {'samples':>9} {'single/s':>10} {'blended/s':>10} {'ratio':>6} "
              f"{'peak RSS MB':>11} {'anon MB':>8} {'resident':>8}")  # fmt: skip
        for seq_len in args.seq_len:
            for size in sizes:
                r = child(["loader", str(base / f"{size}_w{w}"), sources[size], seq_len, args.batches, args.rounds,
                           not args.warm])  # fmt: skip
                resident = "-" if r["resident_after_drop"] is None else f"{100 * r['resident_after_drop']:.1f}%"
                print(f"{size:>8} {seq_len:>7} {r['samples']:>9,} {r['single']:>10,.0f} {r['blended']:>10,.0f} "
                      f"{r['blended'] / r['single']:>5.3f}x {r['peak_mb']:>11.1f} {r['anon_mb']:>8.1f} "
                      f"{resident:>8}")  # fmt: skip
        if not args.warm:
            print("resident: the largest share of a file's pages still in the page cache right after a drop (mincore)")


if __name__ == "__main__":
    main()
