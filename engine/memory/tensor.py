"""Tensor: an array that remembers where its bytes came from, so a stale one is caught before use.

A workspace hands out views into one block and reuses the block every cycle, so an array kept past
its cycle silently reads someone else's numbers. A ``Tensor`` carries its workspace and the
workspace *generation* it was made in; the kernel table asks every argument for its array through
``kernel_array(op, argument)``, which compares two integers and raises a clear error when they
differ (the workspace was closed, reset or released). The check is on by default and cheap enough to
leave on; ``set_validation(False)`` swaps it for a plain attribute read.

The ``workspace`` a tensor points at is a ``TensorOwner``: any object with ``name``, ``generation``
and ``live_generation`` (a ``Workspace``, a planned arena's slot, the offload scheduler's unit
regions): the check only reads those, and each owner moves ``live_generation`` itself (CLOSED,
RELEASED, or the generation whose tensors are valid now).

``.array`` itself is not checked for staleness (reading a result after its step is a legitimate
debugging move), only for release: a tensor whose manager was closed refuses to hand out its array.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from engine.memory.array_type import ArrayType

# Values of Workspace.live_generation that no tensor generation (always >= 0) can equal.
CLOSED = -1  # the workspace is not open: every tensor from it is leaked
RELEASED = -2  # the workspace was destroyed (its manager closed): every tensor from it is released
ALWAYS_CHECK = -3  # circular workspaces: validity depends on the ring position, take the slow path


class TensorOwner(Protocol):
    """Whoever vouches for a tensor's bytes: the tensor is valid while ``live_generation`` equals the
    generation it was made in. ``released_by`` (optional) names who released the bytes, for messages."""

    name: str
    generation: int
    live_generation: int


class WorkspaceError(RuntimeError):
    """Base of every memory error of the engine."""


class LeakedWorkspaceError(WorkspaceError):
    """A tensor was used after its workspace was closed."""


class OutdatedWorkspaceError(WorkspaceError):
    """A tensor was used after its workspace was reset (its memory now belongs to newer tensors)."""


class ReleasedTensorError(WorkspaceError):
    """A tensor was used after its manager (and so its workspace) was closed and released."""


class Tensor:
    """An array plus what it is for (``array_type``), where it lives (``workspace``) and when (``generation``).

    ``workspace`` is None for unmanaged tensors (mode "none", ``detach()``, long-lived types): they
    are never stale. ``offset`` is the byte offset inside the workspace block, None when the tensor
    was spilled outside the block or is unmanaged.
    """

    __slots__ = ("_array", "array_type", "_workspace", "generation", "offset", "__weakref__")

    def __init__(
        self,
        array: Any,
        array_type: ArrayType | None = None,
        workspace: TensorOwner | None = None,
        generation: int = 0,
        offset: int | None = None,
    ):
        self._array = array
        self.array_type = array_type
        self._workspace = workspace
        self.generation = generation
        self.offset = offset

    @property
    def array(self) -> Any:
        """The backend array (a view into the workspace block)."""
        ws = self._workspace
        if ws is not None and ws.live_generation == RELEASED:
            raise ReleasedTensorError(_released_message(self, "read", ".array"))
        return self._array

    @property
    def workspace(self) -> TensorOwner | None:
        return self._workspace

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def nbytes(self) -> int:
        return int(self._array.nbytes)

    @property
    def is_valid(self) -> bool:
        """True when a kernel may use this tensor now (unmanaged, or its workspace generation is current)."""
        try:
            _slow_kernel_array(self, "is_valid", "tensor")
        except WorkspaceError:
            return False
        return True

    def check(self, op: str = "check", argument: str = "tensor") -> None:
        """Raise the error a kernel would raise for this tensor; for code that reads ``.array`` directly."""
        _slow_kernel_array(self, op, argument)

    def detach(self) -> Tensor:
        """An unmanaged copy (``workspace`` None) that survives every reset and close of the original's workspace."""
        return Tensor(self.array.copy(), self.array_type, None, 0, None)

    def kernel_array(self, op: str, argument: str) -> Any:  # replaced by set_validation()
        ws = self._workspace
        if ws is None or ws.live_generation == self.generation:
            return self._array
        return _slow_kernel_array(self, op, argument)

    def __repr__(self) -> str:
        where = "unmanaged" if self._workspace is None else f"workspace {self._workspace.name!r} gen {self.generation}"
        kind = self.array_type.name if self.array_type is not None else "untyped"
        return f"Tensor({kind}, shape={tuple(self._array.shape)}, dtype={self._array.dtype}, {where})"


_checked_kernel_array = Tensor.kernel_array


def _unchecked_kernel_array(self: Tensor, op: str, argument: str) -> Any:
    return self._array


def set_validation(enabled: bool) -> None:
    """Turn the per-argument workspace check before every kernel on or off (for the whole process)."""
    Tensor.kernel_array = _checked_kernel_array if enabled else _unchecked_kernel_array


def validation_enabled() -> bool:
    return Tensor.kernel_array is _checked_kernel_array


@contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Run a block with validation switched on or off, then restore the previous setting."""
    previous = validation_enabled()
    set_validation(enabled)
    try:
        yield
    finally:
        set_validation(previous)


def _slow_kernel_array(tensor: Tensor, op: str, argument: str) -> Any:
    """The full check: why is this tensor not current, and is it still usable (circular rings)?"""
    ws = tensor._workspace
    if ws is None:
        return tensor._array
    live = ws.live_generation
    if live == RELEASED:
        raise ReleasedTensorError(_released_message(tensor, op, argument))
    if live == CLOSED:
        from engine.memory.workspace import open_workspace_names

        open_names = ", ".join(open_workspace_names()) or "none"
        raise LeakedWorkspaceError(
            f"Op [{op}] {argument} uses leaked workspace pointer from workspace [{ws.name}]: the workspace the "
            f"array was defined in is no longer open. All open workspaces: [{open_names}]. Keep the tensor inside "
            f"its scope, or detach() it (or leverage_to() a longer-lived ArrayType) before the scope ends."
        )
    if live == ALWAYS_CHECK:  # circular: the ring only overwrote what lies before the cursor
        if ws._ring_still_holds(tensor):
            return tensor._array
        raise OutdatedWorkspaceError(
            f"Op [{op}] {argument} uses outdated workspace pointer from circular workspace [{ws.name}]: array "
            f"generation (ring lap) {tensor.generation}, workspace current generation {ws.generation}; the ring "
            f"wrapped and overwrote it. Make the ring larger, or detach() the tensor before the ring comes round."
        )
    if tensor.generation != live:
        raise OutdatedWorkspaceError(
            f"Op [{op}] {argument} uses outdated workspace pointer from workspace [{ws.name}]: array generation "
            f"{tensor.generation}, workspace current generation {live}; the workspace was reset since the array "
            f"was made and its memory now belongs to newer arrays. detach() it or leverage_to() a longer-lived "
            f"ArrayType before the reset."
        )
    return tensor._array


def _released_message(tensor: Tensor, op: str, argument: str) -> str:
    ws = tensor._workspace
    owner = getattr(ws, "released_by", None) or "its owner"
    return (
        f"Op [{op}] {argument}: the tensor ({tensor.array_type.name if tensor.array_type else 'untyped'}, shape "
        f"{tuple(tensor._array.shape)}) was released: workspace [{ws.name}] was destroyed when {owner} was closed. "
        f"detach() tensors you need before closing their manager."
    )
