"""Offload inside the Trainer: same weights, swap figures in the memory monitor's JSON lines, the CLI."""

import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from cli import main
from engine.bench.offload import format_markdown, format_table, summarize
from engine.data.datasets import synthetic
from engine.memory.monitor import MemoryMonitor
from engine.offload import OffloadConfig, OffloadSession
from engine.offload.storage import DIR_PREFIX
from engine.optim import make_optimizer
from engine.train import Trainer
from models import build_network


def fit(backend_name, data, offload, tmp_path, steps=3):
    from engine.backend import get_backend

    backend = get_backend(backend_name)
    net = build_network("cnn", data, backend, seed=3)
    optimizer = make_optimizer("sgd", net, backend, 0.1, momentum=0.9, manager=net.mgr)
    monitor = MemoryMonitor(net.mgr, path=str(tmp_path / f"memory-{offload is not None}.jsonl"))
    trainer = Trainer(net, optimizer, data, batch_size=2, steps=steps, seed=4, prefetch=1, evaluate_at_end=False,
                      monitor=monitor, offload=offload)
    trainer.fit()
    monitor.close()
    return net.state_dict(), monitor.records


def test_trainer_with_offload_matches_and_reports_swap(tmp_path):
    data = synthetic(num_classes=4, seed=0, train=8, test=2, shape=(3, 8, 8))
    reference, _ = fit("cpu", data, None, tmp_path)
    session = OffloadSession(OffloadConfig(window=1, directory=str(tmp_path)))
    weights, records = fit("cpu", data, session, tmp_path)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    lines = [json.loads(line) for line in (tmp_path / "memory-True.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        swap = line["swap"]
        assert swap["window"] == 1
        assert 0 < swap["resident_bytes"] <= swap["bound_bytes"]
        assert swap["swapped_bytes"] > 0 and swap["in_flight_bytes"] > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith(DIR_PREFIX)]  # stop() removed the directory


@pytest.mark.parametrize("n, budget, expected", [("4", None, 4), ("auto", None, "auto"), (None, 1_000_000, None)])
def test_config_from_options(n, budget, expected):
    config = OffloadConfig.from_options(n, budget, None)
    assert config.window == expected
    assert OffloadConfig.from_options(None, None, None) is None


@pytest.mark.parametrize("n, message", [("zero", "positive integer or 'auto'"), ("0", "at least 1")])
def test_config_rejects_bad_windows(n, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_options(n, None, None)


def test_engine_memory_prints_the_peak_with_and_without_offload():
    result = CliRunner().invoke(main, ["memory", "--model", "mlp", "--batch-size", "8", "--offload-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    offload = json.loads(result.output)["offload"]
    assert offload["window"] == 1
    assert offload["offload_arena_bytes"] < offload["offloadable_bytes_no_offload"]
    assert offload["planned_peak_bytes_offload"] > offload["offload_arena_bytes"]


def test_engine_train_refuses_an_unwritable_offload_dir(tmp_path):
    target = "/sys" if os.geteuid() == 0 else str(tmp_path / "locked")
    if os.geteuid() != 0:
        os.mkdir(target, 0o500)
    arguments = ["train", "--model", "cnn", "--data", "synthetic", "--steps", "1", "--backend", "cpu", "--no-progress",
                 "--offload-n", "2", "--offload-dir", target]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code != 0
    assert "not writable" in result.output and "--offload-dir" in result.output


def test_bench_tables_have_the_seed_columns():
    timing = summarize([0.001, 0.003])
    assert timing == {"avg": 2000.0, "min": 1000.0, "max": 3000.0, "sum": 4000.0}
    record = {"batch_size": 10, "model": "resnet18", "image_size": 32, "window": 4, "steps": 2,
              "step_ms_no_offload": 100.0, "step_ms_offload": 103.0, "step_time_ratio": 1.03,
              "step_cpu_ms_no_offload": 180.0, "step_cpu_ms_offload": 190.0,
              "peak_resident_bytes_no_offload": 100 << 20, "peak_resident_bytes_offload": 20 << 20,
              "page_cache_bytes_offload": 0, "resident_reduction": 0.8, "peak_rss_bytes_no_offload": 500 << 20,
              "peak_rss_bytes_offload": 400 << 20, "forward_backward_no_offload": timing,
              "forward_backward": timing, "offload": timing, "onload": timing, "stall": timing}
    table = format_table([record])
    assert "key" in table and "avg" in table and "sum" in table and "batch size: 10" in table
    for key in ("forward + backward", "offload", "onload", "stall"):
        assert key in table
    assert "(80.0% lower)" in table and "1.030x" in table
    assert "| forward + backward | 2000 | 1000 | 3000 | 4000 |" in format_markdown([record])


def test_bench_worker_interleaves_both_runs():
    from engine.bench.offload import run_worker

    config = {"model": "mlp", "batch_size": 4, "image_size": 8, "backend": "cpu", "directory": None,
              "windows": [None, 1], "steps": 2, "warmup": 1}
    plain, offload = run_worker(config)["runs"]
    assert plain["offload"]["sum"] == 0 and offload["offload"]["sum"] > 0 and offload["onload"]["sum"] > 0
    assert offload["windows"] == [1, 1]  # the two measured steps
    assert 0 < offload["peak_resident_bytes"] < plain["peak_resident_bytes"]
    assert offload["written_bytes_per_step"] == offload["read_bytes_per_step"] > 0
    assert offload["executor_checked_bytes_per_step"] == 0  # an MLP has no ReLU rebuild whose source it checks


def test_engine_memory_shows_keep_swap_recompute_per_layer():
    arguments = ["memory", "--model", "resnet18", "--image-size", "8", "--batch-size", "2", "--offload-n", "1"]
    result = CliRunner().invoke(main, [*arguments, "--json"])
    assert result.exit_code == 0, result.output
    offload = json.loads(result.output)["offload"]
    decisions = {row["layer"]: (row["decision"], row["from"]) for row in offload["layers"]}
    assert decisions["layer1.0.relu1"] == ("recompute", "layer1.0.bn1")
    assert decisions["layer2.0.relu2"] == ("recompute", "layer2.0.bn2 + layer2.0.downsample.1")
    assert decisions["layer1.0.bn1"][0] == "swap" and decisions["fc"][0] == "keep"
    assert "layer1.0.conv1" not in decisions  # batch norm keeps its output: the conv's output is not saved
    assert offload["written_per_step_bytes"] < offload["written_per_step_bytes_swap_only"]
    text = CliRunner().invoke(main, arguments).output
    assert "recompute from layer1.0.bn1" in text and "if all of it were swapped" in text
    # printed by engine/report.py's renderer (piped: plain columns, bytes by format_bytes), and in --json
    from engine.offload.session import plan_layers_table
    from engine.report import plain_lines, table_dict

    table = plan_layers_table(offload)
    assert "\n".join(plain_lines(table)) in text
    assert table_dict(table) in json.loads(result.output)["tables"]
    assert any(row[2].endswith(" KiB") for row in table.rows)  # not "0.00" MiB: the one byte rule


def test_engine_memory_shows_what_a_budget_keeps():
    """``--offload-budget``: the units kept beyond the window are marked, fewer bytes are written, the
    planned arena stays within the budget; a budget below the window's needs, or without a window, is refused."""
    arguments = ["memory", "--model", "resnet18", "--image-size", "8", "--batch-size", "2", "--offload-n", "1"]
    plain = json.loads(CliRunner().invoke(main, [*arguments, "--json"]).output)["offload"]
    result = CliRunner().invoke(main, [*arguments, "--offload-budget", "0.6x", "--json"])
    assert result.exit_code == 0, result.output
    offload = json.loads(result.output)["offload"]
    assert offload["budget_bytes"] == int(0.6 * plain["offloadable_bytes_no_offload"])
    assert plain["offload_arena_bytes"] < offload["offload_arena_bytes"] <= offload["budget_bytes"]
    assert offload["written_per_step_bytes"] < offload["written_per_step_bytes_window_only"]
    assert offload["written_per_step_bytes_window_only"] == plain["written_per_step_bytes"]
    kept = [row for row in offload["layers"] if row["by_budget"]]
    assert kept and all(row["decision"] == "keep" for row in kept)
    text = CliRunner().invoke(main, [*arguments, "--offload-budget", "0.6x"]).output
    assert "keep (budget)" in text and "budget" in text.splitlines()[0] + text
    for budget, message in (("1KB", "below what the smallest window needs"), ("x", "bytes (e.g. 120MB) or a share"),
                            ("-0.5x", "must be positive")):
        refused = CliRunner().invoke(main, [*arguments, "--offload-budget", budget])
        assert refused.exit_code != 0 and message in refused.output, refused.output
    # a window the budget cannot hold: the scheduler's words, naming the window that fits
    wider = CliRunner().invoke(main, [*arguments[:-1], "4", "--offload-budget",  # a budget counts the units' own arena
                                      str(plain["offload_units_arena_bytes"])])
    allowed = re.search(r"the budget allows N=(\d+)$", wider.output.strip())
    assert wider.exit_code != 0 and "--offload-n 4 needs" in wider.output and allowed and 1 <= int(allowed[1]) < 4
    alone = CliRunner().invoke(main, arguments[:-2] + ["--offload-budget", "0.5x"])
    assert alone.exit_code != 0 and "goes with --offload-n" in alone.output


def test_bench_runs_with_a_budget_and_names_it():
    from engine.bench.offload import run_worker

    config = {"model": "mlp", "batch_size": 4, "image_size": 8, "backend": "cpu", "directory": None,
              "windows": [1], "steps": 1, "warmup": 1, "budget": "0.95x"}
    (run,) = run_worker(config)["runs"]
    assert run["budget_bytes"] > 0 and run["bound_bytes"] <= run["budget_bytes"]
    refused = CliRunner().invoke(main, ["bench", "--model", "mlp", "--batch-size", "4", "--offload-budget", "lots"])
    assert refused.exit_code != 0 and "cannot read 'lots' as a size" in refused.output
    refused = CliRunner().invoke(main, ["bench", "--model", "mlp", "--batch-size", "4", "--offload-budget", "0.01x",
                                        "--steps", "1", "--warmup", "1"])
    assert refused.exit_code != 0 and "below what the smallest window needs" in refused.output
    errors = [line for line in refused.output.splitlines() if not line.startswith("... ")]  # not the progress
    assert "Traceback" not in refused.output and len(errors) == 1 and errors[0].startswith("Error: mlp batch size 4:")


def test_engine_train_takes_a_budget_as_a_share(tmp_path):
    arguments = ["train", "--model", "cnn", "--steps", "2", "--batch-size", "8", "--no-progress",
                 "--offload-dir", str(tmp_path)]
    result = CliRunner().invoke(main, [*arguments, "--offload-n", "1", "--offload-budget", "0.8x"])
    assert result.exit_code == 0, result.output
    plan_line = next(line for line in result.output.splitlines() if line.startswith("offload: window 1"))
    assert "kept by the budget" in plan_line
    assert "offload window budget" not in result.output  # the user's share, not the machine's budget line
    refused = CliRunner().invoke(main, [*arguments, "--offload-budget", "zx"])
    assert refused.exit_code != 0 and "share like 0.3x" in refused.output and "Traceback" not in refused.output


def test_config_takes_the_verify_mode():
    assert OffloadConfig.from_options("2", None, None, verify="header").verify == "header"
    with pytest.raises(ValueError, match="--offload-verify must be one of full, header, off"):
        OffloadConfig.from_options("2", None, None, verify="sha")
