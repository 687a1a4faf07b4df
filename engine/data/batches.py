"""Batches: which examples go into batch (epoch, index), and how they are written into memory.

Everything random here is a pure function of (seed, epoch, index): the epoch's shuffle comes from a
generator seeded with (seed, epoch), a batch's augmentation from one seeded with (seed, epoch,
index). So a batch's contents never depend on who fills it (the prefetch thread or the training
loop) or on what was filled before, and resuming at step k needs only k, not a generator's history.
"""

from __future__ import annotations

import threading

import numpy as np

CROP_PADDING = 4


class BatchSource:
    """Fixed-size batches of one split: ``fill(epoch, index, x_out, y_out)`` writes one in place.

    ``x_out`` receives normalized float32 N×C×H×W images ((x - mean) / std per channel), ``y_out``
    int64 labels. The training split drops the last incomplete batch (every step then has the same
    shapes, so the workspaces learn one size); ``drop_last=False`` pads the last batch by repeating
    its first examples and reports how many rows are real (``valid_rows``).
    """

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
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if drop_last and batch_size > len(y):
            raise ValueError(f"batch size {batch_size} is larger than the data set ({len(y)} examples)")
        self.x, self.y = x, y
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
        self.inv_std = (1.0 / np.asarray(std, dtype=np.float32)).reshape(-1, 1, 1)
        self.batch_size = batch_size
        self.channels = channels
        self.shuffle, self.augment, self.seed, self.drop_last = shuffle, augment, seed, drop_last
        n = len(y)
        self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._order_lock = threading.Lock()
        self._scratch = threading.local()  # per filling thread: gather buffer and padded image

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.channels, int(self.x.shape[2]), int(self.x.shape[3]))

    def order(self, epoch: int) -> np.ndarray:
        """The example indices of ``epoch``, in the order they are served."""
        with self._order_lock:
            if self._order_cache is None or self._order_cache[0] != epoch:
                n = len(self.y)
                order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
                self._order_cache = (epoch, order)
            return self._order_cache[1]

    def valid_rows(self, index: int) -> int:
        """How many rows of batch ``index`` are real examples (the rest is padding)."""
        return min(self.batch_size, len(self.y) - index * self.batch_size)

    def indices(self, epoch: int, index: int) -> np.ndarray:
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch {index} out of range: an epoch has {self.batches_per_epoch} batches")
        chosen = self.order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        if len(chosen) < self.batch_size:  # last batch of an evaluation pass: pad with repeats
            chosen = np.resize(chosen, self.batch_size)
        return chosen

    def augment_rows(self) -> tuple[int, int]:
        """(rows drawn, first row used) of a batch's augmentation draws; (0, 0): as many as x_out has, from 0.

        A data-parallel shard draws for the whole global batch and uses its own rows
        (``engine.parallel.data.ShardedBatchSource``), so the one ``fill`` serves both."""
        return 0, 0

    def fill(self, epoch: int, index: int, x_out: np.ndarray, y_out: np.ndarray) -> None:
        """Write batch ``index`` of ``epoch`` into ``x_out`` (float32) and ``y_out`` (int64)."""
        chosen = self.indices(epoch, index)
        if isinstance(self.x, np.ndarray):
            gather = self._gather_buffer()
            np.take(self.x, chosen, axis=0, out=gather)
        else:  # images made on demand (engine.data.datasets.SyntheticImages), straight into the batch
            gather = self.x.take(chosen, out=x_out)
        np.take(self.y, chosen, axis=0, out=y_out)
        # (x - mean) * (1/std), broadcasting one stored channel to three for grayscale sets
        np.subtract(gather, self.mean, out=x_out, casting="unsafe")
        np.multiply(x_out, self.inv_std, out=x_out)
        if self.augment:
            drawn, first = self.augment_rows()
            self._augment(np.random.default_rng([self.seed, epoch, index, 1]), x_out, drawn, first)

    def _gather_buffer(self) -> np.ndarray:
        buffer = getattr(self._scratch, "gather", None)
        if buffer is None:
            buffer = np.empty((self.batch_size, *self.x.shape[1:]), dtype=self.x.dtype)
            self._scratch.gather = buffer
        return buffer

    def _augment(self, rng: np.random.Generator, x: np.ndarray, drawn: int = 0, first: int = 0) -> None:
        """Random crop with 4 pixels of zero padding (the mean, after normalization) and horizontal flip.

        ``drawn`` rows of random numbers are drawn (default: x's rows) and rows ``first ..`` of them are
        used (``augment_rows``): a data-parallel shard of a batch then gets the very crops and flips that
        its rows get in the whole batch (``engine.parallel.data``)."""
        n, c, h, w = x.shape
        p = CROP_PADDING
        padded = getattr(self._scratch, "padded", None)
        if padded is None or padded.shape != (c, h + 2 * p, w + 2 * p):
            padded = np.zeros((c, h + 2 * p, w + 2 * p), dtype=np.float32)
            self._scratch.padded = padded
        drawn = max(drawn, first + n)
        offsets = rng.integers(0, 2 * p + 1, size=(drawn, 2))[first : first + n]
        flips = (rng.random(drawn) < 0.5)[first : first + n]
        for i in range(n):
            padded[:, p : p + h, p : p + w] = x[i]  # the border stays zero
            dy, dx = offsets[i]
            crop = padded[:, dy : dy + h, dx : dx + w]
            x[i] = crop[:, :, ::-1] if flips[i] else crop


def step_position(step: int, batches_per_epoch: int) -> tuple[int, int]:
    """The (epoch, batch index) of global training step ``step``."""
    return divmod(step, batches_per_epoch)
