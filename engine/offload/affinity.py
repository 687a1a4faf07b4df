"""Where the IO threads run: off the CPUs that take the swap disk's completion interrupts.

Why. On this 2-vCPU KVM guest every completion interrupt of the swap disk (``virtio1-req.0``, its
effective affinity CPU 1) lands on one CPU. The interrupt, its softirq and the wake-up of the IO
thread it completes all preempt whatever kernel share runs on that CPU; when the IO thread also runs
there, that CPU's share is delayed twice per record. With the saver and the loader kept on the other
CPU (``sched_setaffinity``), ``benchmarks/offload_costs.py`` (steps of the configurations alternating
in one process, 10-14 measured steps, nothing else timed), N=4 step / no offload, 2-core AMD EPYC:

* ResNet-18 batch 32, 11 pairs unpinned -> off the interrupts' CPU: 1.101 -> 1.077, 1.130 -> 1.107,
  1.138 -> 1.103, 1.118 -> 1.070, 1.077 -> 1.091, 1.111 -> 1.092, 1.074 -> 1.050, 1.090 -> 1.027,
  1.045 -> 1.037, 1.076 -> 1.081, 1.067 -> 1.105 (8 of 11 better, mean -1.7 points); pinned to
  CPU 1, the interrupts' CPU: 1.100 (one run);
* MobileNetV2 batch 32, 8 pairs: 1.298 -> 1.245, 1.270 -> 1.233, 1.348 -> 1.336, 1.285 -> 1.360,
  1.266 -> 1.315, 1.237 -> 1.256, 1.270 -> 1.255, 1.265 -> 1.297: no difference beyond the noise.

``engine bench --model M --batch-size B --offload-n 4 --format json``, main (b6105db) and this code
alternating in one sitting: ResNet-18 b32 1.046 / 1.097 / 1.122 / 1.083 / 1.054 / 1.066 ->
1.046 / 1.040 / 1.081 / 1.067 / 1.087 / 1.067, b128 1.072 / 1.059 -> 1.030 / 1.019; MobileNetV2 b32
1.321 / 1.346 -> 1.307 / 1.313, b128 1.144 / 1.156 -> 1.133 / 1.146: 9 of 12 pairs better, one tie,
mean -1.9 points; small next to this machine's noise, and no arithmetic changes (same bits).
Off the interrupts' CPUs, not merely pinned: on the interrupts' CPU it did not help (above). The
same benchmark splits the cost the IO adds (MobileNetV2 batch 32, one process): the scheduler
without system calls (``noio``) +25 ms over no offload; IO threads that burn the real IO's CPU per
MiB without touching memory (``spin:50``, 23 ms) +23 ms more, i.e. one core-millisecond costs the
step ~1 ms, as a kernel split in chunks between two threads should; copying the bytes to an
in-memory file (``memfile``, 36 ms of copy CPU) +34 ms; the real IO (16 ms of CPU, stall 12-14 ms)
+43 to +53 ms: about twice its CPU plus the stall, the excess being what ``spin`` and ``memfile``
leave out (system calls' side effects, DMA, the disk's interrupts: ~160 per step, all on CPU 1).
Hypervisor steal over those runs: 0-4 ticks of ~8,000 in /proc/stat, iowait <= 1%: not the
hypervisor.

Only where it can be found out: the swap file's block device in sysfs (a partition's disk), its
PCI function's MSI interrupts (``msi_irqs``), the ones that fired (at least 1% of the device's
interrupts: a virtio device's config interrupt fires about once) and their
``/proc/irq/N/effective_affinity_list``. No device (tmpfs), no MSI interrupts, an interrupt on every
allowed CPU (NVMe's per-CPU queues), or any read failing: the threads stay where they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("engine.offload")

# an interrupt counts if it took at least this share of the device's interrupts so far
IRQ_SHARE = 0.01


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5} (the kernel's cpu-list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _device_irqs(path: str, sys_root: Path) -> list[int]:
    """The MSI interrupts of the PCI function behind the block device holding ``path``."""
    st_dev = os.stat(path).st_dev
    block = (sys_root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}").resolve()
    disk = block if (block / "device").exists() else block.parent  # a partition's disk holds 'device'
    device = (disk / "device").resolve()
    devices = (sys_root / "devices").resolve()
    for directory in (device, *device.parents):
        if directory == devices or devices not in directory.parents:
            break
        msi = directory / "msi_irqs"
        if msi.is_dir():
            return sorted(int(name) for name in os.listdir(msi) if name.isdigit())
    return []


def _irq_counts(proc_root: Path) -> dict[int, int]:
    """Interrupts taken so far, per IRQ number, summed over CPUs (``/proc/interrupts``)."""
    counts: dict[int, int] = {}
    lines = (proc_root / "interrupts").read_text().splitlines()
    ncpus = len(lines[0].split()) if lines else 0
    for line in lines[1:]:
        fields = line.split()
        if not fields or not fields[0].rstrip(":").isdigit():
            continue
        counts[int(fields[0].rstrip(":"))] = sum(int(f) for f in fields[1:1 + ncpus] if f.isdigit())
    return counts


def interrupt_cpus(path: str, *, sys_root: str = "/sys", proc_root: str = "/proc") -> frozenset[int] | None:
    """The CPUs that take the completion interrupts of the disk holding ``path``; None if unknown."""
    try:
        irqs = _device_irqs(path, Path(sys_root))
        if not irqs:
            return None
        counts = _irq_counts(Path(proc_root))
        total = sum(counts.get(irq, 0) for irq in irqs)
        fired = [irq for irq in irqs if total > 0 and counts.get(irq, 0) >= IRQ_SHARE * total]
        cpus: set[int] = set()
        for irq in fired:
            cpus |= parse_cpu_list((Path(proc_root) / "irq" / str(irq) / "effective_affinity_list").read_text())
        return frozenset(cpus) or None
    except (OSError, ValueError):
        return None


def io_thread_cpus(path: str, allowed: Iterable[int] | None = None, **roots: str) -> frozenset[int] | None:
    """The CPUs the IO threads should run on: the allowed ones (this thread's affinity) minus the
    disk's interrupt CPUs; None (leave them where they are) if that is unknown, empty or all of them."""
    allowed_set = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
    taken = interrupt_cpus(path, **roots)
    if not taken:
        return None
    rest = allowed_set - taken
    return rest if rest and rest != allowed_set else None


def pin_threads(native_ids: Iterable[int], cpus: frozenset[int] | None) -> bool:
    """Restrict the threads to ``cpus`` (no-op for None); False if the system refused."""
    if cpus is None:
        return False
    try:
        for tid in native_ids:
            os.sched_setaffinity(tid, cpus)
    except OSError as exc:
        log.debug("offload: IO threads left unpinned (%s)", exc)
        return False
    return True
