"""The trainer end to end: accuracy on digits, steady-state memory, determinism, prefetch, evaluation."""

import numpy as np
import pytest

from engine.backend import get_backend
from engine.data import load_dataset
from engine.evaluate import Scorer, evaluate
from engine.optim import make_optimizer
from engine.threads import threads
from engine.train import StepRecord, Trainer, TrainingDiverged, TrainingListener
from models import build_model


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def make_trainer(backend, data, model="cnn", lr=0.01, optimizer="sgd", seed=0, **kwargs):
    options = kwargs.pop("model_options", {})
    net = build_model(model, num_classes=data.num_classes, backend=backend, seed=seed, **options)
    opt = make_optimizer(optimizer, net, backend, lr, momentum=0.9, manager=net.mgr)
    options = dict(batch_size=32, seed=seed)
    options.update(kwargs)
    return Trainer(net, opt, data, **options)


@pytest.fixture(scope="module")
def digits_run(backend, digits):
    """The issue's acceptance run: cnn on digits for 3 epochs."""
    trainer = make_trainer(backend, digits, epochs=3)
    with threads(1):
        result = trainer.fit()
    return trainer, result


def test_cnn_on_digits_reaches_95_percent_in_three_epochs(digits_run):
    trainer, result = digits_run
    assert result.steps == 3 * (1438 // 32)
    assert result.test_accuracy >= 0.95, result.test_accuracy
    assert result.evaluation.examples == 359 and result.evaluation.confusion.sum() == 359
    assert result.test_top5_accuracy >= result.test_accuracy
    assert result.final_loss < 0.5


def test_from_the_third_step_on_nothing_is_allocated_or_spilled(digits_run):
    trainer, result = digits_run
    records = [r for r in trainer.monitor.records if r["phase"] == "training"]
    assert len(records) == result.steps
    assert len(trainer.monitor.records) == result.steps + result.phases["evaluation"].samples
    learned = records[1]  # after the second step: the workspaces have learned their sizes
    for record in records[2:]:
        assert record["block_allocations"] == learned["block_allocations"], record["step"]
        assert record["spilled_bytes"] == learned["spilled_bytes"], record["step"]
    assert learned["block_allocations"] > 0 and result.peak_bytes["ACTIVATIONS"] > 0
    assert set(result.peak_bytes) >= {"INPUT", "ACTIVATIONS", "FF_CACHE", "PARAMETERS", "GRADIENTS", "UPDATER_STATE"}


def test_the_summary_has_the_documented_fields(digits_run):
    _, result = digits_run
    summary = result.as_dict()
    for key in ("steps", "seconds", "images_per_second", "final_loss", "test_accuracy", "peak_rss_bytes"):
        assert summary[key] is not None and summary[key] > 0, key
    assert all(isinstance(v, int) and v > 0 for v in summary["peak_bytes"].values())
    assert np.array(summary["confusion_matrix"]).shape == (10, 10)


def test_evaluation_allocates_nothing_after_its_first_batch(backend, digits):
    net = build_model("cnn", num_classes=10, backend=backend, seed=0, width=4)  # never run: nothing learned yet
    mgr = net.inference_mgr
    counters = []

    def after_batch(batch):
        counters.append((mgr.block_allocations(), mgr.spilled_bytes()))

    evaluation = evaluate(net, digits, backend, batch_size=50, listener=after_batch)
    assert len(counters) == 8  # 359 examples in batches of 50, the last one padded
    assert counters[0][0] > 0  # the first batch taught the workspaces their sizes ...
    assert all(c == counters[0] for c in counters[1:])  # ... and no later batch allocated or spilled
    assert evaluation.examples == 359


def test_scorer_against_direct_formulas():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 16)
    scorer = Scorer(7, 16)
    scorer.add(logits, labels, valid_rows=12)
    result = scorer.result()
    logits, labels = logits[:12], labels[:12]
    assert result.accuracy == pytest.approx(np.mean(logits.argmax(1) == labels))
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert result.top5_accuracy == pytest.approx(np.mean([labels[i] in top5[i] for i in range(12)]))
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    assert result.loss == pytest.approx(-np.mean(log_probs[np.arange(12), labels]), rel=1e-6)
    assert result.confusion.sum() == 12 and np.trace(result.confusion) == np.sum(logits.argmax(1) == labels)


def final_weights(backend, data, thread_count=1, **kwargs):
    trainer = make_trainer(
        backend, data, steps=6, batch_size=16, augment=True, evaluate_at_end=False, model_options={"width": 4}, **kwargs
    )
    with threads(thread_count):
        trainer.fit()
    return trainer.net.parameters.flat.copy(), trainer.net.buffers.flat.copy()


@pytest.mark.parametrize("thread_count", [1, 2])
def test_same_seed_same_bits_and_prefetch_changes_nothing(backend, digits, thread_count):
    a = final_weights(backend, digits, thread_count, prefetch=0)
    b = final_weights(backend, digits, thread_count, prefetch=3)
    c = final_weights(backend, digits, thread_count, prefetch=2, seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_listeners_see_every_step_and_epoch(backend):
    data = load_dataset("synthetic", num_classes=3)

    class Recorder(TrainingListener):
        def __init__(self):
            self.calls = []

        def on_train_start(self, trainer):
            self.calls.append("start")

        def on_step_end(self, trainer, record: StepRecord):
            self.calls.append(("step", record.step, record.epoch, record.index))

        def on_epoch_end(self, trainer, epoch):
            self.calls.append(("epoch", epoch))

        def on_train_end(self, trainer, result):
            self.calls.append("end")

    recorder = Recorder()
    trainer = make_trainer(
        backend, data, model="mlp", batch_size=128, steps=6, listeners=[recorder], model_options={"hidden": 16}
    )
    result = trainer.fit()
    steps = [c for c in recorder.calls if c[0] == "step"]
    assert [c[1:] for c in steps] == [(s, s // 4, s % 4) for s in range(6)]
    assert recorder.calls[0] == "start" and recorder.calls[-1] == "end"
    assert ("epoch", 0) in recorder.calls and ("epoch", 1) not in recorder.calls
    assert result.test_accuracy is not None and result.epochs == 1.5


def test_a_diverging_run_stops_with_advice(backend):
    data = load_dataset("synthetic", num_classes=3)
    trainer = make_trainer(backend, data, model="mlp", lr=1e30, batch_size=64, steps=8, model_options={"hidden": 16})
    with pytest.raises(TrainingDiverged, match="the loss became .* try a smaller --lr"):
        trainer.fit()


def test_a_resumed_start_past_the_end_is_refused(backend):
    data = load_dataset("synthetic", num_classes=3)
    with pytest.raises(ValueError, match="cannot start at step 9: the run has 4 steps"):
        make_trainer(backend, data, model="mlp", batch_size=128, steps=4, start_step=9)
