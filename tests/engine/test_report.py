"""One byte formatter and tables that never cut a cell: wide terminal, narrow terminal, piped, JSON."""

import io

import pytest
from rich.console import Console

from engine.report import Table, format_bytes, format_seconds, render_table, table_dict


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (144 * 2**20, "144.0 MiB"),
    (1023.9 * 2**20, "1023.9 MiB"), (7056.1 * 2**20, "6.89 GiB"), (None, "n/a"),
])
def test_one_rule_for_every_byte_count(nbytes, text):
    assert format_bytes(nbytes) == text


def test_seconds_are_ms_below_one_second_and_n_a_when_missing():
    assert format_seconds(0.0186) == "18.6 ms" and format_seconds(84.6) == "84.6 s" and format_seconds(None) == "n/a"


def wide_table() -> Table:
    table = Table("memory per layer", ["layer", "kind", "kept for backward"], right={2})
    table.add_row("layer1.0.downsample.conv_with_a_long_name", "Conv2d", format_bytes(3 * 2**20))
    table.add_row("fc", "Dense", "")
    table.notes.append("a note under the table")
    return table


def printed(table: Table, **console_options) -> str:
    out = io.StringIO()
    render_table(table, Console(file=out, **console_options))
    return out.getvalue()


@pytest.mark.parametrize("options", [
    {"width": 40, "force_terminal": True},  # narrow terminal: key-value blocks
    {"width": 200, "force_terminal": True},  # wide terminal: a rich table
    {"width": 40, "force_terminal": False},  # piped: plain columns, wider than the "terminal"
], ids=["narrow", "wide", "piped"])
def test_no_cell_is_ever_cut(options):
    text = printed(wide_table(), **options)
    for cell in ("layer1.0.downsample.conv_with_a_long_name", "Conv2d", "3.0 MiB", "kept for backward", "a note"):
        assert cell in text, (cell, text)
    assert "…" not in text


def test_piped_output_is_plain_text_without_box_drawing():
    text = printed(wide_table(), width=40, force_terminal=False)
    assert not set("┃┏━│┌─") & set(text)
    assert max(len(line) for line in text.splitlines()) > 40  # the layout ignores the width: nothing wraps


def test_a_narrow_terminal_gets_one_block_per_row():
    text = printed(wide_table(), width=40, force_terminal=True)
    assert "- layer1.0.downsample.conv_with_a_long_name" in text and "kept for backward: 3.0 MiB" in text


def test_the_json_form_holds_the_same_cells():
    data = table_dict(wide_table())
    assert data["columns"] == ["layer", "kind", "kept for backward"]
    assert data["rows"][0] == {"layer": "layer1.0.downsample.conv_with_a_long_name", "kind": "Conv2d",
                               "kept for backward": "3.0 MiB"}


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        wide_table().add_row("a", "b")


def test_engine_info_piped_is_plain_and_uncut():
    from click.testing import CliRunner

    from cli import main

    output = CliRunner().invoke(main, ["info"], catch_exceptions=False).output
    assert "Numba cache directory" in output and "why not / note" in output
    assert not set("│┃─━") & set(output) and "…" not in output
