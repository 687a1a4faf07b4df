"""ArrayType: what a tensor is for, which decides where its bytes live and how long they last.

A layer never picks a workspace. It says what kind of array it wants (its output, something saved
for backward, scratch for one kernel) and the ``WorkspaceManager`` maps that kind to a workspace
for the current mode. Changing where activations live is then one table, not a change in every layer.
"""

from __future__ import annotations

import enum


class ArrayType(enum.Enum):
    """The role of an array; the manager's mode maps each role to a workspace (docs/memory.md)."""

    INPUT = "input"  # the batch fed to the network
    ACTIVATIONS = "activations"  # a layer's output
    ACTIVATION_GRAD = "activation_grad"  # the gradient with respect to a layer's input or output
    FF_WORKING_MEM = "ff_working_mem"  # scratch of one layer's forward kernels
    BP_WORKING_MEM = "bp_working_mem"  # scratch of one layer's backward kernels
    FF_CACHE = "ff_cache"  # what a layer saves in forward for its backward (masks, statistics)
    UPDATER_WORKING_MEM = "updater_working_mem"  # scratch of the optimizer step
    PARAMETERS = "parameters"  # long-lived: weights (one ContiguousBlock)
    GRADIENTS = "gradients"  # long-lived: weight gradients (one ContiguousBlock)
    UPDATER_STATE = "updater_state"  # long-lived: momentum, Adam's m and v (one ContiguousBlock)

    # Members are singletons, so identity hashing is correct, and it is C-fast: Enum's own __hash__
    # is Python code, paid on every dict lookup of every allocation.
    __hash__ = object.__hash__

    @property
    def is_long_lived(self) -> bool:
        """True for the types that outlive every iteration and live in a ContiguousBlock."""
        return self in LONG_LIVED

    def __repr__(self) -> str:
        return f"ArrayType.{self.name}"


LONG_LIVED = frozenset({ArrayType.PARAMETERS, ArrayType.GRADIENTS, ArrayType.UPDATER_STATE})
