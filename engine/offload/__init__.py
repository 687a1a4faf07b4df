"""Disk offload of layer windows: a training step keeps N layers' saved tensors in memory, the rest on disk.

    from engine.offload import OffloadScheduler
    with OffloadScheduler(backend, window=4).attach(net, batch_size=32) as scheduler:
        ...train as usual...            # scheduler.stats: per-step window, resident/in-flight/swapped bytes

``plan`` decides where every unit lives (arena offsets, swap-file offsets, spans extended by the
window), ``scheduler`` runs the loader and saver threads beside the executor, ``storage`` is the
private swap file, ``staging`` the GPU path through pinned buffers, ``params`` keeps the optimizer
state on disk between updates, ``session`` is the Trainer's plug (the ``engine bench`` measurements
are in ``engine.bench.offload``). The plan reads the network's step program (``engine.program``);
offload learns what it needs of the network and the trainer through Protocols (``OffloadTarget``,
``OffloadHost``) and imports neither.
"""

from engine.offload.plan import OffloadPlan, build_plan, check_plan, program_units
from engine.offload.scheduler import LayerState, OffloadError, OffloadScheduler, StepStats, offload_summary
from engine.offload.session import OffloadConfig, OffloadSession
from engine.offload.storage import OffloadStorageError, SwapChecksumError, SwapStorage, parse_bytes

__all__ = [
    "LayerState",
    "OffloadConfig",
    "OffloadError",
    "OffloadPlan",
    "OffloadScheduler",
    "OffloadSession",
    "OffloadStorageError",
    "StepStats",
    "SwapChecksumError",
    "SwapStorage",
    "build_plan",
    "check_plan",
    "offload_summary",
    "parse_bytes",
    "program_units",
]
