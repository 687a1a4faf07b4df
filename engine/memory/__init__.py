"""Memory: every tensor of the engine has a type, a workspace and an owner.

``ArrayType`` says what an array is for; a ``WorkspaceManager`` maps types to ``Workspace``s (one
block each, bump allocation, scopes with a generation counter) for its mode; a ``Tensor`` remembers
its workspace generation so a stale one is caught before a kernel runs; ``ContiguousBlock`` holds the
long-lived parameters, gradients and optimizer state as one array each; the manager tree closes what
a closed owner held; ``PlannedArena`` places a training step's tensors at offsets planned from their
lifespans (``planner``); the ``MemoryMonitor`` records what all of it costs per step.
"""

from engine.memory.arena import ArenaPlan, PlanMismatchError, PlannedArena, PlannedTensor, make_plan
from engine.memory.array_type import LONG_LIVED, ArrayType
from engine.memory.block import ContiguousBlock
from engine.memory.manager import MODES, ROUTES, TensorProvider, WorkspaceManager, no_workspaces
from engine.memory.monitor import GcPolicy, MemoryMonitor
from engine.memory.sizes import Shape, nbytes
from engine.memory.tensor import (
    LeakedWorkspaceError,
    OutdatedWorkspaceError,
    ReleasedTensorError,
    Tensor,
    TensorOwner,
    WorkspaceError,
    set_validation,
    validation,
    validation_enabled,
)
from engine.memory.tree import ManagerCappedError, ManagerClosedError, ManagerNode, RootManager, root_manager
from engine.memory.workspace import (
    ALIGNMENT,
    DebugMode,
    LearningPolicy,
    ResetPolicy,
    SpillPolicy,
    Workspace,
    WorkspaceClosedError,
    WorkspaceConfig,
    WorkspaceFullError,
    WorkspaceStatistics,
    allocation_statistics_for_current_thread,
    destroy_all_workspaces_for_current_thread,
    get_or_create_workspace,
    print_allocation_statistics_for_current_thread,
    workspaces_for_current_thread,
)

__all__ = [
    "Shape",
    "nbytes",
    "ArenaPlan",
    "PlanMismatchError",
    "PlannedArena",
    "PlannedTensor",
    "make_plan",
    "ALIGNMENT",
    "LONG_LIVED",
    "MODES",
    "ROUTES",
    "ArrayType",
    "ContiguousBlock",
    "DebugMode",
    "GcPolicy",
    "LeakedWorkspaceError",
    "LearningPolicy",
    "ManagerCappedError",
    "ManagerClosedError",
    "ManagerNode",
    "MemoryMonitor",
    "OutdatedWorkspaceError",
    "ReleasedTensorError",
    "ResetPolicy",
    "RootManager",
    "SpillPolicy",
    "Tensor",
    "TensorOwner",
    "TensorProvider",
    "Workspace",
    "WorkspaceClosedError",
    "WorkspaceConfig",
    "WorkspaceError",
    "WorkspaceFullError",
    "WorkspaceManager",
    "WorkspaceStatistics",
    "allocation_statistics_for_current_thread",
    "destroy_all_workspaces_for_current_thread",
    "get_or_create_workspace",
    "no_workspaces",
    "print_allocation_statistics_for_current_thread",
    "root_manager",
    "set_validation",
    "validation",
    "validation_enabled",
    "workspaces_for_current_thread",
]
