"""What the data-parallel stop agreement costs a step (``engine.parallel.wrapper.AgreedStop``): its per-step question,
a 4-byte ``Iallreduce`` (MAX) polled by ``wait_all`` plus a look for the launcher's stop note, timed on its own.

    mpiexec -n 2 python benchmarks/stop_agreement.py [--calls 2000]

Each rank runs ``AgreedStop._ask`` ``--calls`` times back to back (the ranks in step, as after a training step's
gradient allreduce) and rank 0 prints the median and the 99th percentile per call in microseconds. The reference,
timed in the same run: the step's own gradient allreduce, one ``Iallreduce`` of ResNet-18's 11.2 M float32 gradients
through the same polled ``wait_all`` (``--gradient-floats``; the engine sends it in buckets, overlapped with
backward), and the ratio of the two medians. The question is an upper bound on what the agreement adds to a step: in
training the ranks arrive at it together, right after the gradients' allreduce.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--gradient-floats", type=int, default=11_173_962, help="the reference allreduce's size")
    parser.add_argument("--gradient-calls", type=int, default=20)
    args = parser.parse_args()
    import numpy as np
    from mpi4py import MPI

    from engine.parallel.comm import wait_all
    from engine.parallel.wrapper import AgreedStop

    comm = MPI.COMM_WORLD
    stop = AgreedStop(SimpleNamespace(received=None), SimpleNamespace(comm=comm, trainer=None))
    times = []
    comm.Barrier()
    for _ in range(args.calls):
        start = time.perf_counter()
        stop._ask()
        times.append(time.perf_counter() - start)
    gradients = np.ones(args.gradient_floats, np.float32)
    reference = []
    comm.Barrier()
    for _ in range(args.gradient_calls):
        start = time.perf_counter()
        wait_all([comm.Iallreduce(MPI.IN_PLACE, gradients, op=MPI.SUM)])
        reference.append(time.perf_counter() - start)
    if comm.rank == 0:
        times.sort()
        question, allreduce = statistics.median(times), statistics.median(reference)
        print(f"{comm.size} ranks, {args.calls} calls: median {question * 1e6:.1f} µs, "
              f"99th percentile {times[int(0.99 * len(times))] * 1e6:.1f} µs per step's question; "
              f"the gradients' allreduce ({args.gradient_floats:,} floats) {allreduce * 1e3:.1f} ms median: "
              f"the question is {question / allreduce:.4f}× it")


if __name__ == "__main__":
    main()
