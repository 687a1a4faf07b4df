"""The CUDA kernel table keeps the contract: the reference table's names, with the same parameters."""

from __future__ import annotations

import inspect

import pytest

from kernels.cuda import TABLE
from kernels.reference import OPTIONAL_NAMES
from kernels.reference import TABLE as REFERENCE_TABLE

pytestmark = pytest.mark.cudasim


def test_table_has_the_reference_names():
    # the chunked layers' batch-norm kernels are CPU-only (engine/layers/chunked.py): the GPU runs the layers apart
    optional = {name for names in OPTIONAL_NAMES.values() for name in names}
    assert set(TABLE) == set(REFERENCE_TABLE) - optional


@pytest.mark.parametrize("name", sorted(set(REFERENCE_TABLE) & set(TABLE)))
def test_signature_matches_reference(name):
    ours = list(inspect.signature(TABLE[name]).parameters)
    theirs = list(inspect.signature(REFERENCE_TABLE[name]).parameters)
    assert ours == theirs
