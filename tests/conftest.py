"""Shared test set-up: cudasim tests run only in the process started with NUMBA_ENABLE_CUDASIM=1."""

import os

import pytest

CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (long soaks)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cudasim" in item.keywords and not CUDASIM:
            item.add_marker(pytest.mark.skip(reason="needs NUMBA_ENABLE_CUDASIM=1 (tests/run runs it)"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="a long soak: run with --slow"))
