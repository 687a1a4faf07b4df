"""Evaluation: accuracy, top-5 accuracy, mean loss and the confusion matrix over one split.

Batches come from the same circular INPUT ring the trainer uses and run through ``net.predict``
(inference mode), so after the first batch has taught the workspaces their sizes, evaluating
allocates no workspace memory. The last batch is padded to full size (the workspaces keep one
shape) and only its real rows are counted. Scoring happens on the host in buffers made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.datasets import Dataset
from engine.data.prefetch import BatchStream


@dataclass
class Evaluation:
    """Scores of one pass; ``confusion[true, predicted]`` counts examples."""

    examples: int
    accuracy: float
    top5_accuracy: float | None  # None with 5 classes or fewer: every label is then in the top 5
    loss: float
    confusion: np.ndarray
    input_ring_bytes: int = 0  # the INPUT ring the batches came through (outside the network's managers)

    def per_class_accuracy(self) -> np.ndarray:
        totals = self.confusion.sum(axis=1)
        return np.diag(self.confusion) / np.maximum(totals, 1)


class Scorer:
    """Accumulates predictions batch by batch into buffers allocated once."""

    def __init__(self, num_classes: int, batch_size: int):
        self.num_classes = num_classes
        self.confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
        self.top5_hits = 0
        self.loss_sum = 0.0
        self.examples = 0
        self._predicted = np.empty(batch_size, dtype=np.int64)
        self._true_logit = np.empty(batch_size, dtype=np.float32)
        self._greater = np.empty((batch_size, num_classes), dtype=bool)
        self._rows = np.arange(batch_size)

    def add(self, logits: np.ndarray, labels: np.ndarray, valid_rows: int) -> float:
        """Count one batch; returns its summed loss (a sharded evaluation adds these up in batch order)."""
        n = valid_rows
        logits, labels = logits[:n], labels[:n]
        np.argmax(logits, axis=1, out=self._predicted[:n])
        np.add.at(self.confusion, (labels, self._predicted[:n]), 1)
        # top-5: the true class is among the five largest when fewer than five logits beat it
        true_logit = self._true_logit[:n]
        np.copyto(true_logit, logits[self._rows[:n], labels])
        greater = self._greater[:n]
        np.greater(logits, true_logit[:, None], out=greater)
        self.top5_hits += int(np.count_nonzero(greater.sum(axis=1) < 5))
        # cross-entropy from the logits, in float64 for a stable mean
        shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=1))
        batch_loss = float((log_norm - shifted[self._rows[:n], labels]).sum())
        self.loss_sum += batch_loss
        self.examples += n
        return batch_loss

    def result(self) -> Evaluation:
        n = max(self.examples, 1)
        return Evaluation(
            examples=self.examples,
            accuracy=float(np.trace(self.confusion)) / n,
            top5_accuracy=top5(self.top5_hits, n, self.num_classes),
            loss=self.loss_sum / n,
            confusion=self.confusion,
        )


def top5(hits: int, examples: int, num_classes: int) -> float | None:
    """Top-5 accuracy, or None where it means nothing: with 5 classes or fewer every label is in the top 5."""
    return hits / max(examples, 1) if num_classes > 5 else None


def evaluate(
    net: Any, data: Dataset, backend: Any, batch_size: int = 64, split: str = "test", listener: Any = None
) -> Evaluation:
    """Score ``net`` on ``data``'s ``split`` ("test" or "train") in inference mode."""
    x, y = (data.x_test, data.y_test) if split == "test" else (data.x_train, data.y_train)
    batch_size = min(batch_size, len(y))
    source = data.batch_source(split, batch_size, shuffle=False, augment=False, drop_last=False)
    scorer = Scorer(data.num_classes, batch_size)
    logits = np.empty((batch_size, data.num_classes), dtype=np.float32)  # host logits, reused every batch
    with BatchStream(source, backend, 0, source.batches_per_epoch, depth=1, name="eval-input") as stream:
        ring_bytes = stream.workspace.capacity
        for batch in stream:
            net.predict(batch.x, out=logits)
            scorer.add(logits, batch.y_host, batch.valid_rows)
            if listener is not None:
                listener(batch)
    result = scorer.result()
    result.input_ring_bytes = ring_bytes
    return result
