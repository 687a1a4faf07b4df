"""The training loop: batches in, one optimizer step per batch, listeners told about every step.

    trainer = Trainer(net, optimizer, data, batch_size=32, epochs=1, listeners=[ProgressListener()])
    result = trainer.fit()          # a TrainResult: steps, seconds, images/s, losses, accuracies, memory

A step is ``forward → loss → backward → optimizer.step()``; the network opens and closes the
workspace iteration itself (``engine.network``). Batches come from a ``BatchStream`` (a background
thread filling a circular INPUT ring). Python's cyclic GC stays off during steps and runs every K
steps (``GcPolicy``): the step allocates almost nothing, so collecting inside it is only cost.

Steps are counted globally: step s is batch ``s % batches_per_epoch`` of epoch
``s // batches_per_epoch``, and the learning rate is ``schedule(s)``. A trainer built with
``start_step=k`` (after ``engine.checkpoint.restore``) therefore continues exactly where an
uninterrupted run would be.

Listeners (``TrainingListener``) see ``on_train_start``, ``on_step_end(record)``, ``on_epoch_end``
and ``on_train_end(result)``; the ones here keep the score, time the steps, sample memory, and draw
the progress bar.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.data.batches import BatchSource, step_position
from engine.data.datasets import Dataset
from engine.data.prefetch import Batch, BatchStream
from engine.errors import UserError
from engine.evaluate import Evaluation, evaluate
from engine.memory.monitor import GcPolicy, MemoryMonitor
from engine.network import Network
from engine.optim import Optimizer
from engine.train_options import TrainOptions


class TrainingDiverged(UserError, RuntimeError):
    """The loss became NaN or infinite: the message says at which step and what to try."""


@dataclass
class StepRecord:
    """What one step did: its loss, how many of its examples it got right, how long it took."""

    step: int
    epoch: int
    index: int
    loss: float
    correct: int
    examples: int
    lr: float
    seconds: float


@dataclass
class PhaseMemory:
    """Memory of one phase of a run (training steps, or the evaluation after them), as the monitor saw it."""

    peak_rss_bytes: int  # the kernel's RSS high-water mark over the phase (engine.memory.monitor.RssHighWater)
    peak_bytes: dict[str, int] = field(default_factory=dict)  # ArrayType -> most bytes in use at a sample
    samples: int = 0  # monitor lines of the phase (steps, or evaluation batches)


@dataclass
class TrainResult:
    """The summary of a run (``--summary-json`` writes ``as_dict()``).

    Figures that need more steps than the run had are None (printed "n/a"), never a made-up 0.
    """

    steps: int  # steps run by this fit() call
    final_step: int  # global step count at the end (more than `steps` after a resume)
    epochs: float
    batch_size: int
    seconds: float
    images_per_second: float
    steady_images_per_second: float | None  # without the first two steps (kernel compilation, workspace learning)
    final_loss: float  # mean loss of the last `loss_window` steps
    train_accuracy: float  # running accuracy over the last epoch's steps (`accuracy_steps` of them)
    test_accuracy: float | None
    test_top5_accuracy: float | None
    test_loss: float | None
    peak_rss_bytes: int  # the whole process's peak RSS
    peak_bytes: dict[str, int] = field(default_factory=dict)  # training steps' peak bytes per ArrayType
    peak_rss_phase: str = "training"  # where peak_rss_bytes came from: setup, training or evaluation
    phases: dict[str, PhaseMemory] = field(default_factory=dict)  # setup / training / evaluation
    offload: dict[str, Any] | None = None  # measured offload figures (OffloadSession.summary())
    loss_window: int = 0  # how many steps final_loss averages
    accuracy_steps: int = 0  # how many steps train_accuracy counts
    num_classes: int = 0
    evaluation: Evaluation | None = None
    # where the wall time went (issue 33: the summary's one "time" omitted the up-front compile)
    first_step_seconds: float | None = None  # the first step of this fit(): kernels loaded, workspaces learned
    evaluation_seconds: float | None = None  # the evaluation after the last step
    compile_seconds: float | None = None  # kernels compiled before the first step (engine.warmup; set by the CLI)

    @property
    def at_chance(self) -> bool:
        """Test accuracy no better than guessing (within 1.5× of 1/classes): the summary then gives a hint."""
        return (self.test_accuracy is not None and self.num_classes > 1
                and self.test_accuracy <= 1.5 / self.num_classes)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("evaluation")
        data["at_chance"] = self.at_chance
        if self.evaluation is not None:
            data["confusion_matrix"] = self.evaluation.confusion.tolist()
        return data


# --- listeners -------------------------------------------------------------------------------------


class TrainingListener:
    """Base class: override what you need. All calls happen in the training thread, between steps."""

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        pass

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        pass

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        pass

    def on_train_abort(self, trainer: Trainer, error: BaseException) -> None:
        """fit() is raising ``error`` (a diverging loss, a disk fault): release what on_train_start took."""


class ScoreListener(TrainingListener):
    """Every step's loss, a running accuracy over the current epoch, and a moving-average loss."""

    def __init__(self, window: int = 10, keep: int = 1024):
        self.window = window
        self.losses: deque[float] = deque(maxlen=keep)  # the latest ``keep`` losses (bounded, issue 14)
        self.recent: deque[float] = deque(maxlen=window)
        self.epoch = -1
        self.epoch_correct = 0
        self.epoch_examples = 0
        self.epoch_steps = 0

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if record.epoch != self.epoch:
            self.epoch, self.epoch_correct, self.epoch_examples, self.epoch_steps = record.epoch, 0, 0, 0
        self.epoch_steps += 1
        self.losses.append(record.loss)
        self.recent.append(record.loss)
        self.epoch_correct += record.correct
        self.epoch_examples += record.examples

    @property
    def recent_loss(self) -> float:
        return float(np.mean(self.recent)) if self.recent else math.nan

    @property
    def running_accuracy(self) -> float:
        return self.epoch_correct / self.epoch_examples if self.epoch_examples else math.nan


