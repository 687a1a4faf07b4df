"""How much memory this process may use: the cgroup limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``), else the RAM the kernel reports available.

Containers, systemd units, Slurm jobs and ``systemd-run -p MemoryMax=`` put a process in a memory
cgroup: past the limit the kernel reclaims page cache and then OOM-kills, whatever ``free`` says about
the machine. So a budget that "follows the machine" reads the cgroup first. The cgroup of this process
comes from ``/proc/self/cgroup``; its directory from ``/proc/self/mountinfo`` (the mount's root is
subtracted, so a cgroup namespace or a bind mount of a subtree both resolve). A limit set on an
ancestor binds too, so the smallest limit on the path up to the mount wins. Without a limit (the
v1 "unlimited" value is 2**63 rounded down to a page), ``MemAvailable`` plus this process's RSS is what
it may grow to: available RAM counts what others hold, not what we already hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as 9223372036854771712 (2**63 - page); anything this large


@dataclass(frozen=True)
class MemoryLimit:
    """``bytes`` this process may use at most, and where that figure came from (shown to the user)."""

    bytes: int
    source: str

    def describe(self) -> str:
        return f"{self.bytes / 2**30:.2f} GiB ({self.source})"


def _mounts(proc: str) -> list[tuple[str, str, str, str]]:
    """(root, mount point, filesystem type, super options) of every cgroup mount."""
    found = []
    try:
        with open(os.path.join(proc, "self", "mountinfo"), encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if " - " not in line:
                    continue
                after = line.split(" - ", 1)[1].split()
                if after and after[0] in ("cgroup", "cgroup2"):
                    found.append((fields[3], fields[4], after[0], after[2] if len(after) > 2 else ""))
    except OSError:
        pass
    return found


def _cgroups(proc: str) -> list[tuple[str, str]]:
    """(controllers, path) lines of /proc/self/cgroup."""
    lines = []
    try:
        with open(os.path.join(proc, "self", "cgroup"), encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    lines.append((parts[1], parts[2]))
    except OSError:
        pass
    return lines


def _read_limit(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED_V1 else value


def _smallest_on_path(mount_point: str, mount_root: str, cgroup_path: str, file_name: str) -> tuple[int, str] | None:
    """The smallest ``file_name`` limit from the process's cgroup directory up to the mount point."""
    relative = cgroup_path
    if mount_root != "/" and (relative == mount_root or relative.startswith(mount_root.rstrip("/") + "/")):
        relative = relative[len(mount_root.rstrip("/")):]
    directory = os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))
    best: tuple[int, str] | None = None
    while True:
        value = _read_limit(os.path.join(directory, file_name))
        if value is not None and (best is None or value < best[0]):
            best = (value, os.path.join(directory, file_name))
        if os.path.normpath(directory) == os.path.normpath(mount_point) or len(directory) <= len(mount_point):
            return best
        directory = os.path.dirname(directory)


def cgroup_limit(proc: str = "/proc") -> tuple[int, str] | None:
    """(bytes, file) of the tightest memory cgroup limit on this process, or None when there is none."""
    mounts = _mounts(proc)
    found: list[tuple[int, str]] = []
    for controllers, path in _cgroups(proc):
        if controllers == "":  # cgroup v2: "0::/path"
            for root, point, kind, _ in mounts:
                if kind == "cgroup2":
                    hit = _smallest_on_path(point, root, path, "memory.max")
                    if hit:
                        found.append((hit[0], f"cgroup v2 {hit[1]}"))
        elif "memory" in controllers.split(","):
            for root, point, kind, options in mounts:
                if kind == "cgroup" and "memory" in options.split(","):
                    hit = _smallest_on_path(point, root, path, "memory.limit_in_bytes")
                    if hit:
                        found.append((hit[0], f"cgroup v1 {hit[1]}"))
    return min(found) if found else None


def available_ram() -> int:
    """What this process may grow to without a cgroup: MemAvailable plus its own RSS."""
    import psutil

    return int(psutil.virtual_memory().available + psutil.Process().memory_info().rss)


