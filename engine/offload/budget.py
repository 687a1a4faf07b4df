"""``--offload-budget auto``: the offload window's bytes from the memory this process may use.

A training step needs, besides the saved-for-backward tensors the offload window holds:
- what the process holds before its first step (interpreter, libraries, the data set; measured RSS,
  less the network's parameters and buffers, which are counted below),
- the network's long-lived blocks (parameters, gradients, buffers) and optimizer state,
- the largest step of what offload does not place (activation gradients, the batch, the loss head,
  working memory: ``planned_peaks``),
- the INPUT ring of prefetched batches,
- ``RUNTIME_BYTES`` for what the first step loads: Numba's compiled kernels, the threading layer and
  BLAS buffers (measured: RSS grows 115-130 MiB past the tensors over a first ResNet-18 step),
- the evaluation pass at the end (``inference_peak_bytes``: the liveness peak of a forward pass, plus
  its two-slot ring). Without offload the training workspaces stay while it runs, so it adds; with
  offload the scheduler's arena is gone by then, so the larger of the two counts,
- a margin for what no plan sees (allocator slack, the swap writes' pages before they leave the page
  cache): ``MARGIN_FRACTION`` of the rest, at least ``MARGIN_MIN``.
The limit (``engine.memory.limits``) minus all that is the window's budget; the largest N whose arena
fits is used (``--offload-n auto`` adapts below it). When even N=1 does not fit, the run is refused
before the first step with the smallest limit that would work.

Checked on ResNet-18 ImageNet at 224×224, batch 32 (docs/offload.md, "Proof under a memory limit"): without
offload the model says 1.5 GiB and the run peaks at 1.39 GiB RSS; with ``--offload-n auto`` it says
1.2 GiB and the run peaks at 1.0 GiB. Before ``RUNTIME_BYTES`` and the evaluation pass were counted,
the model said 1.16 GiB for the run that peaked at 1.39 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.memory.limits import MemoryLimit, memory_limit, resident_bytes

MARGIN_FRACTION = 0.10
MARGIN_MIN = 128 * 2**20
RUNTIME_BYTES = 128 * 2**20


def inference_peak_bytes(graph: Any, batch_size: int) -> int:
    """The largest sum of live outputs plus forward scratch over one inference pass (liveness order)."""
    from engine.memory.sizes import nbytes

    shapes = graph.shapes(batch_size)
    last_use = {}
    for node in graph.nodes:
        for source in node.inputs:
            last_use[source] = node.index
    peak = 0
    for node in graph.nodes:
        live = sum(nbytes(shapes[other.index], "float32") for other in graph.nodes
                   if other.index <= node.index <= last_use.get(other.index, other.index))
        scratch = 4 * node.layer.forward_scratch([shapes[i] for i in node.inputs])
        peak = max(peak, live + scratch)
    return int(peak)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryFit:
    """What a run needs against what it may use (bytes); ``needed_*`` include the margin."""

    limit: MemoryLimit
    baseline_bytes: int  # the process before the network's tensors
    optimizer_state_bytes: int
    input_ring_bytes: int
    needed_no_offload: int
    needed_offload_without_arena: int  # everything with offload on, except the window's arena
    min_window_arena_bytes: int  # the arena of N=1

    @property
    def needed_min_offload(self) -> int:
        """The smallest limit that trains with offload (N=1)."""
        return self.needed_offload_without_arena + self.min_window_arena_bytes

    @property
    def fits_without_offload(self) -> bool:
        return self.needed_no_offload <= self.limit.bytes

    @property
    def arena_budget(self) -> int:
        """Bytes the offload window's arena may take under the limit (negative: nothing fits)."""
        return self.limit.bytes - self.needed_offload_without_arena

    def as_dict(self) -> dict[str, Any]:
        return {
            "limit_bytes": self.limit.bytes,
            "limit_source": self.limit.source,
            "baseline_bytes": self.baseline_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "input_ring_bytes": self.input_ring_bytes,
            "needed_no_offload_bytes": self.needed_no_offload,
            "needed_min_offload_bytes": self.needed_min_offload,
            "arena_budget_bytes": self.arena_budget,
        }


def with_margin(nbytes: int) -> int:
    return int(nbytes + max(MARGIN_MIN, MARGIN_FRACTION * nbytes))


