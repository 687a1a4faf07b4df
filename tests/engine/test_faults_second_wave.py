"""Second wave of faults, below the command line (issue 31): image folders that loop or hold broken
links, image files that change under a run, checkpoints that are not files or hold NaN, two runs on one
--save path, output files on a disk that fills (a real tmpfs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from engine.checkpoint import CheckpointError, SaveClaim, read_checkpoint, tensor_digest
from engine.data import DataError
from engine.data.imagefolder import find_classes, load_image, make_samples
from engine.errors import OutputPathError, OutputWriteError
from engine.memory.monitor import MemoryMonitor


def image(path, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)


# -- image folders ------------------------------------------------------------------------------------


def test_the_walk_keeps_torchvisions_order_where_a_dash_sorts_before_a_slash(tmp_path, torchvision):
    for rel in ("a/x.png", "a/b/y.png", "a/b-x/z.png", "a/b/c/w.png", "b/v.png"):
        image(tmp_path / rel)
    os.symlink(tmp_path / "a" / "b", tmp_path / "b" / "link")  # a second way to a folder: walked, as torchvision does
    classes = find_classes(str(tmp_path))
    paths, labels = make_samples(str(tmp_path), classes)
    _, class_to_idx = torchvision.datasets.folder.find_classes(str(tmp_path))
    reference = torchvision.datasets.folder.make_dataset(str(tmp_path), class_to_idx, extensions=(".png",))
    assert list(zip(paths, labels)) == reference


def test_a_symlink_loop_in_a_class_folder_is_refused_with_the_link(tmp_path):
    image(tmp_path / "cat" / "1.png")
    image(tmp_path / "dog" / "2.png")
    os.symlink("..", tmp_path / "cat" / "again")  # cat/again/again/again/... (os.walk went ~40 deep)
    with pytest.raises(DataError, match=r"cat/again: a symbolic link loop .*remove the link"):
        make_samples(str(tmp_path), find_classes(str(tmp_path)))


def test_a_class_folder_that_is_a_broken_symlink_is_refused_not_skipped(tmp_path):
    image(tmp_path / "cat" / "1.png")
    image(tmp_path / "emu" / "3.png")
    os.symlink(tmp_path / "gone", tmp_path / "dog")  # dog sorted between cat and emu: labels would shift
    with pytest.raises(DataError, match=r"dog: a broken symbolic link .*gone.*fix the link or remove it"):
        find_classes(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    ("delete", "the image file is gone"),
    ("directory", "is a directory now, not an image file"),
    ("truncate", "truncated or corrupt"),
])
def test_an_image_that_changed_since_the_folder_was_read_names_its_one_cause(tmp_path, change, message):
    path = tmp_path / "1.jpg"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(path, quality=95)
    if change == "delete":
        path.unlink()
    elif change == "directory":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError) as info:
        load_image(str(path))
    assert message in str(info.value)
    assert ("truncated" in str(info.value)) == (change == "truncate")


# -- checkpoints --------------------------------------------------------------------------------------


def test_a_checkpoint_with_a_valid_hash_but_nan_is_refused_when_read(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"fc.weight": np.array([[1.0, np.nan]], np.float32), "fc.bias": np.zeros(1, np.float32)}
    save_file(tensors, str(tmp_path / "nan.safetensors"), metadata={"sha256": tensor_digest(tensors)})
    with pytest.raises(CheckpointError, match=r"fc.weight holds NaN or infinite values; nothing can be trained"):
        read_checkpoint(str(tmp_path / "nan.safetensors"))


def test_weights_through_a_symlink_to_a_device_say_what_it_is(tmp_path):
    os.symlink("/dev/null", tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"is a character device \(through the symbolic link to '/dev/null'\)"):
        read_checkpoint(str(tmp_path / "weights.safetensors"))
    os.symlink(tmp_path / "missing", tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="a broken symbolic link"):
        read_checkpoint(str(tmp_path / "broken.safetensors"))
    with pytest.raises(CheckpointError, match="is a directory"):
        read_checkpoint(str(tmp_path))


def test_a_second_run_on_the_same_save_path_is_refused_and_the_lock_is_not_left_behind(tmp_path):
    save = str(tmp_path / "ck.safetensors")
    with SaveClaim(save) as first:
        assert os.path.exists(first.lock_path)
        with pytest.raises(CheckpointError, match=rf"another engine train \(pid {os.getpid()}\) is writing"):
            SaveClaim(save).acquire()
    assert os.listdir(tmp_path) == []
    with SaveClaim(save):  # free again
        pass


def test_a_killed_runs_claim_is_taken_over(tmp_path):
    save = str(tmp_path / "ck.safetensors")
    holder = subprocess.Popen([sys.executable, "-c", f"from engine.checkpoint import SaveClaim; import time; "
                               f"SaveClaim({save!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError, match=rf"pid {holder.pid}"):
        SaveClaim(save).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with SaveClaim(save):  # the kernel released the dead run's lock
        pass
    assert os.listdir(tmp_path) == []


# -- output files on a disk that fills --------------------------------------------------------------


def test_a_memory_log_on_a_disk_that_fills_names_the_log(small_tmpfs):
    monitor = MemoryMonitor([], path=small_tmpfs / "memory.jsonl")
    with pytest.raises(OutputWriteError, match=r"memory log .*memory.jsonl: cannot write \(No space left on device\)"):
        for step in range(100000):
            monitor.sample(step)
    monitor.close()  # closing after the failure raises nothing more


def test_a_memory_plot_on_a_full_disk_leaves_no_file(small_tmpfs):
    monitor = MemoryMonitor([])
    for step in range(3):
        monitor.sample(step)
    (small_tmpfs / "filler").write_bytes(b"\0" * (252 << 10))
    with pytest.raises(OutputPathError, match=r"memory plot .*plot.png: cannot write .*--memory-plot"):
        monitor.plot(small_tmpfs / "plot.png")
    assert sorted(os.listdir(small_tmpfs)) == ["filler"]
