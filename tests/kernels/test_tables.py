"""The reference and CPU kernel tables offer exactly the names kernels/README.md promises."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "kernels" / "README.md"


def readme_names() -> set[str]:
    names = set()
    for line in README.read_text().splitlines():
        match = re.match(r"\| `(\w+)`(?: / `(\w+)`)? \|", line)
        if match:
            names.update(n for n in match.groups() if n)
    return names


def test_readme_lists_the_kernels():
    assert {"dense_forward", "relu6_backward", "adam_update", "conv2d_forward"} <= readme_names()


@pytest.mark.parametrize("package", ["kernels.reference", "kernels.cpu"])
def test_table_has_exactly_the_readme_names(package):
    import importlib

    table = importlib.import_module(package).TABLE
    assert set(table) == readme_names()
    assert all(callable(function) for function in table.values())
