import numpy as np
import pytest

from engine.backend import KernelTable, get_backend
from engine.memory import (
    ArrayType,
    LeakedWorkspaceError,
    LearningPolicy,
    OutdatedWorkspaceError,
    ReleasedTensorError,
    Tensor,
    Workspace,
    WorkspaceConfig,
    WorkspaceManager,
    validation,
    validation_enabled,
)

CPU = get_backend("cpu")


def double_into(x, out):
    out[...] = 2 * x


TABLE = KernelTable("test", {"double_into": double_into})


def fixed_workspace(name: str) -> Workspace:
    return Workspace(CPU, name, WorkspaceConfig(initial_size=1024, learning=LearningPolicy.NONE))


def test_kernel_table_unwraps_current_tensors():
    ws = fixed_workspace("current")
    with ws:
        x = ws.create((4,))
        out = ws.create((4,))
        x.array[:] = [1, 2, 3, 4]
        TABLE.double_into(x, out=out)
        assert out.array.tolist() == [2, 4, 6, 8]


def test_leaked_tensor_names_op_argument_workspace_and_open_workspaces():
    ws = fixed_workspace("leaky")
    other = fixed_workspace("still-open")
    with ws:
        x = ws.create((4,))
    plain_out = np.zeros(4, np.float32)
    with other:
        with pytest.raises(LeakedWorkspaceError) as info:
            TABLE.double_into(x, plain_out)
    message = str(info.value)
    assert "Op [double_into] argument 0" in message
    assert "workspace [leaky]" in message and "no longer open" in message
    assert "All open workspaces: [" in message and "still-open" in message


def test_outdated_tensor_names_both_generations():
    ws = fixed_workspace("outdated")
    with ws:
        x = ws.create((4,))
    with ws:
        out = ws.create((4,))
        with pytest.raises(OutdatedWorkspaceError) as info:
            TABLE.double_into(x, out=out)
    message = str(info.value)
    assert "Op [double_into] argument 0 uses outdated workspace pointer from workspace [outdated]" in message
    assert f"array generation {x.generation}, workspace current generation {x.generation + 1}" in message


def test_keyword_arguments_are_validated_by_name():
    ws = fixed_workspace("kw")
    with ws:
        out = ws.create((4,))
    with pytest.raises(LeakedWorkspaceError, match=r"Op \[double_into\] out uses leaked"):
        TABLE.double_into(np.ones(4, np.float32), out=out)


def test_validation_switch_turns_the_check_off_and_back_on():
    ws = fixed_workspace("switch")
    with ws:
        x = ws.create((4,))
    assert validation_enabled()
    with validation(False):
        assert not validation_enabled()
        TABLE.double_into(x, np.zeros(4, np.float32))  # no check: the stale view is passed as is
    assert validation_enabled()
    with pytest.raises(LeakedWorkspaceError):
        TABLE.double_into(x, np.zeros(4, np.float32))


def test_detach_survives_a_reset():
    ws = fixed_workspace("detach")
    with ws:
        x = ws.create((4,), array_type=ArrayType.ACTIVATIONS)
        x.array[:] = [1, 2, 3, 4]
        kept = x.detach()
    with ws:
        y = ws.create((4,))
        y.array[:] = -1  # reuses x's bytes
        assert np.shares_memory(y.array, x.array)
    assert isinstance(kept, Tensor) and kept.workspace is None and kept.array_type is ArrayType.ACTIVATIONS
    assert kept.array.tolist() == [1, 2, 3, 4]
    out = np.zeros(4, np.float32)
    TABLE.double_into(kept, out)
    assert out.tolist() == [2, 4, 6, 8]


def test_released_tensor_says_it_was_released():
    mgr = WorkspaceManager(CPU, "training")
    with mgr.iteration():
        x = mgr.create(ArrayType.ACTIVATIONS, (2, 2))
        mgr.close()
        with pytest.raises(ReleasedTensorError, match=r"was released.*manager \[" + mgr.name):
            TABLE.double_into(x, np.zeros((2, 2), np.float32))
        with pytest.raises(ReleasedTensorError, match="was released"):
            _ = x.array
