"""Checks that run under ``mpiexec -n 2`` (started by tests/parallel/test_parallel.py, one thread per rank).

``train``: gradient averaging equals one process on the doubled batch (SGD with momentum, Adam; a
model without batch norm), parameter averaging with F=1 equals gradient averaging (plain SGD), every
rank ends with bit-identical weights (cnn with batch norm and augmentation, and parameter averaging
with F=3 over 5 steps), and the sharded evaluation equals one process's. Rank 0 prints one JSON line
with the measured differences; a failed check raises, which ends the job with its message.
``raise DIR`` / ``term DIR``: rank 1 raises (or gets SIGTERM) after its third step while both ranks offload
to swap directories under DIR; the job must end with one message naming rank 1, not hang, and leave
no swap directory on any rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from engine.backend import get_backend
from engine.data.datasets import synthetic
from engine.evaluate import evaluate
from engine.optim import make_optimizer
from engine.parallel.comm import abort_on_error, join_world
from engine.parallel.wrapper import DataParallel
from engine.threads import set_threads
from engine.train import Trainer, TrainingListener
from models import build_network

STEPS = 6


def train(data, model, optimizer, batch_size, world=None, averaging="gradients", frequency=1, momentum=0.9,
          augment=False, steps=STEPS, bucket_bytes=1024, **options):
    backend = get_backend("cpu")
    net = build_network(model, data, backend, seed=0, **options)
    lr = 0.05 if optimizer == "sgd" else 0.01
    opt = make_optimizer(optimizer, net, backend, lr, momentum=momentum, manager=net.mgr)
    parallel = DataParallel(world, averaging, frequency, bucket_bytes=bucket_bytes) if world else None
    trainer = Trainer(net, opt, data, batch_size=batch_size, steps=steps, augment=augment, seed=3, prefetch=0,
                      evaluate_at_end=False, parallel=parallel)
    trainer.fit()
    return net, opt, parallel


def simulate(data, model, optimizer, batch_size, workers, momentum=0.9, steps=STEPS, **options):
    """One process doing what K ranks do: the K shards' gradients, summed in rank order, times 1/K.

    For K=2 this is the very arithmetic of the allreduce (a + b is commutative in IEEE), so the MPI
    run must match it bit for bit: a check far tighter than a tolerance against the doubled batch.
    """
    from engine.parallel.data import ShardedBatchSource

    backend = get_backend("cpu")
    net = build_network(model, data, backend, seed=0, **options)
    lr = 0.05 if optimizer == "sgd" else 0.01
    opt = make_optimizer(optimizer, net, backend, lr, momentum=momentum, manager=net.mgr)
    shards = [ShardedBatchSource(data.x_train, data.y_train, data.mean, data.std, batch_size, data.channels,
                                 True, False, 3, rank=r, workers=workers) for r in range(workers)]
    x = np.empty(shards[0].batch_shape, np.float32)
    y = np.empty(batch_size, np.int64)
    total = np.empty_like(net.gradients.flat)
    for step in range(steps):
        epoch, index = divmod(step, shards[0].batches_per_epoch)
        for r, shard in enumerate(shards):
            shard.fill(epoch, index, x, y)
            net.forward(x, training=True)
            net.loss(y)
            net.backward()
            if r == 0:
                total[...] = net.gradients.flat
            else:
                np.add(total, net.gradients.flat, out=total)
        np.multiply(total, np.float32(1.0 / workers), out=net.gradients.flat)
        opt.step()
    return net


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def check_train(world) -> dict:
    data = synthetic(10, seed=1, train=64, test=40, shape=(3, 8, 8))
    K = world.size
    report: dict = {}
    mlp = {"hidden": 32, "depth": 2}
    for optimizer, momentum in (("sgd", 0.9), ("adam", 0.0)):
        net, opt, parallel = train(data, "mlp", optimizer, 8, world, momentum=momentum, **mlp)
        assert parallel.hook is None and not net.hooks  # removed at the end
        assert not parallel.resynchronized, "ranks diverged"
        if world.rank == 0:
            simulated = simulate(data, "mlp", optimizer, 8, K, momentum=momentum, **mlp)
            assert np.array_equal(net.parameters.flat, simulated.parameters.flat), (
                f"{optimizer}: MPI differs from the simulated allreduce by "
                f"{relative(net.parameters.flat, simulated.parameters.flat):.2e}")
            ref, ref_opt, _ = train(data, "mlp", optimizer, 8 * K, momentum=momentum, **mlp)
            report[f"{optimizer}_vs_one_process"] = relative(net.parameters.flat, ref.parameters.flat)
            if ref_opt.state is not None:
                report[f"{optimizer}_state_vs_one_process"] = relative(opt.state.flat, ref_opt.state.flat)
    grads, _, _ = train(data, "mlp", "sgd", 8, world, momentum=0.0, **mlp)
    params, _, averaging = train(data, "mlp", "sgd", 8, world, "parameters", 1, momentum=0.0, **mlp)
    assert averaging.averages == STEPS, averaging.averages
    report["parameter_averaging_f1_vs_gradients"] = relative(params.parameters.flat, grads.parameters.flat)
    # batch norm, augmentation, several buckets: bit-identical across ranks without a resync
    cnn, _, parallel = train(data, "cnn", "sgd", 4, world, augment=True, width=4)
    assert not parallel.resynchronized, "cnn: ranks diverged"
    _, _, every3 = train(data, "mlp", "adam", 8, world, "parameters", 3, steps=5, **mlp)
    assert every3.averages == 2 and not every3.resynchronized, (every3.averages, every3.resynchronized)
    # sharded evaluation equals one process's, bit for bit (batch 16 over 40 test images: 3 batches, 2 ranks)
    sharded = parallel.evaluate(cnn, data, cnn.backend, batch_size=16)
    single = evaluate(cnn, data, cnn.backend, batch_size=16)
    assert np.array_equal(sharded.confusion, single.confusion)
    assert (sharded.loss, sharded.accuracy, sharded.top5_accuracy, sharded.examples) == (
        single.loss, single.accuracy, single.top5_accuracy, single.examples), (sharded, single)
    digests = {name: float(np.sum(np.abs(a))) for name, a in cnn.state_dict().items() if a.dtype == np.float32}
    gathered = world.comm.allgather(digests)  # small dict of floats: the pickling method is fine here
    assert all(g == gathered[0] for g in gathered), "cnn: state dicts differ across ranks"
    report["eval_loss"] = sharded.loss
    return report


class FailAt(TrainingListener):
    """Rank 1, after its third step: raise (``raise``) or send itself SIGTERM (``term``)."""

    def __init__(self, how: str):
        self.how = how

    def on_step_end(self, trainer, record) -> None:
        if trainer.parallel.world.rank == 1 and record.step == 2:
            if self.how == "term":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises as soon as the signal is delivered
            raise ValueError(f"boom at step {record.step}")


def check_failure(world, how: str, swap_parent: str) -> dict:
    """Both ranks offload to a swap directory under ``swap_parent``; none may be left behind."""
    from engine.offload.session import session_from_options

    data = synthetic(10, seed=1, train=64, test=40, shape=(3, 8, 8))
    backend = get_backend("cpu")
    net = build_network("mlp", data, backend, hidden=16, depth=2)
    opt = make_optimizer("sgd", net, backend, 0.01, manager=net.mgr)
    offload = session_from_options(net, 4, "1", None, swap_parent)
    trainer = Trainer(net, opt, data, batch_size=4, steps=50, prefetch=0, listeners=[FailAt(how)],
                      evaluate_at_end=False, parallel=DataParallel(world), offload=offload)
    trainer.fit()
    return {}


if __name__ == "__main__":
    set_threads(1)
    world = join_world()
    with abort_on_error(world):
        result = check_train(world) if sys.argv[1] == "train" else check_failure(world, sys.argv[1], sys.argv[2])
        if world.is_root:
            print(json.dumps(result), flush=True)