class TimingListener(TrainingListener):
    """Seconds per step; images per second over the whole run and without the first two steps.

    Running sums plus the first ``HEAD`` steps, not a list of every step (bounded memory, issue 14).
    """

    HEAD = 8

    def __init__(self) -> None:
        self.head: list[tuple[float, int]] = []  # (seconds, examples) of the first HEAD steps
        self.total_seconds = 0.0
        self.total_examples = 0
        self.steps = 0

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if len(self.head) < self.HEAD:
            self.head.append((record.seconds, record.examples))
        self.total_seconds += record.seconds
        self.total_examples += record.examples
        self.steps += 1

    def totals(self, skip: int = 0) -> tuple[int, float]:
        """(examples, seconds) of the steps after the first ``skip`` (at most HEAD)."""
        if skip > self.HEAD:
            raise ValueError(f"TimingListener: can skip at most the first {self.HEAD} steps")
        skipped = self.head[:skip]
        return (self.total_examples - sum(n for _, n in skipped), self.total_seconds - sum(s for s, _ in skipped))

    def images_per_second(self, skip: int = 0) -> float | None:
        """Images per second over the steps after the first ``skip``; None when no step is left."""
        examples, seconds = self.totals(skip)
        return examples / seconds if seconds > 0 else None


class MemoryListener(TrainingListener):
    """Samples the memory monitor after every step (RSS, bytes per ArrayType, spills, block allocations).

    Each of ``trainer.memory_fields`` (name -> a function of no arguments) adds one field to the line:
    an offload session adds ``swap`` that way, without the trainer knowing about offload.
    """

    def __init__(self, monitor: MemoryMonitor, plot_path: str | None = None):
        self.monitor = monitor
        self.plot_path = plot_path

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        fields = {name: read() for name, read in trainer.memory_fields.items()}
        self.monitor.sample(record.step, loss=record.loss, **fields)

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self.plot_path and self.monitor.records:
            self.monitor.plot(self.plot_path)


