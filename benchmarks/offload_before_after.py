"""docs/offload.md's offload table: two ``engine bench --format json`` results side by side, before and after.

    engine bench --model resnet18,mobilenetv2 --batch-size 32,128 --offload-n 4 --format json > after.json
    (the same on the older code) > before.json
    python benchmarks/offload_before_after.py --before before.json --after after.json

Each run already compares offload with no offload in one process, steps interleaved, so the ratios
are fair on a shared machine; before and after are separate runs, so compare their ratios, not their
milliseconds. Several JSON files per side are concatenated (one per model, say).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.offload.scheduler import cpu_per_mib


def _load(paths: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    records = {}
    for path in paths:
        with open(path) as f:
            for record in json.load(f):
                records[(record["model"], record["batch_size"])] = record
    return records


def _io_us_per_mib(r: dict[str, Any]) -> float:
    """IO threads' CPU per MiB moved (written + read): the same figure for old and new results."""
    return cpu_per_mib(r["io_cpu_ms_per_step"] / 1e3, r["written_bytes_per_step"] + r.get("read_bytes_per_step",
                                                                                         r["written_bytes_per_step"]))


def _resident_ratio(r: dict[str, Any]) -> float:
    return r["peak_resident_bytes_offload"] / max(r["peak_resident_bytes_no_offload"], 1)


def _both(before: dict[str, Any] | None, after: dict[str, Any], fmt: str, get: Any) -> str:
    """``before → after`` (just ``after`` when there is no before)."""
    return (fmt.format(get(before)) + " → " if before is not None else "") + fmt.format(get(after))


def table(before: dict[tuple[str, int], dict[str, Any]], after: dict[tuple[str, int], dict[str, Any]]) -> str:
    mib = 2**20
    lines = [
        "| model, batch | step time with offload / without: before → after | IO threads' CPU per step "
        "(µs per MiB moved) | written per step | stall per step | saved tensors resident, offload / none "
        "(+ swap page cache) | peak RSS no offload → offload (after) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(after, key=lambda k: (k[0] != "resnet18", k)):
        a, b = after[key], before.get(key)
        lines.append(
            f"| {key[0]}, {key[1]} "
            f"| {_both(b, a, '{:.3f}×', lambda r: r['step_time_ratio'])} "
            f"| {_both(b, a, '{:.0f} ms', lambda r: r['io_cpu_ms_per_step'])} "
            f"({_both(b, a, '{:.0f}', _io_us_per_mib)}) "
            f"| {_both(b, a, '{:.0f} MiB', lambda r: r['written_bytes_per_step'] / mib)} "
            f"| {_both(b, a, '{:.0f} ms', lambda r: r['stall']['avg'] / 1e3)} "
            f"| {_both(b, a, '{:.2f}', _resident_ratio)} (+{a['page_cache_bytes_offload'] / mib:.1f} MiB) "
            f"| {a['peak_rss_bytes_no_offload'] / mib:.0f} → {a['peak_rss_bytes_offload'] / mib:.0f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True, help="engine bench JSON of the older code")
    parser.add_argument("--after", nargs="+", required=True, help="engine bench JSON of this code")
    args = parser.parse_args()
    print(table(_load(args.before), _load(args.after)))


if __name__ == "__main__":
    main()
