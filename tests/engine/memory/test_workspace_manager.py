import numpy as np
import pytest

from engine.backend import KernelTable, get_backend
from engine.memory import (
    ROUTES,
    ArrayType,
    LeakedWorkspaceError,
    OutdatedWorkspaceError,
    Tensor,
    WorkspaceClosedError,
    WorkspaceError,
    WorkspaceManager,
    no_workspaces,
)

CPU = get_backend("cpu")
TABLE = KernelTable("test", {"copy": lambda x, out: out.__setitem__(Ellipsis, x)})


def fake_step(mgr: WorkspaceManager, batch: np.ndarray) -> Tensor:
    """A three-layer forward and backward in the manager's pattern."""
    x = mgr.leverage_to(ArrayType.INPUT, batch)
    for i in range(3):
        with mgr.layer(i):
            scratch = mgr.create(ArrayType.FF_WORKING_MEM, (64 * (i + 1),))
            out = mgr.create(ArrayType.ACTIVATIONS, (batch.shape[0], 16))
            mgr.create(ArrayType.FF_CACHE, (16,))
            TABLE.copy(scratch, scratch)
            x = out
    for i in reversed(range(3)):
        with mgr.layer(i):
            mgr.create(ArrayType.BP_WORKING_MEM, (32,))
            mgr.zeros(ArrayType.ACTIVATION_GRAD, (batch.shape[0], 16))
    mgr.create(ArrayType.UPDATER_WORKING_MEM, (100,))
    return x


@pytest.mark.parametrize("mode", ["training", "inference", "none"])
def test_each_type_goes_where_the_mode_says(mode):
    mgr = WorkspaceManager(CPU, mode)
    routes = ROUTES[mode]
    with mgr.iteration():
        for array_type in ArrayType:
            if mode == "inference" and array_type in (
                ArrayType.ACTIVATION_GRAD,
                ArrayType.BP_WORKING_MEM,
                ArrayType.UPDATER_WORKING_MEM,
            ):
                with pytest.raises(WorkspaceError, match="inference mode does not have"):
                    mgr.create(array_type, (2,))
                continue
            t = mgr.create(array_type, (2, 3))
            assert t.shape == (2, 3) and t.dtype == np.float32 and t.array_type is array_type
            if array_type in routes:
                assert t.workspace is mgr.workspaces[routes[array_type]]
            else:
                assert t.workspace is None  # long-lived types and mode "none": plain arrays
            mgr.validate_location(array_type, t)
    mgr.close()


def test_zeros_and_dtype():
    mgr = WorkspaceManager(CPU, "training")
    with mgr.iteration():
        with mgr.layer(0):
            t = mgr.create(ArrayType.BP_WORKING_MEM, (8,))
            t.array[:] = 5
        z = mgr.zeros(ArrayType.ACTIVATION_GRAD, (2, 4), dtype=np.float64)
        assert z.dtype == np.float64 and np.all(z.array == 0)
    mgr.close()


def test_creating_outside_an_iteration_says_to_open_one():
    mgr = WorkspaceManager(CPU, "training")
    with pytest.raises(WorkspaceClosedError, match=r"ArrayType.ACTIVATIONS goes to workspace .*mgr.iteration"):
        mgr.create(ArrayType.ACTIVATIONS, (2,))
    mgr.close()


def test_after_the_first_step_a_step_allocates_nothing():
    mgr = WorkspaceManager(CPU, "training")
    batch = np.ones((4, 16), np.float32)
    with mgr.iteration():
        fake_step(mgr, batch)
    spilled, blocks = mgr.spilled_bytes(), mgr.block_allocations()
    # the first step learns: input, activations, gradients and updater get one block each, and the
    # per-layer working memory grows with its largest layer (64, 128 then 192 floats)
    assert spilled > 0 and blocks == 4 + 3
    for _ in range(100):
        with mgr.iteration():
            fake_step(mgr, batch)
    assert mgr.spilled_bytes() == spilled and mgr.block_allocations() == blocks
    with mgr.iteration():
        fake_step(mgr, batch[:3])  # a smaller last batch fits too
    assert mgr.spilled_bytes() == spilled and mgr.block_allocations() == blocks
    mgr.close()


def test_layer_resets_working_memory_and_restores_owner():
    mgr = WorkspaceManager(CPU, "training")
    with mgr.iteration():
        assert mgr.owner is None
        with mgr.layer(3):
            assert mgr.owner == 3
            scratch = mgr.create(ArrayType.FF_WORKING_MEM, (4,))
            with mgr.layer("inner"):
                assert mgr.owner == "inner"
            assert mgr.owner == 3
        assert mgr.owner is None
        with mgr.layer(4):
            again = mgr.create(ArrayType.FF_WORKING_MEM, (4,))
            assert again.offset == 0  # the next layer reuses the same bytes
            with pytest.raises(OutdatedWorkspaceError):
                TABLE.copy(scratch, again)
        activation = mgr.create(ArrayType.ACTIVATIONS, (4,))
    with pytest.raises(LeakedWorkspaceError):
        TABLE.copy(activation, np.zeros(4, np.float32))
    mgr.close()


