"""Scaling out: data-parallel training on MPI and parallel inference (issue 12).

- ``comm``: the MPI world (joined only when a launcher started us), the ``--workers K`` launcher, and
  ``abort_on_error`` (a failing rank ends the job with one line naming it).
- ``data``: each rank's shard of every global batch; whole-batch shards for evaluation.
- ``allreduce``: gradient buckets averaged with ``Iallreduce`` from the network's ``after_backward``.
- ``wrapper``: ``DataParallel``, the trainer's seam (gradient or parameter averaging, ParallelWrapper's
  semantics), and ``evaluate``: sharded evaluation equal to one worker's.
- ``inference``: ``ParallelInference``, DL4J's batching queue over worker threads.

Nothing here imports mpi4py at import time; ``import engine.parallel`` works without MPI.
"""

from engine.parallel.comm import ParallelError, World, join_world, under_launcher

__all__ = ["ParallelError", "World", "join_world", "under_launcher"]
