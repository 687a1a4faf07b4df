import numpy as np
import pytest

from engine.backend import get_backend
from engine.memory import ArrayType, ContiguousBlock, WorkspaceManager

CPU = get_backend("cpu")
SPECS = [("conv1.weight", (4, 3, 3, 3)), ("bn1.weight", (4,)), ("fc.weight", (10, 4)), ("fc.bias", (10,))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_views_share_flat_memory_in_spec_order(dtype):
    block = ContiguousBlock(CPU, ArrayType.PARAMETERS, SPECS, dtype=dtype)
    sizes = [108, 4, 40, 10]
    assert block.names == [name for name, _ in SPECS]
    assert block.flat.shape == (sum(sizes),) and block.flat.dtype == dtype
    assert block.nbytes == sum(sizes) * np.dtype(dtype).itemsize
    assert np.all(block.flat == 0)
    start = 0
    for (name, shape), size in zip(SPECS, sizes):
        view = block.views[name]
        assert view.shape == shape and np.shares_memory(view, block.flat)
        assert block.offsets[name] == (start, start + size)
        view[...] = start + 1
        start += size
    expected = np.concatenate([np.full(s, o + 1) for s, o in zip(sizes, np.cumsum([0] + sizes[:-1]))])
    np.testing.assert_array_equal(block.flat, expected)
    block.flat *= 2  # one pass over flat is seen through every view
    assert np.all(block["fc.bias"] == 2 * (108 + 4 + 40 + 1))


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="'a' appears twice"):
        ContiguousBlock(CPU, ArrayType.GRADIENTS, [("a", (1,)), ("a", (2,))])


def test_a_tracked_block_counts_in_its_manager():
    mgr = WorkspaceManager(CPU, "training")
    block = ContiguousBlock(CPU, ArrayType.UPDATER_STATE, SPECS, manager=mgr)
    assert mgr.in_use_bytes_by_type()["UPDATER_STATE"] == block.nbytes
    assert mgr.reserved_bytes_by_type()["UPDATER_STATE"] == block.nbytes
    mgr.close()
