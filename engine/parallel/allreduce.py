"""Gradient averaging in buckets, overlapped with backward (PyTorch DDP's and Horovod's scheme).

The network keeps every gradient in one contiguous GRADIENTS block laid out in forward order, and
backward fills it from the end: the last layer's gradients are final first. ``bucket_ranges`` cuts
the block into contiguous buckets of whole layers of about ``bucket_bytes`` each, from the end; a
bucket is complete when the first layer it holds has finished backward. ``GradientAllreduce`` is a
network hook (``net.hooks``): its ``after_backward`` starts a non-blocking ``Iallreduce`` (sum, in
place) of every bucket that layer completes, so the transfer of the late layers' gradients runs
while the early layers still compute; ``on_iteration_end`` (the end of backward, before the
optimizer step) waits for the rest and scales by 1/K. BatchNorm's running statistics (the buffers
block, last written in forward) are averaged in the same way, started at the first backward step.

MPICH makes progress on a non-blocking collective only inside MPI calls (no progress thread unless
``MPIR_CVAR_ASYNC_PROGRESS=1``, which would spend a core polling: on two cores that is half the
machine). So every ``after_backward`` also tests the outstanding requests (``Testall``), which moves
them along between layers. What is left at the end is the exposed communication time plus any wait
for a slower rank, measured per step in ``exposed_seconds``; ``engine.bench.parallel`` sets it beside
the time of a blocking allreduce of the whole block to report (a lower bound of) the fraction hidden
under backward.

The bucket size default follows PyTorch DDP (``bucket_cap_mb=25``): large enough that the per-call
latency of a collective is amortized, small enough that the first bucket starts long before backward
ends (ResNet-18's 44.7 MB of gradients make two buckets; mlp and cnn make one unless told smaller).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine.parallel.comm import check_peers, wait_all

DEFAULT_BUCKET_BYTES = 25 * 2**20


def node_ranges(net: Any) -> list[tuple[int, int, int]]:
    """(node index, first, stop) in elements of the GRADIENTS block, for every node that has parameters."""
    ranges = []
    offsets = net.gradients.offsets
    for node in net.graph.nodes:
        mine = [offsets[node.layer.tensor_key(node.name, spec.name)] for spec in node.layer.parameter_specs()]
        if mine:
            ranges.append((node.index, min(lo for lo, _ in mine), max(hi for _, hi in mine)))
    return ranges


def bucket_ranges(net: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[int, int, int]]:
    """Buckets as (node index that completes it, first, stop), in the order backward completes them.

    Walks the layers from the last; a bucket closes once it holds ``bucket_bytes`` (a layer is never
    split). The buckets tile the block exactly; if the layers' ranges were not back to back (they are,
    by construction of ``Network``), one bucket over the whole block is the safe answer.
    """
    ranges = node_ranges(net)
    size = int(net.gradients.flat.size)
    if not ranges:
        return []
    itemsize = net.gradients.flat.dtype.itemsize
    expected = 0
    for _, lo, hi in ranges:
        if lo != expected:
            return [(ranges[0][0], 0, size)]
        expected = hi
    if expected != size:
        return [(ranges[0][0], 0, size)]
    buckets: list[tuple[int, int, int]] = []
    stop = size
    for index, lo, _hi in reversed(ranges):
        if (stop - lo) * itemsize >= bucket_bytes or index == ranges[0][0]:
            buckets.append((index, lo, stop))
            stop = lo
    return buckets


class GradientAllreduce:
    """A network hook that averages the gradients (and BatchNorm's running statistics) over the world."""

    def __init__(self, net: Any, comm: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if net.gradient_storage != "whole":  # every gradient must arrive summed before any update
            raise ValueError("averaging gradients needs every layer's gradients until the end of backward: "
                             "the network keeps only one layer's (an update in backward); train with "
                             "--update-after-backward")
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.size = comm.size
        self.flat = net.gradients.flat
        self.buffers = net.buffers.flat
        self.buckets = bucket_ranges(net, bucket_bytes)
        self.completes: dict[int, list[tuple[int, int]]] = {}
        for index, lo, hi in self.buckets:
            self.completes.setdefault(index, []).append((lo, hi))
        self.pending: list[Any] = []
        self.scale = np.float32(1.0 / self.size)
        self.exposed_seconds: list[float] = []  # per step: waiting at the end of backward
        self.last_index = net.graph.nodes[-1].index  # backward starts with it

    def _start(self, view: Any) -> None:
        self.pending.append(self.comm.Iallreduce(self.MPI.IN_PLACE, view, op=self.MPI.SUM))

    def _drain(self) -> None:
        if self.pending:
            wait_all(self.pending)  # a Waitall that stops if another rank reports a failure
            self.pending = []

    # --- network hooks -------------------------------------------------------------------------------

    def on_iteration_start(self, net: Any) -> None:
        self._drain()  # an iteration abandoned mid-backward: its collectives must still complete on every rank

    def before_backward(self, step: int, node: Any) -> None:
        if node.index == self.last_index and self.buffers.size:
            self._start(self.buffers)  # running statistics were last written in forward

    def after_backward(self, step: int, node: Any) -> None:
        for lo, hi in self.completes.get(node.index, ()):
            self._start(self.flat[lo:hi])
        if self.pending:
            self.MPI.Request.Testall(self.pending)  # let MPICH move the transfers along between layers
        check_peers()  # another rank failed: stop here instead of at the next wait

    def on_iteration_end(self, net: Any) -> None:
        started = time.perf_counter()
        self._drain()
        self.exposed_seconds.append(time.perf_counter() - started)
        np.multiply(self.flat, self.scale, out=self.flat)
        if self.buffers.size:
            np.multiply(self.buffers, self.scale, out=self.buffers)


def install(net: Any, comm: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GradientAllreduce:
    """Attach a GradientAllreduce to ``net.hooks`` and return it (``uninstall`` removes it)."""
    hook = GradientAllreduce(net, comm, bucket_bytes)
    net.hooks.append(hook)
    return hook


def uninstall(net: Any, hook: GradientAllreduce) -> None:
    if hook in net.hooks:
        net.hooks.remove(hook)
