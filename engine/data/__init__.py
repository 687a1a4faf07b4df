"""Data: data sets read from disk, batches as functions of (seed, epoch, index), and a prefetching stream.

- ``datasets``: ``load_dataset(spec)`` for synthetic, digits, cifar10:DIR, cifar100:DIR, mnist:DIR, npz:FILE
- ``batches``: ``BatchSource`` (shuffle order, normalization, augmentation, written in place)
- ``prefetch``: ``BatchStream`` (a background thread filling a circular INPUT workspace)
"""

from engine.data.batches import BatchSource, step_position
from engine.data.datasets import DATA_SPECS, DataError, Dataset, channel_statistics, load_dataset
from engine.data.prefetch import Batch, BatchStream

__all__ = [
    "DATA_SPECS",
    "Batch",
    "BatchSource",
    "BatchStream",
    "DataError",
    "Dataset",
    "channel_statistics",
    "load_dataset",
    "step_position",
]
