"""StopSignals: the handler only records; ignored signals stay ignored; handlers are put back."""

from __future__ import annotations

import os
import signal

import pytest

from engine.errors import Interrupted
from engine.signals import StopSignals


def test_the_first_signal_is_recorded_and_nothing_else_happens():
    with StopSignals((signal.SIGUSR1, signal.SIGUSR2)) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR2
        with pytest.raises(Interrupted, match="stopped by SIGUSR2 while testing") as caught:
            stop.check("while testing")
        assert caught.value.exit_code == 128 + signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with StopSignals((signal.SIGUSR1, signal.SIGUSR2)) as stop:
            assert stop.installed == (signal.SIGUSR2,)
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.received is None
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_trainer_stops_between_steps():
    import numpy as np

    from engine.backend import get_backend
    from engine.data.datasets import Dataset
    from engine.optim import make_optimizer
    from engine.train import Trainer
    from models import build_model

    class After:
        received = None

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 1, 4, 4), dtype=np.float32), rng.integers(0, 2, 16)
    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=2, backend=backend, input_shape=(1, 4, 4), hidden=8, depth=1)
    opt = make_optimizer("sgd", net, backend, 0.01, manager=net.mgr)
    stop = After()
    saved = []

    def checkpoint(trainer):
        saved.append(trainer.step)
        if trainer.step == 4:
            stop.received = signal.SIGTERM  # as the handler would, between two steps

    trainer = Trainer(net, opt, Dataset("tiny", x, y, x, y, 2, channels=1), batch_size=2, steps=100, prefetch=0,
                      stop=stop, checkpoint_every=2, on_checkpoint=checkpoint)
    result = trainer.fit()
    assert trainer.step == 4 and trainer.stopped_by == signal.SIGTERM and saved == [2, 4]
    assert result.test_accuracy is None  # no final evaluation of a stopped run
