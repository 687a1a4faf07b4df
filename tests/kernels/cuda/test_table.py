"""The CUDA kernel table keeps the contract: the reference table's names, with the same parameters."""

from __future__ import annotations

import inspect

import pytest

from kernels.cuda import TABLE
from kernels.reference import TABLE as REFERENCE_TABLE

pytestmark = pytest.mark.cudasim


def test_table_has_the_reference_names():
    assert set(TABLE) == set(REFERENCE_TABLE)


@pytest.mark.parametrize("name", sorted(REFERENCE_TABLE))
def test_signature_matches_reference(name):
    ours = list(inspect.signature(TABLE[name]).parameters)
    theirs = list(inspect.signature(REFERENCE_TABLE[name]).parameters)
    assert ours == theirs
