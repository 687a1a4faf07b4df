"""Proof under a real memory limit: ResNet-18 ImageNet, 224×224, batch 32, in a memory cgroup.

    sudo python benchmarks/cgroup_proof.py [--limit 1.1GiB] [--steps 3] [--json out.json]

Runs, each in a fresh child cgroup of this process's own memory cgroup (v2 or v1, whichever the
machine has) with the same limit:
1. ``engine train`` without offload: refuses before the first step (naming ``--offload-n auto``),
   or is OOM-killed;
2. ``engine train --offload-n auto``: completes its steps and leaves no swap directory behind;
3. the same loop in PyTorch (torchvision's resnet18, SGD with momentum, one synthetic batch);
and, for the ratio, PyTorch once more without a limit. The limit defaults to the smallest one the
engine says works with offload (the first line ``engine train --offload-n auto`` prints), so the run
also checks that prediction. Prints a Markdown table (docs/offload.md's) and optionally JSON.

Linux and root only (a cgroup is made and written); anywhere else it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

TORCH_LOOP = r"""
import importlib.util, json, resource, sys, time, types
import torch
spec = importlib.util.find_spec("torchvision")
package = types.ModuleType("torchvision"); package.__path__ = list(spec.submodule_search_locations)
sys.modules["torchvision"] = package  # models only: the wheel's C++ operators do not load beside this torch
import torchvision.models
batch, size, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10).train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 3, size, size); y = torch.randint(0, 10, (batch,))
times = []
for _ in range(steps):
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - start)
print(json.dumps({"step_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


class Cgroup:
    """A child memory cgroup of this process's own, with a limit; processes join it before exec."""

    def __init__(self, limit_bytes: int, name: str):
        from engine.memory.limits import _cgroups, _mounts

        self.version = None
        mounts = _mounts("/proc")
        for controllers, path in _cgroups("/proc"):
            for root, point, kind, options in mounts:
                rel = path[len(root.rstrip("/")):] if root != "/" and path.startswith(root) else path
                parent = os.path.normpath(os.path.join(point, rel.lstrip("/")))
                if controllers == "" and kind == "cgroup2" and self._v2_ok(parent):
                    self.version, self.parent = 2, parent
                elif kind == "cgroup" and "memory" in controllers.split(",") and "memory" in options.split(","):
                    self.version, self.parent = 1, parent
                if self.version == 1:
                    break
            if self.version == 1:
                break
        if self.version is None:
            raise RuntimeError("no memory cgroup controller is mounted (cgroup v1 'memory' or v2 with +memory)")
        self.path = os.path.join(self.parent, name)
        os.makedirs(self.path, exist_ok=True)
        self.limit_bytes = limit_bytes
        if self.version == 1:
            self._write("memory.limit_in_bytes", str(limit_bytes))
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self._write("memory.memsw.limit_in_bytes", str(limit_bytes))  # no swapping past it either
        else:
            self._write("memory.max", str(limit_bytes))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self._write("memory.swap.max", "0")

    @staticmethod
    def _v2_ok(parent: str) -> bool:
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    return False
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
            return True
        except OSError:
            return False

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def join(self) -> None:
        """Called in the child before exec (preexec_fn)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def run_in_cgroup(command: list[str], limit: int | None, name: str, timeout: float | None = None,
                  env: dict | None = None) -> dict:
    group = Cgroup(limit, name) if limit else None
    start = time.perf_counter()
    environment = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    try:
        process = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                                 preexec_fn=group.join if group else None, env=environment)
        returncode, stdout, stderr = process.returncode, process.stdout, process.stderr
    except subprocess.TimeoutExpired as exc:  # killed by subprocess.run
        returncode, stdout, stderr = -9, str(exc.stdout or ""), f"timed out after {timeout} s"
    result = {"returncode": returncode, "seconds": time.perf_counter() - start,
              "stdout": stdout[-4000:], "stderr": stderr[-4000:]}
    if group is not None:
        result["oom_kills"] = group.oom_kills()
        result["cgroup_peak_bytes"] = group.peak_bytes()
        result["cgroup"] = f"v{group.version} {group.path}"
        group.remove()
    return result


def bisect_limit(command: list[str], low: int, high: int, resolution: int = 16 << 20, timeout: float = 600,
                 name: str = "bisect", progress=None) -> tuple[int | None, list[dict]]:
    """The smallest limit (to ``resolution``) in (low, high] under which ``command`` exits 0 without an OOM kill.

    ``high`` is tried first (None when even it fails); every trial is a fresh child cgroup. A run past
    ``timeout`` seconds counts as a failure (a limit that only thrashes does not "work")."""
    trials: list[dict] = []

    def works(limit: int) -> bool:
        result = run_in_cgroup(command, limit, f"engine-{name}-{os.getpid()}", timeout=timeout)
        ok = result["returncode"] == 0 and not result.get("oom_kills")
        trials.append({"limit_bytes": limit, "ok": ok, "returncode": result["returncode"],
                       "oom_kills": result.get("oom_kills", 0), "cgroup_peak_bytes": result.get("cgroup_peak_bytes"),
                       "seconds": round(result["seconds"], 1),
                       "tail": "" if ok else (result["stdout"] + result["stderr"])[-300:]})
        if progress:
            progress(f"{name}: {gib(limit)} {'works' if ok else 'fails'} ({trials[-1]['returncode']}, "
                     f"cgroup peak {gib(trials[-1]['cgroup_peak_bytes'])}, {trials[-1]['seconds']} s)")
        return ok

    if not works(high):
        return None, trials
    while high - low > resolution:
        middle = (low + high) // 2 // (1 << 20) * (1 << 20)
        if works(middle):
            high = middle
        else:
            low = middle
    return high, trials


def smallest_offload_limit(train: list[str]) -> int:
    """What ``engine train --offload-n auto`` says it needs at N=1 (its first line), up to the next 16 MiB.

    Read from the training process itself, not ``engine memory``: its baseline (the data set, the
    libraries it has loaded) is what the limit has to hold.
    """
    process = subprocess.Popen(train + ["--offload-n", "auto"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=ROOT)
    try:
        for line in process.stdout:
            match = re.search(r"([0-9.]+) GiB with offload N=1", line)
            if match:
                needed = (float(match.group(1)) + 0.01) * 2**30  # the line rounds to 0.01 GiB
                return int(-(-needed // 2**24) * 2**24)
        raise RuntimeError("engine train --offload-n auto did not print what it needs")
    finally:
        process.kill()
        process.wait()


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def engine_row(result: dict, summary_path: str, swap_dir: str) -> dict:
    row = {"returncode": result["returncode"], "oom_kills": result.get("oom_kills", 0),
           "cgroup_peak_bytes": result.get("cgroup_peak_bytes")}
    row["swap_left"] = sorted(os.listdir(swap_dir)) if os.path.isdir(swap_dir) else []
    if result["returncode"] == 0 and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        row["step_s"] = summary["batch_size"] / summary["steady_images_per_second"] if summary.get(
            "steady_images_per_second") else summary["seconds"] / max(summary["steps"], 1)
        row["peak_rss_bytes"] = summary["peak_rss_bytes"]
    for line in (result["stdout"] + result["stderr"]).splitlines():
        if line.startswith("offload: window") or line.startswith("memory limit") or "Error:" in line:
            row.setdefault("lines", []).append(line.strip())
    return row


def describe(row: dict) -> str:
    if row["returncode"] == 0:
        text = f"{row['step_s']:.2f} s/step, peak RSS {gib(row.get('peak_rss_bytes'))}"
        window = [ln for ln in row.get("lines", []) if ln.startswith("offload: window")]
        if window:
            text += f", N={window[0].split()[2].rstrip(':')}"
        return text
    if row.get("oom_kills") or row["returncode"] in (-9, 137):
        return "OOM-killed"
    errors = [ln for ln in row.get("lines", []) if "Error:" in ln]
    text = errors[0].split("Error:", 1)[1].strip() if errors else f"exit {row['returncode']}"
    return "refused: " + re.sub(r" \(cgroup v[12] [^)]*\)", "", text)  # the cgroup's path: printed once, above


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", default=None, help="Memory limit (e.g. 1.1GiB); default: the engine's minimum.")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-torch", action="store_true", help="Leave out the PyTorch runs.")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument("--from-json", default=None, help="Only print the table of results written by --json.")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print_table(saved["limit_bytes"], saved["runs"])
        return 0

    if not sys.platform.startswith("linux"):
        print(f"cgroup_proof: needs Linux memory cgroups; this is {sys.platform}. Nothing run.")
        return 0
    if os.geteuid() != 0:
        print("cgroup_proof: needs root to create a memory cgroup (sudo). Nothing run.")
        return 0
    try:
        Cgroup(1 << 40, f"engine-proof-check-{os.getpid()}").remove()
    except (RuntimeError, OSError) as exc:
        print(f"cgroup_proof: cannot create a memory cgroup here ({exc}). Nothing run.")
        return 0

    from engine.offload.storage import parse_bytes

    engine = [sys.executable, os.path.join(ROOT, "cli.py")]
    common = ["--model", "resnet18", "--variant", "imagenet", "--image-size", str(args.image_size),
              "--batch-size", str(args.batch_size)]
    train = engine + ["train", *common, "--data", "synthetic", "--steps", str(args.steps), "--no-progress"]
    limit = parse_bytes(args.limit) if args.limit else smallest_offload_limit(train)
    print(f"limit {gib(limit)} ({limit} bytes); ResNet-18 imagenet {args.image_size}x{args.image_size}, "
          f"batch {args.batch_size}, {args.steps} steps", file=sys.stderr)

    rows: dict[str, dict] = {}
    scratch = tempfile.mkdtemp(prefix="cgroup-proof-")
    try:
        for name, extra in (("engine_no_offload", []), ("engine_offload_auto", ["--offload-n", "auto"])):
            swap_dir = os.path.join(scratch, f"swap-{name}")
            os.makedirs(swap_dir)
            summary = os.path.join(scratch, f"{name}.json")
            print(f"... {name}", file=sys.stderr)
            result = run_in_cgroup(train + extra + ["--summary-json", summary, "--offload-dir", swap_dir]
                                   if extra else train + ["--summary-json", summary], limit, f"engine-proof-{name}")
            rows[name] = engine_row(result, summary, swap_dir)
            rows[name]["output_tail"] = (result["stdout"] + result["stderr"])[-1500:]
        if not args.skip_torch:
            loop = [sys.executable, "-c", TORCH_LOOP, str(args.batch_size), str(args.image_size), str(args.steps)]
            for name, group_limit in (("torch_limited", limit), ("torch_unlimited", None)):
                print(f"... {name}", file=sys.stderr)
                result = run_in_cgroup(loop, group_limit, f"engine-proof-{name}")
                row = {"returncode": result["returncode"], "oom_kills": result.get("oom_kills", 0),
                       "cgroup_peak_bytes": result.get("cgroup_peak_bytes")}
                if result["returncode"] == 0:
                    row.update(json.loads(result["stdout"].strip().splitlines()[-1]))
                else:
                    row["output_tail"] = result["stderr"][-1500:]
                rows[name] = row
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print_table(limit, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limit_bytes": limit, "batch_size": args.batch_size, "image_size": args.image_size,
                       "steps": args.steps, "runs": rows}, f, indent=2)
    return 0


def print_table(limit: int, rows: dict) -> None:
    def torch_text(row: dict | None) -> str:
        if row is None:
            return "not run"
        if row["returncode"] == 0:
            return f"{row['step_s']:.2f} s/step, peak RSS {gib(row['peak_rss_bytes'])}"
        return "OOM-killed" if row.get("oom_kills") or row["returncode"] in (-9, 137) else f"exit {row['returncode']}"

    sources = [re.search(r"\((cgroup v[12] [^)]*)\)", ln) for r in rows.values() for ln in r.get("lines", [])]
    found = next((m.group(1) for m in sources if m), None)
    if found:
        print(f"limit set in {found.replace('memory.limit_in_bytes', '').replace('memory.max', '')}")
    print("| limit | engine, no offload | engine, --offload-n auto | PyTorch, same limit | PyTorch, no limit |")
    print("|---|---|---|---|---|")
    print(f"| {gib(limit)} | {describe(rows['engine_no_offload'])} | {describe(rows['engine_offload_auto'])} | "
          f"{torch_text(rows.get('torch_limited'))} | {torch_text(rows.get('torch_unlimited'))} |")
    left = rows["engine_offload_auto"].get("swap_left")
    print(f"swap directory after the offload run: {'empty' if not left else left}")
    free = rows.get("torch_unlimited", {}).get("peak_rss_bytes")
    if free:
        print(f"limit / PyTorch's peak RSS without a limit: {limit / free:.2f}")


if __name__ == "__main__":
    sys.exit(main())
