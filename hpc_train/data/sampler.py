"""A deterministic, resumable sampler.

The global sample order is a seeded permutation of the dataset per epoch, concatenated epoch after
epoch into one stream. Global batch g is stream positions [g * G, (g + 1) * G); data-parallel rank r
reads the contiguous slice r of it and splits that into micro-batches. The whole state is the number
of consumed samples, so resuming at sample k reproduces the same batches, and the global batches are
the same whatever the data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        check_batch_shape(self.global_batch_size, self.micro_batch_size, self.dp_size)
        self.stream = ShuffledStream(self.num_samples, self.seed)

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [start, start + count), crossing epochs as needed."""
        return self.stream.indices(start, count)

    def next_micro_batches(self) -> list[np.ndarray]:
        """This rank's micro-batches (dataset indices) of the next global batch; advances the state."""
        per_rank = self.global_batch_size // self.dp_size
        indices = self.global_indices(self.consumed_samples + self.dp_rank * per_rank, per_rank)
        self.consumed_samples += self.global_batch_size
        return np.split(indices, per_rank // self.micro_batch_size)

    def progress(self) -> dict[str, int]:
        """What each step's metrics record of the data read so far."""
        return {"consumed_samples": self.consumed_samples}

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
