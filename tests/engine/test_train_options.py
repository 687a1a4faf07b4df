"""engine train's options: one frozen value, checked once (engine.train_options)."""

import dataclasses

import pytest
from click.testing import CliRunner

from cli import main
from engine.errors import OptionError, UserError
from engine.train_options import OffloadOptions, OutputOptions, TrainOptions


def test_defaults_are_resolved_once():
    assert TrainOptions("cnn").epochs == 1 and TrainOptions("cnn").lr == 0.01
    assert TrainOptions("cnn", optimizer="adam").lr == 1e-3
    assert TrainOptions("cnn", steps=5).epochs is None and TrainOptions("cnn", lr=0.5).lr == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainOptions("cnn").lr = 1.0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: TrainOptions("cnn", epochs=1, steps=2), "give --epochs or --steps, not both"),
    (lambda: TrainOptions("cnn", override=("lr",)), "give --resume FILE too"),
    (lambda: TrainOptions("cnn", workspace_mode="none", offload=OffloadOptions(n="2")), "--workspace-mode enabled"),
    (lambda: OutputOptions(checkpoint_every=3), "give --save FILE too"),
])
def test_combinations_are_refused_when_the_options_are_built(make, message):
    with pytest.raises(UserError, match=message):
        make()


@pytest.mark.parametrize("n", ["four", "0", "-1", "2.5"])
def test_a_bad_offload_n_is_an_option_error(n):
    with pytest.raises(OptionError, match="--offload-n must be"):
        OffloadOptions(n=n)


def test_run_record_and_hyper_are_what_a_resume_checks():
    options = TrainOptions("cnn", data="synthetic", batch_size=8, lr_schedule="cosine", seed=3, shuffle=False)
    assert options.run_record(4, None) == {"model": "cnn", "data": "synthetic", "batch_size": 8, "seed": 3,
                                           "shuffle": False, "augment": False, "num_classes": 4}
    assert options.hyper(12)["steps"] == 12 and "steps" not in TrainOptions("cnn").hyper(12)
    assert options.total_steps(100) == 12 and options.total_steps(100, workers=2) == 6
    assert TrainOptions("cnn", steps=7).total_steps(100) == 7


def test_cli_offload_n_four_exits_2_before_anything_runs():
    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--offload-n", "four"])
    assert result.exit_code == 2, result.output
    assert "--offload-n must be a positive integer or 'auto', got 'four'" in result.output
    assert "Traceback" not in result.output


def test_memory_plot_without_matplotlib_says_what_to_install_before_the_first_step(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    log = tmp_path / "steps.jsonl"  # a witness: written from the first step on
    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--num-classes", "2",
                                       "--batch-size", "8", "--steps", "2", "--no-progress", "--memory-log", str(log),
                                       "--memory-plot", str(tmp_path / "plot.png")])
    assert result.exit_code == 1 and "pip install -e '.[plot]'" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(("options", "backend", "workers", "mode"), [
    (TrainOptions("resnet18"), "cuda", 1, "cupy"),  # on by default on a GPU
    (TrainOptions("resnet18", cuda_graph=False), "cuda", 1, None),
    (TrainOptions("resnet18"), "cudasim", 1, None),  # the simulator: only when asked for
    (TrainOptions("resnet18", cuda_graph=True), "cudasim", 1, "record"),
    (TrainOptions("resnet18"), "cpu", 1, None),
    # offload on the pinned tier is captured (the runner keeps the disk tier eager at capture time) ...
    (TrainOptions("resnet18", offload=OffloadOptions(n="4")), "cuda", 1, "cupy"),
    (TrainOptions("resnet18", offload=OffloadOptions(n="4", params=True)), "cuda", 1, None),  # ... not the state
    (TrainOptions("resnet18"), "cuda", 2, None),  # so does data parallel
])
def test_the_cuda_graph_is_on_by_default_on_a_gpu_where_nothing_forbids_it(options, backend, workers, mode):
    from cli import _cuda_graph_mode

    assert _cuda_graph_mode(options, backend, workers) == mode


def test_an_explicit_cuda_graph_where_it_cannot_run_is_one_line():
    import click

    from cli import _cuda_graph_mode

    with pytest.raises(click.ClickException, match="--cuda-graph: the cpu backend has no CUDA graph"):
        _cuda_graph_mode(TrainOptions("cnn", cuda_graph=True), "cpu", 1)
    with pytest.raises(click.ClickException, match="--cuda-graph: data parallel"):
        _cuda_graph_mode(TrainOptions("cnn", cuda_graph=True), "cuda", 2)
    with pytest.raises(UserError, match="--cuda-graph with --offload-params"):
        TrainOptions("cnn", cuda_graph=True, offload=OffloadOptions(n="2", params=True))
    done = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--steps", "1", "--cuda-graph",
                                     "--offload-n", "2", "--offload-params"])
    assert done.exit_code != 0 and "--cuda-graph with --offload-params" in done.output