def test_iteration_nests_without_reset():
    mgr = WorkspaceManager(CPU, "inference")
    with mgr.iteration():
        a = mgr.create(ArrayType.ACTIVATIONS, (4,))
        with mgr.iteration():
            b = mgr.create(ArrayType.ACTIVATIONS, (4,))
        assert a.is_valid and b.is_valid and a.generation == b.generation
        assert mgr.in_iteration
    assert not mgr.in_iteration and not a.is_valid
    mgr.close()


class RecordingProvider:
    def __init__(self):
        self.calls = []

    def create(self, array_type, shape, dtype, owner):
        self.calls.append((array_type, shape, dtype, owner))
        return Tensor(np.zeros(shape, dtype), array_type)


def test_set_provider_routes_chosen_types_with_the_owner():
    mgr = WorkspaceManager(CPU, "training")
    provider = RecordingProvider()
    mgr.set_provider({ArrayType.ACTIVATIONS, ArrayType.FF_CACHE}, provider)
    with mgr.iteration():
        with mgr.layer(7):
            a = mgr.create(ArrayType.ACTIVATIONS, (2, 3))
            c = mgr.create(ArrayType.FF_CACHE, 5, dtype=np.uint8)
            g = mgr.create(ArrayType.ACTIVATION_GRAD, (2, 3))
        assert provider.calls == [
            (ArrayType.ACTIVATIONS, (2, 3), np.dtype(np.float32), 7),
            (ArrayType.FF_CACHE, (5,), np.dtype(np.uint8), 7),
        ]
        assert a.workspace is None and c.shape == (5,) and g.workspace is mgr.workspaces["gradients"]
        mgr.validate_location(ArrayType.ACTIVATIONS, a)  # the provider decides where its tensors live
        mgr.set_provider([ArrayType.ACTIVATIONS], None)
        back = mgr.create(ArrayType.ACTIVATIONS, (2,))
        assert back.workspace is mgr.workspaces["activations"] and len(provider.calls) == 2
    mgr.close()


def test_validate_location_error_names_both_workspaces():
    mgr = WorkspaceManager(CPU, "training")
    with mgr.iteration():
        grad = mgr.create(ArrayType.ACTIVATION_GRAD, (2,))
        with pytest.raises(WorkspaceError) as info:
            mgr.validate_location(ArrayType.ACTIVATIONS, grad)
        assert str(info.value) == (
            f"Array of type ACTIVATIONS should be in workspace [{mgr.name}/activations] but is in workspace "
            f"[{mgr.name}/gradients]"
        )
        with pytest.raises(WorkspaceError, match=r"should be in workspace \[.*/input\] but is in workspace none"):
            mgr.validate_location(ArrayType.INPUT, np.zeros(2))
    mgr.close()


def test_leverage_to_copies_only_when_the_tensor_lives_elsewhere():
    mgr = WorkspaceManager(CPU, "training")
    with mgr.iteration():
        host = np.arange(6, dtype=np.float32).reshape(2, 3)
        x = mgr.leverage_to(ArrayType.INPUT, host)
        assert x.workspace is mgr.workspaces["input"] and np.array_equal(x.array, host)
        assert mgr.leverage_to(ArrayType.INPUT, x) is x
        cache = mgr.leverage_to(ArrayType.FF_CACHE, mgr.create(ArrayType.ACTIVATIONS, (2,)))
        assert cache.array_type is ArrayType.FF_CACHE and cache.workspace is mgr.workspaces["activations"]
        act = mgr.leverage_to(ArrayType.ACTIVATIONS, x)
        assert act.workspace is mgr.workspaces["activations"] and not np.shares_memory(act.array, x.array)
        assert np.array_equal(act.array, host)
    mgr.close()


def test_no_workspaces_gives_plain_arrays_anywhere():
    mgr = no_workspaces()
    t = mgr.create(ArrayType.ACTIVATIONS, (3,))
    assert mgr.mode == "none" and t.workspace is None and t.is_valid
    mgr.close()


def test_unknown_mode_and_unknown_config_role_are_refused():
    with pytest.raises(ValueError, match="unknown mode 'train'"):
        WorkspaceManager(CPU, "train")
    with pytest.raises(ValueError, match="no workspace called"):
        WorkspaceManager(CPU, "inference", configs={"gradients": None})
