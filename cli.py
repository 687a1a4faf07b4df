"""The `engine` command line: info, train, eval, bench, kernels, memory.

Each command imports the engine lazily, inside its body: `engine --help` stays instant, and
`--backend cudasim` can set NUMBA_ENABLE_CUDASIM before anything imports numba.
"""

from __future__ import annotations

import json
import sys

import click

from engine.backend import BACKEND_NAMES, BackendUnavailable


def fail(message: str) -> None:
    """Stop with a one-line error (no traceback): the message names the problem and the fix."""
    raise click.ClickException(message)


def select_backend(name: str):
    """The backend for a command; switches on the CUDA simulator first when asked for."""
    from engine.backend import get_backend

    try:
        return get_backend(name)
    except BackendUnavailable as exc:
        fail(str(exc))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="numba-offload-engine")
def main() -> None:
    """A readable training engine: Numba kernels, typed workspaces, disk offload of layer windows.

    Start with: engine train --model resnet18 --offload-n 4
    """


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def info(as_json: bool) -> None:
    """Versions, available backends (and why not), threads, BLAS and the Numba cache."""
    from engine.info import collect_info, render_info

    report = collect_info()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render_info(report)


# --- kernels: benchmark table and cache warm-up (kernels issue) ---


# --- train, eval, memory (training issue) ---


# --- bench: offload benchmark (offload issue) ---



if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "fail", "select_backend", "BACKEND_NAMES"]
