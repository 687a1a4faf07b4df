"""The GEMM table (kernels/cuda/gemm_table.json): how a shape's tile and split are chosen. No kernel runs."""

from __future__ import annotations

import json

import pytest

from kernels.cuda import conv as cuda_conv
from kernels.cuda import gemm


def test_committed_table_names_only_candidates():
    table = gemm._load_table(gemm.TABLE_PATH)
    assert table["default"] in gemm.CANDIDATES
    for entry in table["entries"].values():
        assert entry["config"] in gemm.CANDIDATES and int(entry.get("splits", 1)) >= 1


def test_every_candidate_is_a_valid_family_member():
    for name, config in gemm.CANDIDATES.items():
        assert config.name == name
        assert config.threads <= 1024 and config.shared_floats * 4 <= 48 * 1024  # static shared memory limit
    with pytest.raises(ValueError, match="one row per thread"):
        gemm.TileConfig(64, 8, 8, 8, 2).check()  # 32 threads for 64 A rows
    with pytest.raises(ValueError, match="one column per thread"):
        gemm.TileConfig(8, 64, 8, 2, 8).check()  # 32 threads for 64 B columns
    with pytest.raises(ValueError, match="multiples"):
        gemm.TileConfig(64, 64, 8, 3, 4).check()


def _write(tmp_path, entries, default=gemm.DEFAULT_CONFIG):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"default": default, "entries": entries}))
    return str(path)


def test_table_entry_picks_config_and_splits(tmp_path, monkeypatch):
    """A shape the table names runs its config and split count; other shapes the default and the rule."""
    g = cuda_conv.conv_geometry((32, 512, 4, 4), (512, 512, 3, 3), 1, 1, 1)
    key = gemm.shape_key("conv_forward", 512, 512, 4608, 1)
    monkeypatch.setenv(gemm.TABLE_ENV, _write(tmp_path, {key: {"config": "32x32k8t2x2", "splits": 2}}))
    monkeypatch.setattr(gemm.config, "ENABLE_CUDASIM", False)
    forward = g.gemm("forward")
    assert forward.choice.version.name == "tiles_32x32k8t2x2"
    assert (forward.splits, forward.k_chunk) == (2, 2304)
    assert cuda_conv.conv2d_forward_workspace_size((32, 512, 4, 4), (512, 512, 3, 3), 1, 1, 1) == 2 * 32 * 512 * 16
    data = g.gemm("data")  # not in the table: the default tile, the split rule (64 tiles, K 4608 -> 4)
    assert data.choice.version.name == f"tiles_{gemm.DEFAULT_CONFIG}"
    assert data.splits == cuda_conv.split_rule(512, 512, 4608, 1) == 4


def test_simulator_keeps_the_tables_splits_not_its_tiles(tmp_path, monkeypatch):
    key = gemm.shape_key("conv_forward", 4, 50, 27, 1)
    monkeypatch.setenv(gemm.TABLE_ENV, _write(tmp_path, {key: {"config": "128x128k8t8x8", "splits": 3}}))
    monkeypatch.setattr(gemm.config, "ENABLE_CUDASIM", True)
    choice = gemm.choose("conv_forward", 4, 50, 27, 1)
    assert choice.version is gemm.tile_version(gemm.SIMULATOR_CONFIG) and choice.splits == 3


def test_a_table_naming_an_unknown_config_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(gemm.TABLE_ENV, _write(tmp_path, {}, default="256x256k8t16x16"))
    with pytest.raises(ValueError, match="gpu_tile_search"):
        gemm.choose("gemm", 2, 2, 2, 1)


def test_use_gemm_overrides_the_tile_but_not_the_split(monkeypatch):
    monkeypatch.setattr(cuda_conv, "SPLIT_MIN_K", 8)
    g = cuda_conv.conv_geometry((2, 3, 5, 5), (4, 3, 3, 3), 1, 1, 1)
    before = g.gemm("weight").splits
    previous = gemm.use_gemm("v2")
    try:
        shape = g.gemm("weight")
        assert shape.choice.version.name == "v2_tiled" and shape.splits == before > 1
    finally:
        gemm.use_gemm(previous)


def test_split_rule_splits_only_deep_layers():
    assert cuda_conv.split_rule(64, 32 * 1024, 576, 1) == 1  # ResNet-18's first 3x3 forward: 512 tiles
    assert cuda_conv.split_rule(512, 512, 4608, 1) == 4  # 512->512 @4x4, batch 32: 64 tiles
    assert cuda_conv.split_rule(512, 512, 900, 1) == 1  # too few products to split


def test_launches_do_not_synchronize_the_arguments_streams():
    """numba-cuda synchronizes the stream in a CuPy argument's __cuda_array_interface__ at every launch unless
    this is off: every launch would wait for the GPU, and a captured stream cannot be synchronized."""
    from numba.cuda.core import config as cuda_config

    import kernels.cuda._launch  # noqa: F401  (sets it)

    assert not cuda_config.CUDA_ARRAY_INTERFACE_SYNC
