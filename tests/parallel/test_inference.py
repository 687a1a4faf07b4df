"""ParallelInference under concurrency: every caller gets its own rows' logits (reference: net.predict)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.parallel.inference import ParallelInference
from engine.threads import threads
from models import build_model


def factory():
    return build_model("cnn", 5, "cpu", seed=3, image_size=8, width=4)


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_every_caller_gets_its_own_logits_under_concurrency(mode):
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((int(rng.integers(1, 5)), 3, 8, 8), dtype=np.float32) for _ in range(48)]
    with threads(1):
        reference_net = factory()
        expected = [reference_net.predict(x) for x in requests]
        answers: dict[int, np.ndarray] = {}
        with ParallelInference(factory, workers=2, mode=mode, max_batch=8, max_wait_ms=5, queue_limit=4,
                               threads_per_worker=1) as pi:
            def caller(first: int) -> None:
                for i in range(first, len(requests), 6):
                    answers[i] = pi.predict(requests[i], timeout=60)

            callers = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
            for t in callers:
                t.start()
            for t in callers:
                t.join(60)
            stats = pi.stats
    assert sorted(answers) == list(range(len(requests)))
    worst = max(float(np.max(np.abs(answers[i] - expected[i]))) for i in answers)
    # batched rows go through GEMMs with more rows than the request alone: summation-order noise only
    # (measured 6.0e-8 on this cnn)
    assert worst < 1e-5, worst
    assert all(answers[i].shape == expected[i].shape for i in answers)
    assert stats.requests == len(requests)
    if mode == "sequential":
        assert stats.batches == len(requests)
        assert all(np.array_equal(answers[i], expected[i]) for i in answers)  # alone: the same bits
    else:
        assert stats.batches < len(requests) and stats.mean_batch_rows <= 8  # requests were batched


def test_replicas_read_the_first_networks_weights_and_errors_reach_the_caller():
    with threads(1), ParallelInference(factory, workers=2, max_batch=4, threads_per_worker=1) as pi:
        first, second = pi.nets
        assert second.parameters is first.parameters
        views = second.graph.nodes[0].layer.params.values()
        assert all(np.shares_memory(view, first.parameters.flat) for view in views)
        first.parameters.flat[:] = 0  # weights changed in the first network are what every worker uses
        x = np.ones((2, 3, 8, 8), np.float32)
        assert np.array_equal(pi.predict(x), first.predict(x))
        with pytest.raises(ValueError, match="expected input of shape"):
            pi.predict(np.ones((2, 3, 4, 4), np.float32))


def test_every_cpu_kernel_releases_the_gil():
    """Worker threads compute at once only if no kernel holds the GIL (inlined helpers excepted)."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import kernels.cpu

    found, holding = 0, []
    for module_info in pkgutil.iter_modules(kernels.cpu.__path__):
        module = importlib.import_module(f"kernels.cpu.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == module.__name__:
                if value.targetoptions.get("inline", "never") == "always":
                    continue
                found += 1
                if not value.targetoptions.get("nogil"):
                    holding.append(f"{module.__name__}.{name}")
    assert found > 40 and holding == []
