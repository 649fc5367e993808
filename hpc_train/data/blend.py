"""Weighted blends of datasets: which source each sample of the global stream comes from, and where in
that source's own shuffled stream.

The rule is exact and stateless but for each source's count: source s's k-th sample (k = 0, 1, ...) of a
phase is due at time (k + 1/2) / w_s, with w the normalised weights, and samples are taken in order of due
time (a tie goes to the lower source index). After n samples of a phase, with T the due time of the n-th,
every source holds between w_s T - 1/2 and w_s T + 1/2 of them; these sum to n, so |n - T| <= K/2 for K
sources, and each source's count is within (1 + K w_s) / 2 samples of w_s n: its share is within
(1 + K w_s) / (2 n) of its weight (`share_bound`). Megatron's rule (the source furthest below its target)
keeps a count within K - 1 below and 1 above; this one needs no loop over samples, so a global batch's
sources are computed at once, and only each source's count is state.

The order depends on (seed, the sources' names, the weights) only: every rank computes the whole global
batch and reads its slice, so it is the same for every dp size and layout. Each source is read through its
own shuffled stream (data/sampler.py), seeded by the run's seed and the source's name, from where the
previous phase stopped: changing the weights or adding a source on resume starts a new phase and repeats
no sample already read (until a source's stream wraps into its next epoch).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from hpc_train.data.batch import Batch, collate
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.sampler import ShuffledStream, check_batch_shape, merge_ranges, rank_slice, skip_ahead

PLAN_SAMPLES = 4096  # a blended sampler plans about this many samples at once
SOURCE_SHIFT = 40  # a blend's sample index: its source above these bits, its index in the source below
LOCAL_MASK = (1 << SOURCE_SHIFT) - 1


def normalised(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def next_sources(counts: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """The source of each of the next `n` samples of a phase, given each source's samples in it so far."""
    # of any n consecutive samples a source gets at most w n + 1 + K w <= w n + K + 1 (the bound above, at
    # both ends): its candidates are its next ceil(w n) + K + 1 due times, in source order, so that a stable
    # sort breaks ties to the lower index
    k = len(weights)
    ahead = np.minimum(n, np.ceil(weights * n).astype(np.int64) + k + 1)
    due = np.concatenate([(c + np.arange(m) + 0.5) / w for c, m, w in zip(counts, ahead, weights, strict=True)])
    source = np.repeat(np.arange(k), ahead)
    return source[np.argsort(due, kind="stable")[:n]]


def share_bound(weights: np.ndarray, n: int) -> np.ndarray:
    """The largest difference between each source's share of n samples of a phase and its weight."""
    return (1 + len(weights) * weights) / (2 * n)


class BlendedSource:  # a data.batch.Source
    """Several datasets as one index space: sample i of source s is index offsets[s] + i, with offsets[s] =
    s << SOURCE_SHIFT, so that a sample's source is a shift away (no search per sample)."""

    def __init__(self, datasets: dict[str, IndexedDataset]):
        self.names, self.datasets = list(datasets), list(datasets.values())
        if max(len(d) for d in self.datasets) > LOCAL_MASK:
            raise ValueError(f"a source holds more than {LOCAL_MASK} samples")
        self.offsets = [s << SOURCE_SHIFT for s in range(len(self.datasets))]
        self.num_samples = sum(len(d) for d in self.datasets)
        self._sample = [d.sample for d in self.datasets]
        self.prefix = "blend of " + ", ".join(f"{n} ({d.prefix})" for n, d in datasets.items())
        # None when every source is a Megatron-LM corpus (which records none: the model's is used)
        self.vocab_size = max((d.vocab_size for d in self.datasets if d.vocab_size is not None), default=None)
        # a mask for every sample when any source has one (the others count every label)
        self.loss_mask = True if any(d.loss_mask is not None for d in self.datasets) else None
        self.seq_len = self.datasets[0].seq_len

    def __len__(self) -> int:
        return self.num_samples

    def source_of(self, index: int) -> int:
        return index >> SOURCE_SHIFT

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.samples(np.array([index]))[0]

    def samples(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray | None]]:
        sample, shift, local = self._sample, SOURCE_SHIFT, LOCAL_MASK
        out = [sample[i >> shift](i & local) for i in indices.tolist()]
        if self.loss_mask:
            ones = np.ones(self.seq_len, dtype=np.uint8)
            out = [(tokens, ones if mask is None else mask) for tokens, mask in out]
        return out

    def documents(self, indices: np.ndarray) -> np.ndarray:
        shift, local = SOURCE_SHIFT, LOCAL_MASK
        return np.concatenate([self.datasets[i >> shift].documents(np.array([i & local])) for i in indices.tolist()])

    def identity(self) -> dict[str, dict[str, dict[str, int | str]]]:
        """Each source's identity, by name: a resume refuses a source whose data changed under its name."""
        return {"sources": {n: d.identity() for n, d in zip(self.names, self.datasets, strict=True)}}

    def identity_notes(self) -> list[str]:
        return [note for d in self.datasets for note in d.identity_notes()]

    def batch(self, indices: np.ndarray) -> Batch:
        return collate(self, indices)


