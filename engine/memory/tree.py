"""The manager tree: who owns which memory, and closing an owner releases everything under it.

In the style of DJL's NDManager. Every ``WorkspaceManager`` is a node: made without a parent it
hangs under the process-wide root (which refuses to be closed, and holds its children weakly so a
forgotten manager is not kept alive by it); ``sub_manager()`` makes a child. Closing a node closes
its children first, then destroys its own workspaces, so every tensor from them raises
``ReleasedTensorError`` instead of reading memory that is gone or reused. ``cap()`` makes a node
refuse new allocations: put it on a long-lived manager to catch code that should allocate in a
sub-manager. ``debug_dump()`` prints the tree with bytes per node and per ArrayType.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TextIO

from engine.memory.tensor import WorkspaceError
from engine.report import format_bytes


class ManagerCappedError(WorkspaceError):
    """A capped manager was asked for a new allocation."""


class ManagerClosedError(WorkspaceError):
    """A closed manager was asked for a new allocation or scope."""


class ManagerNode:
    """A node of the tree: children, close cascade, cap, and the dump. Subclasses say what they hold."""

    def __init__(self, name: str, parent: ManagerNode | None):
        self.name = name
        self.parent = parent
        self._children: list[ManagerNode] = []
        self.closed = False
        self.capped = False
        if parent is not None:
            if parent.closed:
                raise ManagerClosedError(f"manager [{parent.name}] is closed: it cannot take a sub-manager")
            parent._adopt(self)

    # --- structure ----------------------------------------------------------------------------------

    def _adopt(self, child: ManagerNode) -> None:
        self._children.append(child)

    def _forget(self, child: ManagerNode) -> None:
        if child in self._children:
            self._children.remove(child)

    @property
    def children(self) -> list[ManagerNode]:
        return list(self._children)

    def walk(self) -> Iterator[ManagerNode]:
        """This node and every node under it, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()

    # --- lifecycle ----------------------------------------------------------------------------------

    def cap(self) -> ManagerNode:
        """Refuse every new allocation from now on (sub-managers may still be made and used)."""
        self.capped = True
        return self

    def uncap(self) -> ManagerNode:
        self.capped = False
        return self

    def _check_can_allocate(self) -> None:
        if self.closed:
            raise ManagerClosedError(f"manager [{self.name}] is closed: it cannot allocate; use an open manager")
        if self.capped:
            raise ManagerCappedError(
                f"manager [{self.name}] is capped for new allocations (cap() was called to catch leaks into it); "
                f"allocate in a sub_manager() instead, or uncap() it"
            )

    def close(self) -> None:
        """Close the children, release what this node holds, and leave the parent. Closing twice is harmless."""
        if self.closed:
            return
        for child in self.children:
            child.close()
        self._release()
        self.closed = True
        if self.parent is not None:
            self.parent._forget(self)

    def _release(self) -> None:
        """Free what this node holds (subclasses)."""

    def __enter__(self) -> ManagerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the dump -----------------------------------------------------------------------------------

    def _describe(self) -> tuple[str, int, dict[str, int]]:
        """(one-line summary, reserved bytes, in-use bytes per ArrayType name); subclasses fill it."""
        return (self.name, 0, {})

    def debug_dump(self, file: TextIO | None = None) -> str:
        """The tree under this node: reserved bytes per node, in-use bytes per ArrayType; printed and returned."""
        lines: list[str] = []
        self._dump_into(lines, 0)
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def _dump_into(self, lines: list[str], depth: int) -> None:
        summary, reserved, by_type = self._describe()
        flags = "".join([" closed" if self.closed else "", " capped" if self.capped else ""])
        lines.append(f"{'  ' * depth}{summary}{flags}: reserved {format_bytes(reserved)}")
        for type_name, nbytes in sorted(by_type.items()):
            lines.append(f"{'  ' * depth}  · {type_name:<20} {format_bytes(nbytes)}")
        for child in self.children:
            child._dump_into(lines, depth + 1)


class RootManager(ManagerNode):
    """The process-wide root: cannot be closed; holds its children weakly."""

    def __init__(self) -> None:
        super().__init__("root", None)
        self._weak_children: list[weakref.ref[ManagerNode]] = []

    def _adopt(self, child: ManagerNode) -> None:
        self._weak_children = [r for r in self._weak_children if r() is not None]
        self._weak_children.append(weakref.ref(child))

    def _forget(self, child: ManagerNode) -> None:
        self._weak_children = [r for r in self._weak_children if r() is not None and r() is not child]

    @property
    def children(self) -> list[ManagerNode]:
        return [c for c in (r() for r in self._weak_children) if c is not None]

    def close(self) -> None:
        raise WorkspaceError(
            "the root manager cannot be closed: it lives as long as the process. Close the managers under it "
            "(WorkspaceManager.close()), which releases their workspaces"
        )

    def _describe(self) -> tuple[str, int, dict[str, int]]:
        return (f"root ({len(self.children)} managers)", 0, {})


_ROOT: RootManager | None = None


def root_manager() -> RootManager:
    """The root of the process's manager tree."""
    global _ROOT
    if _ROOT is None:
        _ROOT = RootManager()
    return _ROOT
