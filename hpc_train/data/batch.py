"""What a run samples and trains on: the `Source` protocol every dataset follows (a length, a sample at an
index, an identity for the checkpoint manifest) and the `Batch` a micro-batch is. Context parallelism,
packed documents and blended sources extend these (positions, a source per sample) rather than tuples."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

IGNORE = -100  # a label the loss skips (F.cross_entropy's ignore_index)


class Source(Protocol):
    def __len__(self) -> int:
        """Samples it holds."""
        ...

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Sample `index`: its seq_len + 1 token ids, and which of its seq_len next-token labels the loss
        counts (None: all of them)."""
        ...

    def samples(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """`sample` of each index (one call per batch: a blend looks its sources up at once)."""
        ...

    def identity(self) -> dict:
        """What the checkpoint manifest records so that a resume on other data is refused."""
        ...

    def identity_notes(self) -> list[str]:
        """Log lines for the run's start: what the identity cannot tell apart (no content fingerprint)."""
        ...

    def documents(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len): the document of each input token of each sample, counted from the one
        the sample starts in (0), from the dataset's document offsets."""
        ...


@dataclass(frozen=True)
class Batch:
    """One micro-batch on one rank."""

    tokens: torch.Tensor  # (micro-batch, seq_len) input ids
    labels: torch.Tensor  # (micro-batch, seq_len) next-token targets; IGNORE where the loss mask leaves one out
    # data.reset_position_ids: each token's position in its document (None: its position in the sample)
    positions: torch.Tensor | None = None
    # data.document_mask: each token's document in its sample; attention stays inside one (None: causal only).
    # Whole samples under context parallelism too (Batch.shard)
    documents: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.labels != IGNORE

    def to(self, device: torch.device) -> Batch:
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Batch(*(t if t is None else t.to(device, non_blocking=True) for t in fields))

    def shard(self, shard: SequenceShard | None) -> Batch:
        """This context-parallel rank's positions of every sample (the whole batch without a shard). The
        documents stay whole: each rank's attention masks the keys of every other rank's positions too."""
        if shard is None:
            return self
        at = shard.positions(self.tokens.shape[1] // shard.size, self.tokens.device)
        positions = None if self.positions is None else self.positions[:, at]
        return Batch(self.tokens[:, at], self.labels[:, at], positions, self.documents)


@dataclass(frozen=True)
class SequenceShard:
    """Which positions of each sample a context-parallel rank holds. `zigzag` (the ring's load balance): the
    sequence in 2 x size chunks, rank r holding chunks r and 2 size - 1 - r, so that under a causal mask every
    rank attends to as many keys as every other; otherwise (Ulysses) the contiguous r-th of size shards."""

    size: int
    rank: int
    zigzag: bool

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions, ascending, of a rank's `local_len` tokens."""
        if not self.zigzag:
            return torch.arange(self.rank * local_len, (self.rank + 1) * local_len, device=device)
        chunk = local_len // 2
        first, second = self.rank * chunk, (2 * self.size - 1 - self.rank) * chunk
        return torch.cat([torch.arange(first, first + chunk, device=device),
                          torch.arange(second, second + chunk, device=device)])  # fmt: skip


def collate(
    source: Source, indices: np.ndarray, reset_position_ids: bool = False, document_mask: bool = False
) -> Batch:
    """The samples at `indices` as one batch: inputs, next-token labels, IGNORE where the mask says so; with
    `reset_position_ids` / `document_mask` (data.*), the positions / documents of the packed documents."""
    samples = source.samples(indices)
    rows = torch.from_numpy(np.stack([tokens for tokens, _ in samples]).astype(np.int64))
    labels = rows[:, 1:]
    if samples[0][1] is not None:
        counted = torch.from_numpy(np.stack([mask for _, mask in samples]).astype(bool))
        labels = labels.masked_fill(~counted, IGNORE)
    positions = documents = None
    if reset_position_ids or document_mask:
        docs = source.documents(indices)
        positions = torch.from_numpy(document_positions(docs)) if reset_position_ids else None
        documents = torch.from_numpy(docs) if document_mask else None
    return Batch(rows[:, :-1], labels, positions, documents)


def document_positions(documents: np.ndarray) -> np.ndarray:
    """Each token's position in its document, from (rows, seq_len) document numbers that never decrease
    along a row: 0 at every document start (and at the row's start)."""
    index = np.broadcast_to(np.arange(documents.shape[1]), documents.shape)
    starts = np.ones(documents.shape, dtype=bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
