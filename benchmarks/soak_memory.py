"""RSS over a long run of tiny steps: does anything grow with the step count? (issue 14)

Run: python benchmarks/soak_memory.py [--steps 20000] [--offload]

Trains a 2-layer 8-wide MLP on 4×4 inputs (batch 4) so that a step costs almost nothing but the
engine's own bookkeeping, and prints the RSS growth (MiB) from step --steps/10 to a few later steps.
Before the history was bounded (engine/history.py): +25.3 MiB without offload, +41.8 MiB with
--offload (2.4 KiB per step) over 18,000 steps; after: +0.13 MiB with offload.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import psutil

from engine.backend import get_backend
from engine.data.datasets import Dataset
from engine.optim import make_optimizer
from engine.train import Trainer, TrainingListener
from models import build_model


class RssAt(TrainingListener):
    def __init__(self, steps: list[int]):
        self.steps, self.rss = set(steps), {}

    def on_step_end(self, trainer, record) -> None:
        if record.step in self.steps:
            self.rss[record.step] = psutil.Process().memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--offload", action="store_true", help="with --offload-n 1 (swap directory in the temp dir)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 4, 4), dtype=np.float32)
    y = rng.integers(0, 2, 64)
    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=2, backend=backend, input_shape=(1, 4, 4), hidden=8, depth=2)
    opt = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
    session = None
    if args.offload:
        from engine.offload.session import session_from_options

        session = session_from_options(net, 4, "1", None, tempfile.gettempdir())
    marks = [args.steps // 10, args.steps // 4, args.steps // 2, args.steps - 1]
    rss = RssAt(marks)
    trainer = Trainer(net, opt, Dataset("tiny", x, y, x[:8], y[:8], 2, channels=1), batch_size=4,
                      steps=args.steps, prefetch=0, listeners=[rss], evaluate_at_end=False, offload=session)
    start = time.perf_counter()
    trainer.fit()
    growth = {step: round((rss.rss[step] - rss.rss[marks[0]]) / 2**20, 3) for step in marks}
    print(json.dumps({"steps": args.steps, "offload": args.offload, "seconds": round(time.perf_counter() - start, 1),
                      "rss_growth_mib_since_step": marks[0], "growth": growth}))


if __name__ == "__main__":
    main()
