"""Softmax cross-entropy on the GPU, fused and numerically stable, averaged over the batch.

Forward runs in one block: each thread takes rows tid, tid + threads, ... and for each computes the
row maximum, Σ exp(z − max), the probabilities and the row loss logsumexp(z) − z[label]; the row
losses it owns add up in order, and a shared-memory tree sums the threads' totals. One block keeps
the batch mean deterministic without a second kernel or a scratch buffer; a batch is a few hundred
rows of ten to a thousand classes, small work next to the network. A label outside [0, C) makes
that row's loss NaN (the GPU cannot raise), so the mean shows it.
"""

from __future__ import annotations

import math
from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import MAX_REDUCTION_THREADS, THREADS_PER_BLOCK, blocks_for, launch, reduction_threads
from kernels.cuda.reduce import block_sum


@cuda.jit
def softmax_xent_forward_kernel(logits, labels, probs, loss):
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    N = logits.shape[0]
    C = logits.shape[1]
    acc = float32(0.0)
    for i in range(tid, N, threads):
        row_max = logits[i, 0]
        for j in range(1, C):
            row_max = max(row_max, logits[i, j])
        total = float32(0.0)
        for j in range(C):
            total += math.exp(logits[i, j] - row_max)
        for j in range(C):
            probs[i, j] = math.exp(logits[i, j] - row_max) / total
        label = labels[i]
        if 0 <= label < C:
            acc += math.log(total) - (logits[i, label] - row_max)
        else:
            acc += float32(math.nan)
    total = block_sum(partial, acc)
    if tid == 0:
        loss[0] = total / float32(N)


@cuda.jit
def softmax_xent_backward_kernel(probs, labels, dlogits):
    """dlogits = (probs − onehot(labels)) / N, one thread per element."""
    e = cuda.grid(1)
    N = probs.shape[0]
    C = probs.shape[1]
    if e < N * C:
        i = e // C
        j = e - i * C
        g = probs[i, j]
        if labels[i] == j:
            g -= float32(1.0)
        dlogits[i, j] = g / float32(N)


def softmax_xent_forward(logits: Any, labels: Any, probs: Any, loss: Any) -> None:
    N, C = logits.shape
    if tuple(probs.shape) != (N, C) or tuple(labels.shape) != (N,):
        raise ValueError(f"softmax_xent: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, probs {tuple(probs.shape)}")
    launch(softmax_xent_forward_kernel, 1, reduction_threads(N), logits, labels, probs, loss)


def softmax_xent_backward(probs: Any, labels: Any, dlogits: Any) -> None:
    launch(softmax_xent_backward_kernel, blocks_for(probs.size), THREADS_PER_BLOCK, probs, labels, dlogits)
