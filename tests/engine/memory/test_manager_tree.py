import gc
import io

import numpy as np
import pytest

from engine.backend import KernelTable, get_backend
from engine.memory import (
    ArrayType,
    ManagerCappedError,
    ManagerClosedError,
    ReleasedTensorError,
    WorkspaceError,
    WorkspaceManager,
    root_manager,
)

CPU = get_backend("cpu")
TABLE = KernelTable("test", {"fill": lambda out, value: out.fill(value)})


def test_root_refuses_to_close():
    with pytest.raises(WorkspaceError, match="root manager cannot be closed"):
        root_manager().close()


def test_a_manager_hangs_under_the_root_and_leaves_it_on_close():
    mgr = WorkspaceManager(CPU, "training", name="tree-under-root")
    assert mgr.parent is root_manager() and mgr in root_manager().children
    mgr.close()
    assert mgr not in root_manager().children


def test_the_root_does_not_keep_forgotten_managers_alive():
    mgr = WorkspaceManager(CPU, "training", name="tree-forgotten")
    del mgr
    gc.collect()
    assert all(child.name != "tree-forgotten" for child in root_manager().children)


def test_close_cascades_and_releases_every_tensor_below():
    parent = WorkspaceManager(CPU, "training", name="tree-parent")
    child = parent.sub_manager(name="child")
    grandchild = child.sub_manager("inference", name="grandchild")
    assert [n.name for n in parent.walk()] == ["tree-parent", "tree-parent/child", "tree-parent/child/grandchild"]
    with parent.iteration(), child.iteration(), grandchild.iteration():
        tensors = [m.create(ArrayType.ACTIVATIONS, (3,)) for m in (parent, child, grandchild)]
        kept = tensors[2].detach()
        child.close()
        assert child.closed and grandchild.closed and not parent.closed
        assert parent.children == []
        TABLE.fill(tensors[0], 1.0)  # the parent's tensor is untouched
        for tensor, owner in ((tensors[1], "tree-parent/child"), (tensors[2], "tree-parent/child/grandchild")):
            with pytest.raises(ReleasedTensorError, match=rf"was released.*manager \[{owner}\]"):
                TABLE.fill(tensor, 1.0)
        TABLE.fill(kept, 2.0)  # a detached copy belongs to nobody
        assert np.all(kept.array == 2.0)
    with pytest.raises(ManagerClosedError, match="closed"):
        grandchild.create(ArrayType.ACTIVATIONS, (3,))
    with pytest.raises(ManagerClosedError):
        child.sub_manager()
    parent.close()
    child.close()  # closing twice is harmless


def test_a_capped_manager_refuses_but_its_sub_managers_allocate():
    mgr = WorkspaceManager(CPU, "training", name="tree-capped")
    with mgr.iteration():
        before = mgr.create(ArrayType.ACTIVATIONS, (2,))
        mgr.cap()
        with pytest.raises(ManagerCappedError, match=r"manager \[tree-capped\] is capped.*sub_manager"):
            mgr.create(ArrayType.ACTIVATIONS, (2,))
        with pytest.raises(ManagerCappedError):
            mgr.create(ArrayType.PARAMETERS, (2,))
        TABLE.fill(before, 3.0)  # what it already holds stays usable
        sub = mgr.sub_manager(name="scratch")
        with sub.iteration():
            assert sub.create(ArrayType.ACTIVATIONS, (2,)).shape == (2,)
        mgr.uncap()
        mgr.create(ArrayType.ACTIVATIONS, (2,))
    mgr.close()


def test_debug_dump_shows_the_tree_with_bytes_per_type():
    mgr = WorkspaceManager(CPU, "training", name="tree-dump")
    sub = mgr.sub_manager(name="eval")
    with mgr.iteration():
        mgr.create(ArrayType.ACTIVATIONS, (256,))  # 1024 bytes
        mgr.create(ArrayType.FF_CACHE, (10,))  # 40 -> 64 bytes
    sub.cap()
    out = io.StringIO()
    text = mgr.debug_dump(file=out)
    assert out.getvalue() == text + "\n"
    lines = text.splitlines()
    # learned from the step: 1024 + 64 bytes reserved; 1024 + 40 bytes spilled while learning
    assert lines[0] == "tree-dump [training] spilled 1.0 KiB in total: reserved 1.1 KiB"
    assert "  · ACTIVATIONS          1.0 KiB" in lines
    assert "  · FF_CACHE             64 B" in lines
    assert lines[-1] == "  tree-dump/eval [training] capped: reserved 0 B"
    assert "tree-dump" in root_manager().debug_dump(file=io.StringIO())
    mgr.close()
