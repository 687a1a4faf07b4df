"""What the data-parallel stop agreement costs a step (``engine.parallel.wrapper.AgreedStop``): its per-step question,
a 4-byte ``Iallreduce`` (MAX) polled by ``wait_all`` plus a look for the launcher's stop note, timed on its own.

    mpiexec -n 2 python benchmarks/stop_agreement.py [--calls 2000]

Each rank runs ``AgreedStop._ask`` ``--calls`` times back to back (the ranks in step, as after a training step's
gradient allreduce) and rank 0 prints the median and the 99th percentile per call in microseconds. The figure is an
upper bound on what it adds to a step: in training the ranks arrive at it together, right after the step's own
allreduce of the gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from mpi4py import MPI

    from engine.parallel.wrapper import AgreedStop

    comm = MPI.COMM_WORLD
    stop = AgreedStop(SimpleNamespace(received=None), SimpleNamespace(comm=comm, trainer=None))
    times = []
    comm.Barrier()
    for _ in range(args.calls):
        start = time.perf_counter()
        stop._ask()
        times.append(time.perf_counter() - start)
    if comm.rank == 0:
        times.sort()
        print(f"{comm.size} ranks, {args.calls} calls: median {statistics.median(times) * 1e6:.1f} µs, "
              f"99th percentile {times[int(0.99 * len(times))] * 1e6:.1f} µs per step's question")


if __name__ == "__main__":
    main()
