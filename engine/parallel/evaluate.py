"""Sharded evaluation: K ranks score disjoint batches and reduce to exactly one worker's result.

Rank r scores batches r, r + K, r + 2K, ... of the one-process pass (``StridedSource``): the same
batches, padded the same way, so each batch's logits are the same bits as in one process. The
confusion matrix, the top-5 hits and the example count are integers (summed with one ``Allreduce``);
the loss is a float sum that depends on order, so every rank's per-batch sums are gathered and added
in batch order, as ``Scorer`` adds them in one process. Result: identical to ``engine.evaluate``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.data.datasets import Dataset
from engine.data.prefetch import BatchStream
from engine.evaluate import Evaluation, Scorer, top5
from engine.parallel.comm import wait_all
from engine.parallel.data import StridedSource


def evaluate_sharded(
    net: Any, data: Dataset, backend: Any, comm: Any, batch_size: int = 64, split: str = "test"
) -> Evaluation:
    """``engine.evaluate.evaluate`` over ``comm``'s ranks; every rank returns the same Evaluation."""
    from mpi4py import MPI

    y = data.y_test if split == "test" else data.y_train
    batch_size = min(batch_size, len(y))
    source = data.batch_source(split, batch_size, shuffle=False, augment=False, drop_last=False)  # image folders too
    shard = StridedSource(source, comm.rank, comm.size)
    scorer = Scorer(data.num_classes, batch_size)
    logits = np.empty((batch_size, data.num_classes), dtype=np.float32)
    per_rank = -(-source.batches_per_epoch // comm.size)
    losses = np.zeros(per_rank, dtype=np.float64)
    if shard.batches_per_epoch:
        with BatchStream(shard, backend, 0, shard.batches_per_epoch, depth=1, name="eval-input") as stream:
            for j, batch in enumerate(stream):
                net.predict(batch.x, out=logits)
                losses[j] = scorer.add(logits, batch.y_host, batch.valid_rows)
    counts = np.array([scorer.top5_hits, scorer.examples], dtype=np.int64)
    gathered = np.empty((comm.size, per_rank), dtype=np.float64)
    wait_all([comm.Iallreduce(MPI.IN_PLACE, scorer.confusion, op=MPI.SUM),  # polled: a rank lost meanwhile ends it
              comm.Iallreduce(MPI.IN_PLACE, counts, op=MPI.SUM), comm.Iallgather(losses, gathered)])
    loss_sum = 0.0
    for index in range(source.batches_per_epoch):  # batch order, as one process adds them
        loss_sum += float(gathered[index % comm.size, index // comm.size])
    examples = int(counts[1])
    n = max(examples, 1)
    return Evaluation(
        examples=examples,
        accuracy=float(np.trace(scorer.confusion)) / n,
        top5_accuracy=top5(int(counts[0]), examples, data.num_classes),
        loss=loss_sum / n,
        confusion=scorer.confusion,
    )
