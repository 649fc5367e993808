"""A deterministic, resumable sampler.

The global sample order is a seeded permutation of the dataset per epoch, concatenated epoch after
epoch into one stream. Global batch g is stream positions [g * G, (g + 1) * G); data-parallel rank r
reads the contiguous slice r of it and splits that into micro-batches. The whole state is the number
of consumed samples, so resuming at sample k reproduces the same batches, and the global batches are
the same whatever the data-parallel size.

Skipped ranges ([start, end) stream positions: data.skip_samples, and each rollback of train.spike_guard)
are read past: when the stream reaches a range's start its global batches are drawn and dropped, so the
batches after it are those a run that trained on it would have read (a blend's counts advance the same).
The ranges are part of the state, so a resume keeps skipping them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ShuffledStream:
    """A dataset's samples as an endless stream: epoch after epoch, each a permutation seeded by (seed, epoch)."""

    num_samples: int
    seed: int
    key: tuple[int, ...] = ()  # more seed words: a blend's source (its name's checksum)
    _perm_cache: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache.clear()  # keep one epoch's permutation at a time
            rng = np.random.Generator(np.random.PCG64([self.seed, *self.key, epoch]))
            self._perm_cache[epoch] = rng.permutation(self.num_samples)
        return self._perm_cache[epoch]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [start, start + count), crossing epochs as needed."""
        epoch, offset = divmod(start, self.num_samples)
        if offset + count <= self.num_samples:  # within one epoch: a slice
            return self._epoch_perm(epoch)[offset : offset + count].copy()
        epochs, offsets = np.divmod(np.arange(start, start + count), self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            out[in_epoch] = self._epoch_perm(int(epoch))[offsets[in_epoch]]
        return out


def rank_slice(indices: np.ndarray, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[np.ndarray]:
    """Data-parallel rank `dp_rank`'s contiguous slice of a global batch, split into micro-batches."""
    per_rank = len(indices) // dp_size
    return np.split(indices[dp_rank * per_rank : (dp_rank + 1) * per_rank], per_rank // micro_batch_size)


def merge_ranges(*lists: list[list[int]]) -> list[list[int]]:
    """Skipped ranges, sorted, overlapping and adjacent ones joined."""
    merged: list[list[int]] = []
    for start, end in sorted((int(start), int(end)) for ranges in lists for start, end in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def skip_ahead(sampler: ResumableSampler | Any) -> None:
    """Read past the skipped range `sampler` stands at the start of, or in (ranges are joined: one suffices)."""
    end = next((e for s, e in sampler.skipped if s <= sampler.consumed_samples < e), None)
    while end is not None and sampler.consumed_samples < end:
        sampler.next_global_batch()


def add_skip(sampler: ResumableSampler | Any, start: int, end: int) -> None:
    sampler.skipped = merge_ranges(sampler.skipped, [[start, end]])


def read_range(sampler: ResumableSampler | Any, start: int, end: int) -> np.ndarray:
    """The dataset indices at stream positions [start, end), read on from where `sampler` stands (at most
    `start`); its state is left as it was."""
    state, skipped = sampler.state_dict(), sampler.skipped
    sampler.skipped, out = [], []
    try:
        while sampler.consumed_samples < end:
            batch = sampler.next_global_batch()
            if sampler.consumed_samples > start:
                out.append(batch)
    finally:
        sampler.load_state_dict(state)
        sampler.skipped = skipped
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def check_batch_shape(global_batch_size: int, micro_batch_size: int, dp_size: int) -> None:
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} x dp {dp_size}"
        )


@dataclass
class ResumableSampler:
    num_samples: int
    global_batch_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    consumed_samples: int = 0
    skipped: list[list[int]] = field(default_factory=list)  # [start, end) positions read and not trained on

    def __post_init__(self) -> None:
        check_batch_shape(self.global_batch_size, self.micro_batch_size, self.dp_size)
        self.skipped = merge_ranges(self.skipped)
        self.stream = ShuffledStream(self.num_samples, self.seed)

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [start, start + count), crossing epochs as needed."""
        return self.stream.indices(start, count)

    def next_global_batch(self) -> np.ndarray:
        """The next global batch's dataset indices; advances the state."""
        indices = self.global_indices(self.consumed_samples, self.global_batch_size)
        self.consumed_samples += self.global_batch_size
        return indices

    def next_micro_batches(self) -> list[np.ndarray]:
        """This rank's micro-batches (dataset indices) of the next global batch not skipped; advances the state."""
        skip_ahead(self)
        return rank_slice(self.next_global_batch(), self.dp_rank, self.dp_size, self.micro_batch_size)

    def describe(self, indices: np.ndarray) -> list[int]:
        """Dataset indices as metrics.jsonl records them."""
        return indices.tolist()

    def progress(self) -> dict[str, int]:
        """What each step's metrics record of the data read so far."""
        return {"consumed_samples": self.consumed_samples}

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, **({"skipped": self.skipped} if self.skipped else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved position; the saved skipped ranges join those this run was given."""
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped = merge_ranges(self.skipped, state.get("skipped", []))