def memory_fit(net: Any, batch_size: int, optimizer_state_bytes: int, input_ring_bytes: int,
               limit: MemoryLimit | None = None, baseline_bytes: int | None = None) -> MemoryFit:
    """The run's needs without and with offload against ``limit`` (default: this process's)."""
    from engine.offload.session import planned_peaks

    limit = limit if limit is not None else memory_limit()
    report = net.memory_report(batch_size)
    if baseline_bytes is None:  # parameters and buffers were written at initialization: already resident
        baseline_bytes = max(0, resident_bytes() - report.parameter_bytes - report.buffer_bytes)
    from engine.data.prefetch import ring_bytes

    peaks = planned_peaks(net, batch_size, 1)
    extra = baseline_bytes + optimizer_state_bytes + input_ring_bytes + RUNTIME_BYTES
    evaluation = inference_peak_bytes(net.graph, batch_size) + ring_bytes((batch_size, *net.graph.input_shape), 2)
    without_arena = peaks["planned_peak_bytes_offload"] - peaks["offload_arena_bytes"]
    arena = peaks["offload_arena_bytes"]
    # with offload: the evaluation pass reuses the arena's room; whatever it needs beyond counts as fixed
    with_offload_fixed = extra + without_arena + max(0, evaluation - arena)
    return MemoryFit(
        limit=limit,
        baseline_bytes=baseline_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        input_ring_bytes=input_ring_bytes,
        needed_no_offload=with_margin(extra + report.planned_peak_bytes + evaluation),
        needed_offload_without_arena=with_margin(with_offload_fixed),
        min_window_arena_bytes=arena,
    )


class DoesNotFit(ValueError):
    """The run cannot train under the limit: the message says what it needs and what would work."""


def check_fit(fit: MemoryFit, offload: bool) -> None:
    """Refuse before the first step when the run cannot fit (without offload: name the option that helps)."""
    if offload and fit.arena_budget < fit.min_window_arena_bytes:
        raise DoesNotFit(
            f"needs at least {_gib(fit.needed_min_offload)} with offload (N=1), the limit is {fit.limit.describe()}; "
            "lower --batch-size or run with a limit of at least that"
        )
    if not offload and not fit.fits_without_offload:
        hint = (f"add --offload-n auto (works from a limit of {_gib(fit.needed_min_offload)})"
                if fit.needed_min_offload <= fit.limit.bytes
                else f"with offload it needs {_gib(fit.needed_min_offload)}: lower --batch-size")
        raise DoesNotFit(
            f"needs {_gib(fit.needed_no_offload)} without offload, the limit is {fit.limit.describe()}; {hint}"
        )


def resolve_budget(net: Any, batch_size: int, optimizer: Any, prefetch: int, offload_n: str | None,
                   offload_budget: str | None) -> tuple[str | None, MemoryFit | None]:
    """The ``--offload-budget`` to use and the fit it came from, for ``engine train``.

    ``--offload-budget auto``, or ``--offload-n auto`` without a budget: the window's bytes under the
    limit (the budget returned is then ``str(fit.arena_budget)``). A share ("0.3x",
    ``session.parse_budget``) becomes bytes of this network at this batch size. Without offload options
    the run is checked to fit. Raises DoesNotFit before the first step (ValueError for a malformed
    budget). On device backends nothing is checked (the fit is None): host limits do not bound device memory.
    """
    from engine.data.prefetch import ring_bytes
    from engine.offload.session import budget_bytes_for, parse_budget

    if offload_budget is not None and str(offload_budget).strip().lower() != "auto" \
            and parse_budget(offload_budget)[0] == "share":
        offload_budget = str(budget_bytes_for(offload_budget, net, batch_size))

    auto = str(offload_budget).strip().lower() == "auto" or (
        offload_budget is None and str(offload_n).strip().lower() == "auto")
    if net.backend.is_device:  # the tensors live in device memory: host RAM and cgroups do not bound them
        if str(offload_budget).strip().lower() == "auto":
            raise DoesNotFit(f"--offload-budget auto reads host memory limits; on the {net.backend.name} backend "
                             "give --offload-budget BYTES")
        return offload_budget, None
    ring = ring_bytes((batch_size, *net.graph.input_shape), prefetch + 1)
    fit = memory_fit(net, batch_size, optimizer_state_bytes(optimizer), ring)
    if auto:
        check_fit(fit, offload=True)
        return str(fit.arena_budget), fit
    if offload_n is None and offload_budget is None:
        check_fit(fit, offload=False)
    return offload_budget, fit


def describe_fit(fit: MemoryFit) -> str:
    """One line: the limit, what the run needs without offload and with N=1, the window's budget."""
    return (f"memory limit {fit.limit.describe()}: needs {_gib(fit.needed_no_offload)} without offload, "
            f"{_gib(fit.needed_min_offload)} with offload N=1; offload window budget {_gib(max(fit.arena_budget, 0))}")


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's state block (momentum, Adam's moments; 0 for plain SGD)."""
    state = getattr(optimizer, "state", None)
    return int(state.flat.nbytes) if state is not None else 0


__all__ = ["DoesNotFit", "MemoryFit", "check_fit", "describe_fit", "memory_fit", "optimizer_state_bytes",
           "resolve_budget", "with_margin"]