def address_space_limit(proc: str = "/proc") -> tuple[int, str] | None:
    """(bytes, description) of what ``ulimit -v`` (RLIMIT_AS) leaves this process to grow its resident set
    by, counted like a memory limit, or None when there is no such limit.

    RLIMIT_AS bounds the address space, not the resident set: a process that already maps more than it
    touched (thread stacks, libraries, reserved heaps) reaches it earlier. Everything a run still
    allocates is new address space, so the equivalent bound on the resident set is the limit less what is
    mapped but not resident now. Without this, a too-large batch under ``ulimit -v`` ended in NumPy's
    MemoryError traceback in the first step instead of a refusal."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    sizes = {}
    try:
        with open(os.path.join(proc, "self", "status"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmSize", "VmRSS"):
                    sizes[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    unbacked = max(0, sizes.get("VmSize", 0) - sizes.get("VmRSS", 0))
    return (max(0, soft - unbacked),
            f"ulimit -v {soft // 1024} KiB, less {unbacked / 2**20:.0f} MiB mapped but not resident")


def memory_limit(proc: str = "/proc", ranks_on_host: int = 1) -> MemoryLimit:
    """The tightest of: the cgroup limit, what ``ulimit -v`` leaves (``address_space_limit``), available RAM.

    ``ranks_on_host``: the data-parallel ranks of one job on this host (``engine train --workers K`` runs K
    processes in the launcher's cgroup, started together). The cgroup and the available RAM are theirs
    together, so each rank gets an equal share of them; ``ulimit -v`` bounds each process by itself and is
    not shared. Without the share, each of two ranks planned against the whole limit and both were
    OOM-killed together (issue 30: every run refused before its first step when it cannot fit)."""
    k = max(1, int(ranks_on_host))

    def shared(bytes_: int, source: str) -> tuple[int, str]:
        return (bytes_, source) if k == 1 else (bytes_ // k, f"{source}, shared by {k} ranks on this host")

    found = [shared(available_ram(), "available RAM")]
    cgroup = cgroup_limit(proc)
    if cgroup is not None:
        found.append(shared(*cgroup))
    address_space = address_space_limit(proc)
    if address_space is not None:
        found.append(address_space)
    return MemoryLimit(*min(found))


def resident_bytes() -> int:
    """This process's resident set size now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def resident_parts(proc: str = "/proc") -> dict[str, int]:
    """This process's resident set by kind (``RssAnon``, ``RssFile``, ``RssShmem`` of /proc/self/status), bytes.

    Anonymous pages (the heap, arrays, thread stacks) can only leave memory by an OOM kill under a
    cgroup without swap; file pages (the libraries' code, mapped files) are reclaimed and read back under
    pressure. So they count differently towards the smallest limit a run needs (engine.offload.budget)."""
    parts = {"anon": 0, "file": 0, "shmem": 0}
    try:
        with open(os.path.join(proc, "self", "status"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    parts[key[3:].lower()] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        total = resident_bytes()
        return {"anon": total, "file": 0, "shmem": 0}
    return parts


def resident_array_bytes(array: object) -> int:
    """How many bytes of a NumPy array's memory are resident now (mincore over its pages).

    A block made with ``np.zeros``/``np.empty`` takes no memory until it is written (the kernel maps
    zero pages on first touch), so what a run will still add is its planned bytes less this. Pages the
    array shares with its neighbours count whole. 0 on platforms without mincore."""
    import ctypes

    import numpy as np

    if not isinstance(array, np.ndarray) or array.nbytes == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.ctypes.data // page * page
    stop = -(-(array.ctypes.data + array.nbytes) // page) * page
    pages = (stop - start) // page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), vector) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    resident = int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1))
    return min(array.nbytes, resident * page)


__all__ = ["MemoryLimit", "address_space_limit", "available_ram", "cgroup_limit", "memory_limit",
           "resident_array_bytes", "resident_bytes", "resident_parts"]