class ProgressListener(TrainingListener):
    """A rich progress bar per run: epoch, loss, running accuracy and images per second."""

    def __init__(self, console: Any = None, workers: int = 1):
        self.console = console
        self.workers = workers  # data parallel: every rank trains as many examples per step as this one
        self.progress: Any = None
        self.task: Any = None
        self._images = 0
        self._seconds = 0.0

    def on_train_start(self, trainer: Trainer) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            self._description(trainer, trainer.step), total=trainer.total_steps, completed=trainer.step, stats=""
        )

    def _description(self, trainer: Trainer, step: int) -> str:
        epoch = min(step // trainer.source.batches_per_epoch, trainer.epochs_total - 1)
        return f"epoch {epoch + 1}/{trainer.epochs_total}"

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        self._images += record.examples * self.workers
        self._seconds += record.seconds
        score = trainer.score
        stats = (
            f"loss {score.recent_loss:.4f}  acc {100 * score.running_accuracy:5.1f}%  "
            f"{self._images / max(self._seconds, 1e-9):,.0f} img/s"
        )
        self.progress.update(
            self.task, completed=record.step + 1, stats=stats, description=self._description(trainer, record.step)
        )

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self.progress is not None:
            self.progress.stop()

    def on_train_abort(self, trainer: Trainer, error: BaseException) -> None:
        if self.progress is not None:  # the error's one line must not land inside a live progress bar
            self.progress.stop()


class LineProgressListener(TrainingListener):
    """Progress for logs, where a live bar prints nothing (output piped, redirected, in CI): one plain line
    when the first step ends (compilation and warm-up done), then one every ``interval_s`` seconds, and
    one at the last step: step, epoch, loss, running accuracy, images per second and the time left.

    Images per second and the time left count the steps after the run's first (which compiles and
    learns the workspaces: on a cold cache it takes seconds, the others milliseconds); until there is
    such a step they read "n/a". Written to ``stream`` (default stderr: stdout keeps the run's results,
    which a log or a README quotes without the progress in between)."""

    def __init__(self, stream: Any = None, interval_s: float = 10.0, workers: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream
        self.interval_s = interval_s
        self.workers = workers  # data parallel: every rank trains as many examples per step as this one
        self.clock = clock
        self._last: float | None = None
        self._steps = 0
        self._images = 0  # after the first step
        self._seconds = 0.0

    def on_train_start(self, trainer: Trainer) -> None:
        self._last, self._steps, self._images, self._seconds = None, 0, 0, 0.0

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        self._steps += 1
        if self._steps > 1:
            self._images += record.examples * self.workers
            self._seconds += record.seconds
        now = self.clock()
        done = record.step + 1
        if self._last is not None and now - self._last < self.interval_s and done < trainer.total_steps:
            return
        self._last = now
        score = trainer.score
        epoch = min(record.step // trainer.source.batches_per_epoch, trainer.epochs_total - 1) + 1
        if self._seconds > 0:
            rate = f"{self._images / self._seconds:,.1f} img/s"
            left = (trainer.total_steps - done) * self._seconds / (self._steps - 1)
            eta = _clock_time(left)
        else:
            rate, eta = "n/a img/s", "n/a"
        line = (f"step {done}/{trainer.total_steps}  epoch {epoch}/{trainer.epochs_total}  "
                f"loss {score.recent_loss:.4f}  acc {100 * score.running_accuracy:.1f}%  {rate}  ETA {eta}")
        import sys

        stream = self.stream if self.stream is not None else sys.stderr
        print(line, file=stream, flush=True)


def _clock_time(seconds: float) -> str:
    """0:07, 3:25, 1:02:03: the time left as a log reader reads it."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# --- the trainer -----------------------------------------------------------------------------------


class TrainerPlugin(Protocol):
    """What the Trainer's ``offload`` slot takes (``engine.offload.session.OffloadSession`` is one): set
    up before the first step, torn down after the last (also after an exception)."""

    def start(self, trainer: Trainer) -> None: ...

    def stop(self, trainer: Trainer) -> None: ...


class ParallelPlugin(TrainerPlugin, Protocol):
    """What the Trainer's ``parallel`` slot takes (``engine.parallel.wrapper.DataParallel``): this rank's
    batches, a synchronisation after the last step (every rank reaches it), the sharded evaluation and
    the throughput over all ranks (issue 12)."""

    def batch_source(self, x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray, batch_size: int,
                     channels: int, shuffle: bool, augment: bool, seed: int) -> BatchSource: ...

    def finish(self, trainer: Trainer) -> None: ...

    def evaluate(self, net: Network, data: Dataset, backend: Any, batch_size: int = 64) -> Evaluation: ...

    def reduce_result(self, trainer: Trainer, result: TrainResult) -> TrainResult: ...


class Trainer:
    """Runs the training loop of ``net`` with ``optimizer`` on ``data``; see the module docstring.

    ``net`` is a built Network: the trainer never builds models (the CLI does, with ``models.build_network``).
    """

    def __init__(
        self,
        net: Network,
        optimizer: Optimizer,
        data: Dataset,
        *,
        batch_size: int = 32,
        epochs: int = 1,
        steps: int | None = None,
        shuffle: bool = True,
        augment: bool = False,
        seed: int = 0,
        prefetch: int = 2,
        listeners: list[TrainingListener] | tuple[TrainingListener, ...] = (),
        monitor: MemoryMonitor | None = None,
        gc_every: int = 100,
        evaluate_at_end: bool = True,
        eval_batch_size: int | None = None,
        start_step: int = 0,
        offload: TrainerPlugin | None = None,
        parallel: ParallelPlugin | None = None,
        stop: Any = None,
        checkpoint_every: int = 0,
        on_checkpoint: Callable[[Trainer], None] | None = None,
        cuda_graph: str | None = None,
    ):
        self.net, self.optimizer, self.data = net, optimizer, data
        self.backend = net.backend
        self.batch_size = batch_size
        self.seed = seed
        self.prefetch = prefetch
        # --- data parallel (issue 12): ``parallel`` is None (one process) or a ParallelPlugin (DataParallel):
        # batch_source() gives this rank's shard of every global batch; start(trainer)/finish(trainer)/
        # stop(trainer) wrap the loop (install the gradient allreduce hook or the averaging listener, last
        # synchronisation, removal); evaluate() is the sharded evaluation; reduce_result() sums throughput.
        self.parallel = parallel
        if parallel is not None:  # in-memory data sets only: the CLI refuses image folders with --workers
            self.source = parallel.batch_source(
                data.x_train, data.y_train, data.mean, data.std, batch_size, data.channels, shuffle, augment, seed
            )
        else:
            self.source = data.batch_source("train", batch_size, shuffle=shuffle, augment=augment, seed=seed)
        self.total_steps = steps if steps is not None else epochs * self.source.batches_per_epoch
        if self.total_steps < 1:
            raise ValueError(f"nothing to train: {self.total_steps} steps")
        self.epochs_total = -(-self.total_steps // self.source.batches_per_epoch)
        if not 0 <= start_step <= self.total_steps:
            raise ValueError(
                f"cannot start at step {start_step}: the run has {self.total_steps} steps "
                "(a resumed run needs --steps/--epochs at least as large as the checkpoint's step)"
            )
        self.step = start_step  # global steps done so far
        self.monitor = monitor if monitor is not None else MemoryMonitor(net.mgr)
        self.gc_policy = GcPolicy(collect_every=gc_every)
        self.evaluate_at_end = evaluate_at_end
        self.eval_batch_size = eval_batch_size or batch_size  # a larger one would raise the peak
        self.score = ScoreListener()
        self.timing = TimingListener()
        self.listeners: list[TrainingListener] = [
            self.score,
            self.timing,
            MemoryListener(self.monitor),
            *listeners,
        ]
        # --- offload (offload issue): an offload scheduler plugs in here --------------------------
        # ``offload`` is None (everything resident) or a ``TrainerPlugin``: ``start(trainer)`` installs
        # its net.hooks, its tensor provider (net.mgr.set_provider) and its ``memory_fields`` before
        # the first step; ``stop(trainer)`` removes them and ends its threads. An optional ``summary()``
        # returns the measured figures the training summary shows.
        self.offload = offload
        self.memory_fields: dict[str, Callable[[], Any]] = {}  # extra fields of every memory-monitor line
        self.input_ring_bytes = 0
        # --- stopping and rolling checkpoints (issue 14) --------------------------------------------
        # ``stop``: an object whose ``received`` becomes a signal number (engine.signals.StopSignals);
        # it is read before every step, so a signal ends the run between two steps, never inside one.
        # ``on_checkpoint(trainer)`` is called after every ``checkpoint_every``-th completed step.
        self.stop = stop
        self.stopped_by: int | None = None
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.on_checkpoint = on_checkpoint
        # --- the step as one CUDA graph (issue 34): "cupy" (a GPU), "record" (the simulator's stand-in) or
        # None (eager). engine.cuda_graph.StepRunner captures the step after one eager step and replays it;
        # the same weights as eager, bit for bit. Not with --offload-params, data parallel or the update in
        # backward (hooks between a step's launches, which a replay skips): the CLI decides, fit() refuses.
        # Offload of activations on the pinned tier is captured with the step (its copies are in the graph);
        # on the disk tier the runner keeps the step eager (cuda_graph_eager_reason).
        if cuda_graph not in (None, "cupy", "record"):
            raise ValueError(f"cuda_graph must be None, 'cupy' or 'record', got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self.runner: Any = None
        self.cuda_graph_error: str | None = None  # why a capture failed (the run went on eagerly)
        # why the runner kept the step eager, decided at capture time (offload's swap tier), or a failed capture
        self.cuda_graph_eager_reason: str | None = None

    @classmethod
    def from_options(cls, options: TrainOptions, net: Network, optimizer: Optimizer, data: Dataset, *,
                     steps: int, **runtime: Any) -> Trainer:
        """The trainer ``engine train`` asked for: batches, shuffling, augmentation, seed, prefetch, GC and
        rolling checkpoints from ``options``; ``steps`` (resolved against the data) and what exists only at
        run time (listeners, monitor, offload session, parallel plugin, stop signals, on_checkpoint) given."""
        return cls(net, optimizer, data, batch_size=options.batch_size, steps=steps, shuffle=options.shuffle,
                   augment=options.augment, seed=options.seed, prefetch=options.prefetch_depth,
                   gc_every=options.gc_every, checkpoint_every=options.outputs.checkpoint_every, **runtime)

    # -- one step -----------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> tuple[float, int]:
        """forward, loss, backward, update; returns the loss and how many predictions were right."""
        if self.runner is not None:
            return self._graph_step(batch)
        logits = self.net.forward(batch.x, training=True)
        loss = self.net.loss(batch.y)
        if not math.isfinite(loss):  # before backward and the update: the weights stay those of the last step
            raise TrainingDiverged(
                f"the loss became {loss} at step {batch.step} (learning rate {self.optimizer.lr:g}); "
                "try a smaller --lr, or --optimizer adam"
            )
        predicted = np.argmax(self.backend.to_host(logits.array), axis=1)
        correct = int(np.count_nonzero(predicted[: batch.valid_rows] == batch.y_host[: batch.valid_rows]))
        self.net.backward()
        self.optimizer.step()
        return loss, correct

    def _graph_step(self, batch: Batch) -> tuple[float, int]:
        """The step through the CUDA graph runner. Its update is skipped on the device when the loss is not
        finite (kernels/cuda/optim.py: the guard), so a diverged step leaves the weights of the last good step,
        as the eager step's check before the update does."""
        runner = self.runner
        runner.step(batch.x, batch.y_host)
        loss = runner.last_loss()  # waits for the step: the loss and accuracy of every step are shown
        if not math.isfinite(loss):
            self.optimizer.steps_taken -= 1  # the update did not run
            raise TrainingDiverged(
                f"the loss became {loss} at step {batch.step} (learning rate {self.optimizer.lr:g}); "
                "try a smaller --lr, or --optimizer adam"
            )
        predicted = np.argmax(runner.last_logits(tuple(batch.x.shape)), axis=1)
        correct = int(np.count_nonzero(predicted[: batch.valid_rows] == batch.y_host[: batch.valid_rows]))
        return loss, correct

    def _start_graph(self) -> None:
        from engine.cuda_graph import StepRunner

        # a capture that fails on a GPU (a case the simulator could not show) falls back to the eager step with a
        # note (cuda_graph_error) rather than ending the run: the same weights either way
        runner = StepRunner(self.net, self.optimizer, capture=self.cuda_graph, warmup=1, keep_logits=True,
                            fallback=True)
        if runner.eager_reason is not None:
            runner.close()
            raise ValueError(f"the step cannot be captured as a CUDA graph: {runner.eager_reason}; "
                             "run with --no-cuda-graph")
        self.runner = runner

    # -- the loop -----------------------------------------------------------------------------------

    def fit(self, until: int | None = None) -> TrainResult:
        """Train from the current step to ``until`` (default: the end of the run); evaluate at the end."""
        stop = self.total_steps if until is None else min(until, self.total_steps)
        first = self.step
        for listener in self.listeners:
            listener.on_train_start(self)
        self.monitor.begin_phase("training")  # setup's peak (imports, data, network) ends here
        # RSS after every layer: a hook, which a replayed graph does not call (the RSS is still sampled per step)
        rss_hook = self.monitor if hasattr(self.monitor, "sample_rss") and self.cuda_graph is None else None
        if rss_hook is not None:
            self.net.hooks.append(rss_hook)
        if self.offload is not None:
            self.offload.start(self)
        if self.parallel is not None:
            self.parallel.start(self)
        start_time = time.perf_counter()
        stream = BatchStream(self.source, self.backend, self.step, stop, depth=self.prefetch, name="train-input")
        self.input_ring_bytes = stream.workspace.capacity
        try:
            if self.cuda_graph is not None:  # after the hooks are installed: it refuses a network with hooks
                self._start_graph()
            last_time = time.perf_counter()
            for batch in stream:
                if self.stop is not None and self.stop.received is not None:
                    break  # a stop signal: end between two steps
                lr = self.optimizer.lr
                with self.gc_policy.step():
                    loss, correct = self.train_step(batch)
                self.step = batch.step + 1
                now = time.perf_counter()
                record = StepRecord(
                    batch.step, batch.epoch, batch.index, loss, correct, batch.valid_rows, lr, now - last_time
                )
                last_time = now
                for listener in self.listeners:
                    listener.on_step_end(self, record)
                if batch.index == self.source.batches_per_epoch - 1:
                    for listener in self.listeners:
                        listener.on_epoch_end(self, batch.epoch)
                if (self.checkpoint_every and self.on_checkpoint is not None and self.step < stop
                        and self.step % self.checkpoint_every == 0):
                    self.on_checkpoint(self)
            if self.parallel is not None:
                self.parallel.finish(self)
        except BaseException as error:
            for listener in self.listeners:
                listener.on_train_abort(self, error)
            raise
        finally:
            stream.close()
            if self.runner is not None:  # the Dropout layers draw their own masks again (evaluation, a next fit)
                self.cuda_graph_error = self.runner.capture_error
                self.cuda_graph_eager_reason = self.runner.eager_reason
                self.runner.close()
                self.runner = None
            if rss_hook is not None and rss_hook in self.net.hooks:
                self.net.hooks.remove(rss_hook)
            if self.parallel is not None:
                self.parallel.stop(self)
            if self.offload is not None:
                self.offload.stop(self)
        seconds = time.perf_counter() - start_time
        if self.stop is not None and self.stop.received is not None:
            self.stopped_by = self.stop.received
        evaluation = None
        evaluation_start = time.perf_counter()
        if self.evaluate_at_end and self.step == self.total_steps and self.stopped_by is None:
            self.monitor.begin_phase("evaluation")
            if self.parallel is not None:  # sharded over the ranks: sampled once, after it
                evaluation = self.parallel.evaluate(self.net, self.data, self.backend, self.eval_batch_size)
                self.monitor.sample(0)
            else:
                evaluation = evaluate(self.net, self.data, self.backend, self.eval_batch_size,
                                      listener=lambda batch: self.monitor.sample(batch.step))
        self.monitor.end_phase()
        result = self._result(self.step - first, seconds, evaluation)
        if evaluation is not None:
            result.evaluation_seconds = time.perf_counter() - evaluation_start
        if self.parallel is not None:
            result = self.parallel.reduce_result(self, result)
        for listener in self.listeners:
            listener.on_train_end(self, result)
        return result

    def _result(self, steps: int, seconds: float, evaluation: Evaluation | None) -> TrainResult:
        monitor = self.monitor
        phases: dict[str, PhaseMemory] = {}
        for phase, rss in monitor.phase_rss_peaks.items():
            by_type = dict(monitor.peak_by_type(phase))
            # the input rings live outside the network's managers: all of a ring holds batches
            ring = {"training": self.input_ring_bytes,
                    "evaluation": evaluation.input_ring_bytes if evaluation else 0}.get(phase, 0)
            if ring:
                by_type["INPUT"] = by_type.get("INPUT", 0) + ring
            samples = monitor.phase_samples.get(phase, 0)
            phases[phase] = PhaseMemory(rss, dict(sorted(by_type.items())), samples)
        process_peak, peak_phase = monitor.process_peak()
        summary = getattr(self.offload, "summary", None)
        return TrainResult(
            steps=steps,
            final_step=self.step,
            epochs=self.step / self.source.batches_per_epoch,
            batch_size=self.batch_size,
            seconds=seconds,
            images_per_second=self.timing.images_per_second() or 0.0,
            steady_images_per_second=self.timing.images_per_second(skip=2) if steps > 2 else None,
            final_loss=self.score.recent_loss,
            train_accuracy=self.score.running_accuracy,
            test_accuracy=evaluation.accuracy if evaluation else None,
            test_top5_accuracy=evaluation.top5_accuracy if evaluation else None,
            test_loss=evaluation.loss if evaluation else None,
            peak_rss_bytes=process_peak,
            peak_bytes=phases["training"].peak_bytes if "training" in phases else {},
            peak_rss_phase=peak_phase,
            phases=phases,
            offload=summary() if summary is not None else None,
            loss_window=len(self.score.recent),
            accuracy_steps=self.score.epoch_steps,
            num_classes=self.data.num_classes,
            evaluation=evaluation,
            first_step_seconds=self.timing.head[0][0] if steps and self.timing.head else None,
        )

    def position(self) -> tuple[int, int]:
        """(epoch, batch index) of the next step."""
        return step_position(self.step, self.source.batches_per_epoch)


def peak_rss_bytes() -> int:
    """The largest resident set size this process has had (the OS's high-water mark)."""
    from engine.memory.monitor import max_rss_bytes

    return max_rss_bytes()
