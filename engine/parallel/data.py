"""Shards: which rows of every global batch a rank trains on, and which evaluation batches it scores.

``--batch-size B`` is per worker, as in DL4J's ParallelWrapper and PyTorch DDP: with K workers a
step consumes a global batch of K·B examples, batch ``(epoch, index)`` of a ``BatchSource`` whose
batch size is K·B, and rank r takes rows ``r·B .. (r+1)·B - 1`` of it. Everything random is a pure
function of (seed, epoch, index) (``engine.data.batches``), including the augmentation, which is
drawn for the K·B rows and sliced, so K ranks together see exactly the batch one process would see
with ``--batch-size K·B``; averaging their gradients gives that process's gradient up to float32
summation order (``tests/parallel``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.data.batches import BatchSource


class ShardedBatchSource(BatchSource):
    """Shard ``rank`` of ``workers``: rows of the batches of a source whose batch size is ``batch_size·workers``."""

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        mean: np.ndarray,
        std: np.ndarray,
        batch_size: int,
        channels: int = 3,
        shuffle: bool = True,
        augment: bool = False,
        seed: int = 0,
        *,
        rank: int,
        workers: int,
    ):
        if not 0 <= rank < workers:
            raise ValueError(f"rank {rank} is not one of {workers} workers")
        if batch_size * workers > len(y):
            raise ValueError(
                f"the global batch ({workers} workers × --batch-size {batch_size} = {batch_size * workers}) is larger "
                f"than the data set ({len(y)} examples): give a smaller --batch-size"
            )
        super().__init__(x, y, mean, std, batch_size * workers, channels, shuffle, augment, seed, drop_last=True)
        self.global_batch_size = batch_size * workers
        self.batch_size = batch_size  # what a rank's batches hold: batch_shape and the rings follow it
        self.rank, self.workers = rank, workers

    def indices(self, epoch: int, index: int) -> np.ndarray:
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch {index} out of range: an epoch has {self.batches_per_epoch} batches")
        start = index * self.global_batch_size + self.rank * self.batch_size
        return self.order(epoch)[start : start + self.batch_size]

    def valid_rows(self, index: int) -> int:
        return self.batch_size

    def augment_rows(self) -> tuple[int, int]:
        """The whole global batch's augmentation draws, this shard's rows of them (``BatchSource.fill``)."""
        return self.global_batch_size, self.rank * self.batch_size


class StridedSource:
    """Batches ``rank, rank + K, rank + 2K, ...`` of an evaluation source, as a source of their own.

    Evaluation shards whole batches, not rows: every batch then has the composition and padding it
    has in a one-process pass, so its logits (and so accuracy, the confusion matrix and the per-batch
    losses) are the same bits, and the reduced result equals one worker's exactly.
    """

    def __init__(self, source: BatchSource, rank: int, workers: int):
        self.source, self.rank, self.workers = source, rank, workers
        total = source.batches_per_epoch
        self.batches_per_epoch = max(0, -(-(total - rank) // workers))
        self.batch_size = source.batch_size

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        return self.source.batch_shape

    def global_index(self, index: int) -> int:
        return self.rank + index * self.workers

    def valid_rows(self, index: int) -> int:
        return self.source.valid_rows(self.global_index(index))

    def fill(self, epoch: int, index: int, x_out: Any, y_out: Any) -> None:
        self.source.fill(epoch, self.global_index(index), x_out, y_out)

    def close(self) -> None:
        """Stops the wrapped source's decoding threads (image folders), as BatchStream.close() expects."""
        release = getattr(self.source, "close", None)
        if release is not None:
            release()
