"""The IO threads kept off the CPUs that take the swap disk's interrupts (engine.offload.affinity)."""

import os

import numpy as np
import pytest

from engine.backend import get_backend
from engine.offload import OffloadScheduler
from engine.offload.affinity import interrupt_cpus, io_thread_cpus, parse_cpu_list
from engine.optim import SGD
from models import build_model

MLP = dict(input_shape=(3, 8, 8), hidden=32, depth=8)


def test_parse_cpu_list():
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("") == frozenset()


def fake_machine(root, path, *, partition=False, counts=None, affinity=None):
    """A sysfs and procfs holding the disk of ``path``: a virtio disk behind PCI function 0000:00:02.0
    with MSI interrupts 35 (config, fired once, on CPU 0) and 36 (requests, on CPU 1)."""
    counts = {35: (0, 1), 36: (0, 90000)} if counts is None else counts
    affinity = {35: "0", 36: "1"} if affinity is None else affinity
    st_dev = os.stat(path).st_dev
    sys_root, proc_root = root / "sys", root / "proc"
    pci = sys_root / "devices" / "pci0000:00" / "0000:00:02.0"
    virtio = pci / "virtio1"
    disk = virtio / "block" / "vda"
    disk.mkdir(parents=True)
    (disk / "device").symlink_to(virtio)
    (pci / "msi_irqs").mkdir()
    for irq in counts:
        (pci / "msi_irqs" / str(irq)).write_text("msix\n")
    block = disk
    if partition:
        block = disk / "vda1"
        block.mkdir()
    (sys_root / "dev" / "block").mkdir(parents=True)
    (sys_root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}").symlink_to(block)
    lines = ["           CPU0       CPU1       "]
    for irq, (c0, c1) in counts.items():
        lines.append(f" {irq}:  {c0}  {c1}  PCI-MSIX-0000:00:02.0   {irq - 35}-edge      virtio1-x")
        (proc_root / "irq" / str(irq)).mkdir(parents=True)
        (proc_root / "irq" / str(irq) / "effective_affinity_list").write_text(affinity[irq] + "\n")
    lines.append("LOC:    5440169    6455529   Local timer interrupts")
    (proc_root / "interrupts").write_text("\n".join(lines) + "\n")
    return dict(sys_root=str(sys_root), proc_root=str(proc_root))


@pytest.mark.parametrize("partition", [False, True], ids=["disk", "partition"])
def test_the_interrupt_cpus_of_the_swap_disk_are_found(tmp_path, partition):
    roots = fake_machine(tmp_path / "m", tmp_path, partition=partition)
    # the config interrupt (1 of 90,001) does not count: only the requests' CPU
    assert interrupt_cpus(str(tmp_path), **roots) == {1}
    assert io_thread_cpus(str(tmp_path), allowed={0, 1}, **roots) == {0}
    assert io_thread_cpus(str(tmp_path), allowed={0, 1, 2, 3}, **roots) == {0, 2, 3}


def test_the_threads_stay_where_they_are_when_nothing_is_left_or_known(tmp_path):
    roots = fake_machine(tmp_path / "m", tmp_path)
    assert io_thread_cpus(str(tmp_path), allowed={1}, **roots) is None  # only the interrupts' CPU is allowed
    everywhere = fake_machine(tmp_path / "n", tmp_path, counts={36: (500, 500), 37: (500, 500)},
                              affinity={36: "0", 37: "1"})  # per-CPU queues (NVMe)
    assert io_thread_cpus(str(tmp_path), allowed={0, 1}, **everywhere) is None
    quiet = fake_machine(tmp_path / "q", tmp_path, counts={35: (0, 0), 36: (0, 0)})  # nothing fired yet
    assert io_thread_cpus(str(tmp_path), allowed={0, 1}, **quiet) is None
    missing = dict(sys_root=str(tmp_path / "none"), proc_root=str(tmp_path / "none"))
    assert interrupt_cpus(str(tmp_path), **missing) is None
    assert io_thread_cpus(str(tmp_path), allowed={0, 1}, **missing) is None


def attached(cpu, tmp_path, **options):
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
    return net, OffloadScheduler(cpu, 2, directory=str(tmp_path), **options).attach(net, batch_size=2)


def test_the_scheduler_restricts_its_io_threads_to_the_cpus_asked():
    cpu = get_backend("cpu")
    allowed = os.sched_getaffinity(0)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        net, scheduler = attached(cpu, directory, io_cpus={min(allowed)})
        try:
            assert scheduler.io_cpus == {min(allowed)}
            assert [os.sched_getaffinity(tid) for tid in scheduler.io_thread_ids] == [{min(allowed)}] * 2
            assert os.sched_getaffinity(0) == allowed  # the executor (and its kernels) keep every CPU
        finally:
            scheduler.close()
            net.close()
        net, scheduler = attached(cpu, directory, io_cpus=None)
        try:
            assert scheduler.io_cpus is None
            assert [os.sched_getaffinity(tid) for tid in scheduler.io_thread_ids] == [allowed] * 2
        finally:
            scheduler.close()
            net.close()
        net, scheduler = attached(cpu, directory)  # "auto": this machine's answer for the swap file
        try:
            assert scheduler.io_cpus == io_thread_cpus(scheduler.storage.file_path)
        finally:
            scheduler.close()
            net.close()


def test_pinned_io_threads_give_the_same_weights(tmp_path):
    """Where the IO threads run changes no arithmetic: unpinned, pinned and no offload agree bit for bit."""
    cpu = get_backend("cpu")
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 2).astype(np.int64))
            for _ in range(3)]
    results = []
    for options in (None, dict(io_cpus=None), dict(io_cpus={min(os.sched_getaffinity(0))})):
        net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
        optimizer = SGD(net.parameters, net.gradients, cpu, lr=0.05, momentum=0.9)
        scheduler = None
        if options is not None:
            scheduler = OffloadScheduler(cpu, 1, directory=str(tmp_path), **options).attach(net)
        try:
            for x, y in data:
                net.forward(x, training=True)
                net.loss(y)
                net.backward()
                optimizer.step()
            if scheduler is not None:
                assert all(s.bytes_written > 0 for s in scheduler.stats)  # the IO threads really moved bytes
            results.append(net.state_dict())
        finally:
            if scheduler is not None:
                scheduler.close()
            net.close()
    for other in results[1:]:
        for key in results[0]:
            assert np.array_equal(results[0][key], other[key]), key
