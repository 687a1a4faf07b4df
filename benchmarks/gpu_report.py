"""One report from a GPU session's pieces (benchmarks/gpu_session.sh): JSON to commit, markdown to read.

Reads from the session folder ($OUT): env.json (device, versions), tile_search.json and gemm_table.json
(benchmarks/gpu_tile_search.py), gpu_acceptance.json (engine/bench/gpu_acceptance.py), step_bench.json
(benchmarks/gpu_step_bench.py: step_bench.json, or its parts step_*.json) and steps.json
(each step's exit status and seconds); writes
gpu-<date>.json (commit as benchmarks/results/gpu-<date>.json) and gpu-<date>.md. A missing piece is
reported as missing, never filled in.

Schema ``gpu-session/1``: device, versions, date; ``steps``; ``step`` (per model: images/s eager and
captured, host µs per step, same weights); ``offload`` (images/s with and without, same loss);
``imagenet`` (224×224 runs); ``gemm`` (per shape: ours, the default before the search, cuBLAS, ratio);
``acceptance`` (pass, failures); ``goals`` (each goal, its figure, met or not).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

SCHEMA = "gpu-session/1"


def _load(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        return {"unreadable": str(exc)}


def build(folder: str, date: str) -> dict[str, Any]:
    env = _load(folder, "env.json") or {}
    search = _load(folder, "tile_search.json") or {}
    bench: dict[str, Any] = {"graph": [], "offload": [], "imagenet": []}
    for name in ("step_bench.json", "step_graph.json", "step_offload.json", "step_imagenet.json"):
        part = _load(folder, name) or {}
        for key in ("graph", "offload", "imagenet"):
            bench[key] += part.get(key, [])
        bench["dry"] = bench.get("dry") or part.get("dry", False)
        if "offload_same_loss" in part and part.get("offload"):
            bench["offload_same_loss"] = part["offload_same_loss"]
    accept = _load(folder, "gpu_acceptance.json")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "date": date,
        "device": env.get("device") or search.get("device"),
        "versions": env.get("versions", {}),
        "dry": bool(bench.get("dry")),
        "steps": _load(folder, "steps.json") or {},
        "missing": [n for n in ("env.json", "tile_search.json", "gemm_table.json", "gpu_acceptance.json",
                                "step_bench.json") if not os.path.exists(os.path.join(folder, n))],
    }
    report["step"] = []
    for r in bench.get("graph", []):
        if "error" in r:
            continue
        eager, graph = r["eager"], r.get("graph") or {}
        report["step"].append({
            "model": r["model"], "batch": r["batch"],
            "eager_images_per_second": eager["images_per_second"],
            "graph_images_per_second": graph.get("images_per_second"),
            "eager_host_us_per_step": eager["host_us_per_step"],
            "graph_host_us_per_step": graph.get("host_us_per_step"),
            # the captured step's host waits for a pinned staging buffer (the GPU's time, not the host's work)
            "graph_host_wait_us_per_step": graph.get("host_wait_us_per_step"),
            "graph_launches": graph.get("graph_launches"), "same_weights": r["same_weights"],
            "eager_reason": graph.get("eager_reason"), "graph_error": r.get("graph_error")})
    report["errors"] = [{"model": r["model"], "error": r.get("error") or r.get("graph_error")}
                        for r in bench.get("graph", []) if r.get("error") or r.get("graph_error")]
    report["offload"] = {"runs": bench.get("offload", []), "same_loss": bench.get("offload_same_loss")}
    report["imagenet"] = bench.get("imagenet", [])
    report["gemm"] = [
        {"key": r["key"], "model": r["model"], "direction": r["direction"], "shape": r["shape"],
         "config": r["best_config"], "splits": r["best_splits"], "tflops": r["best_tflops"],
         "default_tflops": r["default_tflops"], "cublas_tflops": r["cublas_tflops"],
         "of_cublas": (r["best_tflops"] / r["cublas_tflops"]) if r.get("cublas_tflops") else None}
        for r in search.get("rows", [])
    ]
    report["plain_gemm"] = [  # the tile loop alone: square MATRIX GEMMs, every candidate beside cuBLAS
        dict(p, of_cublas=(p["tflops"] / p["cublas_tflops"]) if p.get("cublas_tflops") else None)
        for p in search.get("plain", [])
    ]
    report["acceptance"] = None if accept is None else {
        "passed": not accept.get("failures"), "failures": accept.get("failures", []),
        "checks": len(accept.get("checks", [])), "host_launch_us": accept.get("host_launch_us")}
    profile = _load(folder, "kernel_profile.json") or {}
    report["profile"] = [{key: step.get(key) for key in ("model", "options", "image_size", "batch", "launches",
                                                          "step_kernel_ms", "step_roofline_ms", "error")}
                         | {"kernels": step.get("kernels", [])[:12]} for step in profile.get("steps", [])]
    report["goals"] = goals(report)
    if report["dry"]:  # a simulator's figures decide no goal
        for goal in report["goals"]:
            goal["met"] = None
    return report


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each with the figure that decides it (None when the session did not measure it)."""
    out = []
    resnet = next((r for r in report["step"] if r["model"] == "resnet18"), None)
    graph = resnet["graph_images_per_second"] if resnet else None
    out.append({"goal": "ResNet-18 CIFAR batch 32 >= 2,000 images/s without offload", "figure": graph,
                "met": None if graph is None else graph >= 2000})
    runs: dict[Any, dict[str, Any]] = {}
    for r in report["offload"]["runs"]:  # "without": the first run without offload (engine train's default step)
        if not r.get("offload_args"):  # the disk tier's run (--offload-host-memory 0) is reported, not a goal
            runs.setdefault(r.get("offload_n"), r)
    with_offload = next((r for n, r in runs.items() if n is not None), {})  # N=4 (the dry run's N=1)
    on, off = with_offload.get("steady_images_per_second"), (runs.get(None) or {}).get("steady_images_per_second")
    ratio = on / off if on and off else None
    out.append({"goal": "with --offload-n 4 >= 0.8x without (engine train)", "figure": ratio,
                "met": None if ratio is None else ratio >= 0.8})
    host = resnet["graph_host_us_per_step"] if resnet else None
    out.append({"goal": "host time per captured step <= 1 ms", "figure": host,
                "met": None if host is None else host <= 1000})
    ratios = [g["of_cublas"] for g in report["gemm"] if g["of_cublas"] is not None]
    worst = min(ratios) if ratios else None
    out.append({"goal": "conv GEMMs >= 40% of cuBLAS (worst shape)", "figure": worst,
                "met": None if worst is None else worst >= 0.4})
    return out


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def offload_cell(offload: dict[str, Any] | None) -> str:
    """A run's offload summary (engine train --summary-json) in one cell: where the swapped bytes went
    (pinned host memory or the swap file), the executor's wait per step, and the bytes out and back."""
    if not offload:
        return "–"
    tier = offload.get("swap_tier") or "swap file"
    return (f"N={offload.get('window')}, {tier}, stall {_f(offload.get('stall_ms_per_step'), 1)} ms, "
            f"{_f((offload.get('written_bytes_per_step') or 0) / 1e6, 1)} MB out / "
            f"{_f((offload.get('read_bytes_per_step') or 0) / 1e6, 1)} MB back")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU session {report['date']}: {report['device']}", ""]
    if report["dry"]:
        lines += ["**Dry run under the CUDA simulator: no figure here is a GPU's.**", ""]
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    if report["missing"]:
        lines += [f"Missing pieces: {', '.join(report['missing'])}", ""]
    lines += ["| goal | figure | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {_f(g['figure'], 2)} | {_f(g['met'])} |" for g in report["goals"]]
    lines += ["", "| model | eager images/s | graph images/s | host µs/step eager / graph | graph's wait µs/step "
              "| launches | same weights |", "|---|---|---|---|---|---|---|"]
    for r in report["step"]:
        lines.append(f"| {r['model']} b{r['batch']} | {_f(r['eager_images_per_second'])} | "
                     f"{_f(r['graph_images_per_second'])} | {_f(r['eager_host_us_per_step'], 0)} / "
                     f"{_f(r['graph_host_us_per_step'], 0)} | {_f(r.get('graph_host_wait_us_per_step'), 0)} | "
                     f"{r['graph_launches']} | {r['same_weights']} |")
    lines += ["", "| engine train | exit | CUDA graph | steady images/s | final loss | offload: swap tier, stall per "
                  "step, moved per step |", "|---|---|---|---|---|---|"]
    for r in report["offload"]["runs"] + report["imagenet"]:
        why = r.get("cuda_graph_error") or r.get("cuda_graph_eager_reason")
        graph = _f(r.get("cuda_graph")) + (f" ({why[:80]})" if why else "")
        lines.append(f"| {r['command'].split('train ', 1)[-1][:110]} | {r['returncode']} | {graph} | "
                     f"{_f(r.get('steady_images_per_second'))} | {_f(r.get('final_loss'), 6)} | "
                     f"{offload_cell(r.get('offload'))} |")
    ratio = next((g["figure"] for g in report["goals"] if g["goal"].startswith("with --offload-n")), None)
    eager = next((r.get("steady_images_per_second") for r in report["offload"]["runs"]
                  if r.get("offload_n") is None and "--no-cuda-graph" in r.get("command", "")), None)
    rates = {(bool(r.get("offload_args")), "--no-cuda-graph" in r.get("command", "")): r.get("steady_images_per_second")
             for r in report["offload"]["runs"] if r.get("offload_n") is not None}
    against_eager = ", ".join(f"{'swap file' if disk else 'default tier'}{' eager' if eager_run else ''} "
                              f"{_f(rate / eager, 2)}x" for (disk, eager_run), rate in rates.items() if rate and eager)
    lines += ["", f"Offload (ResNet-18 CIFAR b32): {_f(ratio, 2)}x the images/s without (engine train's default "
                  f"step); against the eager step without offload (--no-cuda-graph): {against_eager or '–'}; "
                  f"same final loss: {_f(report['offload'].get('same_loss'))}"]
    lines += ["", "| GEMM | config / splits | TFLOP/s | default | cuBLAS | of cuBLAS |", "|---|---|---|---|---|---|"]
    for g in report["gemm"]:
        lines.append(f"| {g['key']} | {g['config']} / {g['splits']} | {_f(g['tflops'], 2)} | "
                     f"{_f(g['default_tflops'], 2)} | {_f(g['cublas_tflops'], 2)} | {_f(g['of_cublas'], 2)} |")
    if report.get("plain_gemm"):
        lines += ["", "| plain GEMM (tile loop alone) | config | TFLOP/s | cuBLAS | of cuBLAS |",
                  "|---|---|---|---|---|"]
        for p in report["plain_gemm"]:
            lines.append(f"| {p['size']}³ | {p['config']} | {_f(p['tflops'], 2)} | {_f(p['cublas_tflops'], 2)} | "
                         f"{_f(p['of_cublas'], 2)} |")
    if report["acceptance"] is not None:
        a = report["acceptance"]
        lines += ["", f"Acceptance: {'PASS' if a['passed'] else 'FAIL'} ({a['checks']} kernel checks, host "
                      f"{_f(a['host_launch_us'])} µs a launch)"] + [f"- {f}" for f in a["failures"]]
    for p in report.get("profile", []):
        name = f"{p['model']} {p['image_size']}x{p['image_size']} b{p['batch']}"
        if p.get("error"):
            lines += ["", f"Kernel profile {name}: failed ({p['error']})"]
            continue
        lines += ["", f"Kernel profile {name} (benchmarks/gpu_kernel_profile.py, "
                      f"{'simulator wall time' if report['dry'] else 'graph-timed'}): {p['launches']} "
                      f"launches, {_f(p['step_kernel_ms'], 2)} ms of kernels a step, roofline "
                      f"{_f(p['step_roofline_ms'], 2)} ms", "", "| kernel | launches | ms a step | roofline ms |",
                  "|---|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['launches']} | {_f(k['ms'], 3)} | {_f(k['roofline_ms'], 3)} |"
                  for k in p["kernels"]]
    for e in report.get("errors", []):
        lines += ["", f"**{e['model']}: eager vs graph failed**", "", "```", e["error"].strip(), "```"]
    lines += ["", "Steps: " + ", ".join(f"{k} rc={v.get('rc')} {v.get('seconds')} s" for k, v in
                                       report["steps"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the session's output folder ($OUT)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    options = parser.parse_args(argv)
    report = build(options.folder, options.date)
    base = os.path.join(options.folder, f"gpu-{options.date}")
    with open(base + ".json", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    text = markdown(report)
    with open(base + ".md", "w", encoding="utf-8") as handle:
        handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