class BlendedSampler:
    """The blend's global stream, read like ResumableSampler's: global batch g is stream positions
    [g * G, (g + 1) * G), data-parallel rank r reads slice r. State: the samples read from each source (all
    phases), the weights of the current phase and each source's samples in it."""

    def __init__(
        self,
        source: BlendedSource,
        weights: list[float],
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        report: Callable[[str], None] = lambda message: None,
        skipped: list[list[int]] | None = None,
    ):
        check_batch_shape(global_batch_size, micro_batch_size, dp_size)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.report = dp_rank, dp_size, report
        self.names, self.offsets, self.tokens_per_sample = source.names, source.offsets, source.seq_len
        self.weights = normalised(weights)
        self.streams = [ShuffledStream(len(d), seed, (zlib.crc32(n.encode()),))
                        for n, d in zip(source.names, source.datasets, strict=True)]  # fmt: skip
        self.consumed_samples = 0
        self.phase_start = np.zeros(len(self.names), dtype=np.int64)  # each source's samples before this phase
        self.phase_counts = np.zeros(len(self.names), dtype=np.int64)  # and in it
        self.retired: dict[str, int] = {}  # samples read from sources of earlier phases that this one lacks
        self.skipped = merge_ranges(skipped or [])  # [start, end) stream positions read and not trained on
        # planned: (indices of the next batches, each source's phase count after each batch, batches read)
        self._planned: tuple[np.ndarray, np.ndarray, int] | None = None

    def _plan(self, batches: int) -> None:
        """The sources and indices of the next `batches` global batches from the current state (left as is),
        and each source's count in the phase after each of them."""
        g = self.global_batch_size
        picks = next_sources(self.phase_counts, self.weights, batches * g)
        out = np.empty(batches * g, dtype=np.int64)
        per_batch = np.empty((batches, len(self.streams)), dtype=np.int64)
        for s, stream in enumerate(self.streams):
            chosen = picks == s
            if count := int(chosen.sum()):
                out[chosen] = self.offsets[s] + stream.indices(int(self.phase_start[s] + self.phase_counts[s]), count)
            per_batch[:, s] = chosen.reshape(batches, g).sum(axis=1)
        self._planned = (out, self.phase_counts + np.cumsum(per_batch, axis=0), 0)

    def next_global_batch(self) -> np.ndarray:
        """The next global batch's indices (into the BlendedSource); advances the state. Batches are planned
        PLAN_SAMPLES at a time (the same order however the stream is cut), the state advanced batch by batch."""
        g = self.global_batch_size
        if self._planned is None or self._planned[2] == len(self._planned[1]):
            self._plan(max(1, PLAN_SAMPLES // g))
        out, counts, b = self._planned
        self._planned = (out, counts, b + 1)
        self.phase_counts = counts[b]
        self.consumed_samples += g
        return out[b * g : (b + 1) * g]

    def next_micro_batches(self) -> list[np.ndarray]:
        """This rank's micro-batches of the next global batch not skipped; advances the state."""
        skip_ahead(self)
        return rank_slice(self.next_global_batch(), self.dp_rank, self.dp_size, self.micro_batch_size)

    def describe(self, indices: np.ndarray) -> dict[str, list[int]]:
        """Samples as metrics.jsonl records them: each source's indices, by its name."""
        out: dict[str, list[int]] = {}
        for index in indices.tolist():
            out.setdefault(self.names[index >> SOURCE_SHIFT], []).append(index & LOCAL_MASK)
        return out

    def taken(self) -> dict[str, int]:
        """Samples read from each source so far, over every phase."""
        return {**self.retired, **dict(zip(self.names, (self.phase_start + self.phase_counts).tolist(), strict=True))}

    def progress(self) -> dict[str, int]:
        """What each step's metrics record: the samples read, and the tokens read from each source."""
        tokens = {f"train_tokens/{n}": c * self.tokens_per_sample for n, c in self.taken().items()}
        return {"consumed_samples": self.consumed_samples, **tokens}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "taken": self.taken(),
                "weights": dict(zip(self.names, self.weights.tolist(), strict=True)),
                "phase": dict(zip(self.names, self.phase_counts.tolist(), strict=True)),
                **({"skipped": self.skipped} if self.skipped else {})}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """The same sources and weights continue the saved phase exactly; others start a new phase where
        each source stopped (reported)."""
        if "taken" not in state:
            raise ValueError("the checkpoint's sampler read one dataset (data.train_path), not a blend: resume it "
                             "with data.train_path, or start the blend in a fresh checkpoint.dir")  # fmt: skip
        taken = {n: int(c) for n, c in state["taken"].items()}
        self._planned = None
        self.skipped = merge_ranges(self.skipped, state.get("skipped", []))
        self.consumed_samples = int(state["consumed_samples"])
        self.retired = {n: c for n, c in taken.items() if n not in self.names}
        here = dict(zip(self.names, self.weights.tolist(), strict=True))
        if state["weights"] == here:
            self.phase_counts = np.array([int(state["phase"][n]) for n in self.names], dtype=np.int64)
            self.phase_start = np.array([taken[n] for n in self.names], dtype=np.int64) - self.phase_counts
            return
        self.phase_start = np.array([taken.get(n, 0) for n in self.names], dtype=np.int64)
        self.phase_counts = np.zeros(len(self.names), dtype=np.int64)
        describe = lambda weights: ", ".join(f"{n} {w:.4g}" for n, w in weights.items())
        self.report(f"data mix changed at sample {self.consumed_samples}: weights {describe(state['weights'])} -> "
                    f"{describe(here)}; a new phase, each source continuing after the samples it already gave "
                    f"({', '.join(f'{n} {c}' for n, c in self.taken().items())})")  # fmt: skip
