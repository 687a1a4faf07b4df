"""The README's figure tables are what the commands print: same tables, rows, names and units.

A README block marked ``<!-- output: COMMAND -->`` followed by a ```text fence is compared with the
output of COMMAND: ``engine memory`` runs nothing, so its blocks are compared line for line, numbers
included; ``engine train`` blocks (a minute of ResNet-18) are compared in structure with a tiny run
of the same command (cnn, synthetic data, 3 steps, offload N=1): every README line, with numbers
replaced by ``#`` and units by their kind (bytes, time), must appear in the same order in the run's
output, and every table title and summary row the run prints must be in the README.
"""

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from engine.threads import threads

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"<!-- output: (engine [^>]*?) -->\s*```text\n(.*?)```", re.S)


def blocks() -> list[tuple[str, list[str]]]:
    found = [(command, text.rstrip("\n").splitlines()) for command, text in BLOCK.findall(README.read_text())]
    assert found, "README.md has no <!-- output: engine ... --> blocks"
    return found


def run(args: list[str], thread_count: int = 1) -> list[str]:
    with threads(thread_count):
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def normalize(line: str) -> str:
    """Numbers -> #, byte units -> <bytes>, time units -> <time>, phases -> <phase>; spaces collapsed."""
    line = line.replace("(process peak)", "")
    line = re.sub(r"\bduring (setup|training steps|evaluation)\b", "during <phase>", line)
    line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?", "#", line)
    line = re.sub(r"# (B|KiB|MiB|GiB)\b", "# <bytes>", line)
    line = re.sub(r"# (ms|s)\b", "# <time>", line)
    line = re.sub(r"-{2,}", "--", line)
    line = re.sub(r"(?<!\S)-(?!\S)", "#", line)  # an empty cell
    line = re.sub(r"\b(steps|step)\b", "step", line)  # "43 steps" / "1 step"
    return " ".join(line.split())


def is_subsequence(needles: list[str], haystack: list[str]) -> tuple[bool, str]:
    position = 0
    for needle in needles:
        while position < len(haystack) and haystack[position] != needle:
            position += 1
        if position == len(haystack):
            return False, needle
        position += 1
    return True, ""


@pytest.mark.parametrize("command, lines", [b for b in blocks() if b[0].startswith("engine memory")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_memory_blocks_are_exactly_what_the_command_prints(command, lines):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the README's figures are for two threads (working memory is per thread)")
    printed = run(command.split()[1:], thread_count=2)
    text = "\n".join(printed)
    assert "\n".join(lines) in text, f"README block for {command!r} is not in its output:\n{text}"


def training_blocks() -> list[tuple[str, list[str]]]:
    return [b for b in blocks() if b[0].startswith("engine train")]


@pytest.fixture(scope="module")
def tiny_training_output(tmp_path_factory) -> list[str]:
    directory = tmp_path_factory.mktemp("readme")
    return run(["train", "--model", "cnn", "--data", "synthetic", "--num-classes", "4", "--batch-size", "16",
                "--steps", "3", "--offload-n", "1", "--offload-dir", str(directory), "--no-progress"])


@pytest.mark.parametrize("command, lines", training_blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_training_blocks_have_the_commands_structure(command, lines, tiny_training_output):
    printed = [normalize(line) for line in tiny_training_output]
    wanted = [normalize(line) for line in lines if not line.startswith(("resnet18 on", "offload: window"))]
    ok, missing = is_subsequence(wanted, printed)
    assert ok, f"README line {missing!r} (normalized) is not what `{command}` prints now:\n" + "\n".join(printed)
    # the other way: every table and summary row the command prints is in the README
    readme = {normalize(line) for line in lines}
    titles = [line for line in tiny_training_output if line.startswith(("training summary", "memory by phase",
                                                                        "offload ("))]
    summary_rows = [line for line in tiny_training_output
                    if line.split("  ")[0] in ("steps", "time", "images/s", "final loss", "train accuracy",
                                               "test accuracy", "test loss", "peak RSS", "window N",
                                               "stall per step", "written per step", "read per step")]
    for line in titles + summary_rows:
        assert normalize(line) in readme, f"`{command}` prints {line!r}; the README block lacks it"
