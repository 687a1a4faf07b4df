"""The `engine` command line: info, train, eval, bench, kernels, memory.

Each command imports the engine lazily, inside its body: `engine --help` stays instant, and
`--backend cudasim` can set NUMBA_ENABLE_CUDASIM before anything imports numba.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import tempfile
from typing import Any

import click

from engine.backend import BACKEND_NAMES, BackendUnavailable
from engine.errors import UserError
from engine.validate import MAX_BATCH_SIZE, MAX_CLASSES, MAX_IMAGE_SIZE, number, parse_window
from kernels.errors import SettingError


def fail(message: str) -> None:
    """Stop with a one-line error (no traceback): the message names the problem and the fix."""
    raise click.ClickException(message)


def select_backend(name: str):
    """The backend for a command; switches on the CUDA simulator first when asked for."""
    from engine.backend import get_backend

    try:
        return get_backend(name)
    except BackendUnavailable as exc:
        fail(str(exc))


class EngineGroup(click.Group):
    """The one place user-caused errors become one line: any ``engine.errors.UserError`` (bad option, bad
    file, disk fault, signal) is printed as ``Error: <message>`` with its exit code, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            error = click.ClickException(str(exc))
            error.exit_code = exc.exit_code
            raise error from None
        except SettingError as exc:  # an ENGINE_* variable the kernels read (ENGINE_BLAS, ENGINE_SPIN_US, …)
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            error = click.ClickException("interrupted (SIGINT)")
            error.exit_code = 130
            raise error from None


@click.group(cls=EngineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="numba-offload-engine")
def main() -> None:
    """A readable training engine: Numba kernels, typed workspaces, disk offload of layer windows.

    Start with: engine train --model resnet18 --offload-n 4
    """
    from engine.streams import guard_standard_streams

    guard_standard_streams()  # a lost terminal or a closed pipe stops a run like a signal, never as a crash


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def info(as_json: bool) -> None:
    """Versions, available backends (and why not), threads, BLAS and the Numba cache."""
    from engine.info import collect_info, render_info

    report = collect_info()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render_info(report)


# --- kernels: benchmark table and cache warm-up (kernels issue) ---


@main.command()
@click.option("--backend", type=click.Choice(["cpu", "cudasim", "cuda"]), default="cpu", show_default=True,
              help="Kernel table to time (cudasim: the CUDA kernels in the simulator; use a tiny --batch-size).")
@click.option("--ops", default="", help="Comma-separated op prefixes to keep, e.g. conv2d,dense (default: all).")
@click.option("--models", default="resnet18,mobilenetv2", show_default=True, help="Whose conv shapes to time.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(1))
@click.option("--image-size", default=32, show_default=True, type=click.IntRange(8),
              help="The models' conv shapes at this image size (above 32: their ImageNet variants, as engine train).")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(1), help="Timed calls; the best counts.")
@click.option("--compare", type=click.Choice(["torch"]), default=None, help="Also time torch's CPU op (2 threads).")
@click.option("--rounds", default=None, type=click.IntRange(1),
              help="Rounds of --repeat calls per kernel, alternating with torch's; each side's best round counts."
                   "  [default: 3 with --compare torch, else 1]")
@click.option("--versions/--no-versions", default=True, show_default=True,
              help="Also time the numbered conv versions (cpu backend).")
@click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Write the JSON records to this file.")
@click.option("--warmup", is_flag=True, help="Only compile every CPU kernel into Numba's cache; print the time.")
# --- CUDA options (issue 16): --static, --roofline, --launches; logic in engine/bench/cuda_*.py, roofline.py ---
@click.option("--static", "static", is_flag=True,
              help="--backend cuda: ptxas -v registers, spills, shared memory and occupancy (sm_80, sm_90); no GPU.")
@click.option("--roofline", "roofline", is_flag=True,
              help="--backend cuda: per-kernel FLOPs, bytes and roofline time on A100/H100, summed per step.")
@click.option("--launches", "launches", is_flag=True,
              help="--backend cuda|cudasim: kernel launches per training step (counted, not run).")
def kernels(backend, ops, models, batch_size, repeat, compare, rounds, versions, output_format, output, warmup,
            static, roofline, launches, image_size=32) -> None:
    """Time every kernel on ResNet-18 and MobileNetV2 shapes against NumPy's sgemm (and torch)."""
    if output:
        from engine.validate import check_output_path

        check_output_path("--output", output)
    if static or roofline or launches:
        _cuda_reports(backend, static, roofline, launches, models, batch_size, output_format, output)
        return
    if backend == "cuda":
        select_backend("cuda")
        from engine.bench.cuda_timing import run_timings

        run_timings(models, batch_size, repeat, output_format, output)
        return
    if warmup:
        from engine.bench.kernels import warm_up
        from engine.warmup import ProgressLine

        seconds, calls = warm_up(parallel=True, progress=ProgressLine(prefix="compiling kernels"))
        click.echo(f"warm-up: {calls} CPU kernel calls in {seconds:.2f} s (Numba cache: compiled or loaded)")
        return
    chosen_models = tuple(m.strip() for m in models.split(",") if m.strip())
    unknown = [m for m in chosen_models if m not in ("resnet18", "mobilenetv2")]
    if unknown:
        fail(f"--models: unknown {', '.join(unknown)}; choose from resnet18, mobilenetv2")
    if compare == "torch":
        import importlib.util

        if importlib.util.find_spec("torch") is None:  # not imported here: torch is timed in its own process
            fail("--compare torch needs PyTorch: pip install -e '.[test]'")
    select_backend(backend)
    from engine.bench import kernels as kernel_bench

    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    cases, missing = kernel_bench.build_cases(backend, op_list, batch_size, versions, chosen_models, image_size)
    if not cases:
        fail(f"no kernels match --ops {ops!r} on backend {backend}")
    sgemm = kernel_bench.sgemm_gflops(repeat)
    rounds = rounds or (3 if compare == "torch" else 1)
    if compare == "torch":
        with kernel_bench.TorchProcess(op_list, batch_size, versions, chosen_models, repeat,
                                       image_size) as torch_process:
            records = kernel_bench.measure(cases, backend, repeat, sgemm, torch_process=torch_process, rounds=rounds)
    else:
        records = kernel_bench.measure(cases, backend, repeat, sgemm, rounds=rounds)
    dicts = [dict(r.as_dict(), sgemm_gflops=sgemm, repeat=repeat, rounds=rounds) for r in records]
    if output:
        from engine.validate import write_output

        write_output("--output", output, json.dumps(dicts, indent=2))
        click.echo(f"wrote {output} ({len(dicts)} records)", err=True)  # stderr: stdout may be the JSON itself
    if output_format == "json":
        click.echo(json.dumps(dicts, indent=2))
    else:
        kernel_bench.render(records, sgemm, compare == "torch", rounds=rounds)
        if missing:
            click.echo(f"not in the {backend} table yet (skipped): {', '.join(missing)}")


def _cuda_reports(backend, static, roofline, launches, models, batch_size, output_format, output) -> None:
    """The CUDA reports that need no GPU (issue 16): each prints a table or JSON."""
    if static and backend != "cuda":
        fail("--static reports the CUDA kernels: add --backend cuda (no GPU needed)")
    if roofline and backend != "cuda":
        fail("--roofline models the CUDA kernels: add --backend cuda (no GPU needed)")
    if launches and backend not in ("cuda", "cudasim"):
        fail("--launches counts CUDA kernel launches: add --backend cudasim (no GPU) or --backend cuda")
    if launches and backend == "cudasim":
        select_backend("cudasim")
    from engine.bench import cuda_reports

    chosen = tuple(m.strip() for m in models.split(",") if m.strip())
    try:
        records = cuda_reports.run(static, roofline, launches, chosen, batch_size, backend, output_format)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    if output:
        with open(output, "w") as handle:
            json.dump(records, handle, indent=2)


# --- train, eval, memory (training issue) ---

MODEL_CHOICES = ("resnet18", "mobilenetv2", "cnn", "mlp")  # models.MODEL_NAMES, without importing models here
# imagenet issue: torchvision's two shapes of resnet18 / mobilenetv2 (models.VARIANTS)
variant_option = click.option(
    "--variant", type=click.Choice(["cifar", "imagenet"]), default=None,
    help="resnet18/mobilenetv2: cifar (stems for 32x32) or imagenet (torchvision's exact model); "
         "default: cifar up to 64 px, imagenet above.")


def _set_threads(count: int | None) -> None:
    if count is not None:
        from engine.threads import set_threads

        try:
            set_threads(count)
        except ValueError as exc:
            fail(str(exc))


def _parallel_world(workers: int | None, command: str, stop=None):
    """Data parallel (issue 12): the MPI world this process is a rank of (None: one process).

    Under mpiexec/srun it joins that world; with ``--workers K`` and no launcher it starts K ranks
    through the mpich wheel's mpiexec, waits, and exits with their status (see engine.parallel.comm).
    """
    from engine.parallel.comm import ParallelError, start_or_join, under_launcher

    argv = sys.argv[1:]
    if workers not in (None, 1) and not under_launcher() and (not argv or argv[0] != command):
        fail(f"--workers {workers}: cannot relaunch this program; start it with mpiexec -n {workers} instead")
    try:
        world, status = start_or_join(workers, argv, stop)  # stop: the launcher passes a stop signal on to the ranks
    except ParallelError as exc:
        fail(str(exc))
    if status is not None:
        sys.exit(status)
    return world


def _abort_on_error_in_ranks(function):
    """Data parallel (issue 12): an error on one rank prints one line naming it and ends every rank."""
    from engine.parallel.comm import abort_on_error_in_ranks

    return abort_on_error_in_ranks(function)


def _load_data(spec: str, num_classes: int | None, seed: int, image_size: int | None = None):
    from engine.data import DataError, load_dataset

    try:
        return load_dataset(spec, num_classes=num_classes, seed=seed, image_size=image_size)
    except DataError as exc:
        fail(str(exc))


def _build_network(model: str, data, backend, seed: int, workspace_mode: str = "enabled", variant: str | None = None,
                   chunkable: bool | str = True):
    from models import build_network

    try:
        return build_network(model, data, backend, seed=seed, workspace_mode=workspace_mode, variant=variant,
                             chunkable=chunkable)
    except ValueError as exc:
        fail(str(exc))


@main.command()
@click.option("--model", required=True, type=click.Choice(MODEL_CHOICES), help="The network to train.")
@click.option("--data", "data_spec", default="digits", show_default=True,
              help="synthetic | digits | cifar10:DIR | cifar100:DIR | mnist:DIR | npz:FILE | imagefolder:DIR")
@click.option("--image-size", type=click.IntRange(8), default=None,
              help="imagefolder: crop size (default 224); synthetic: image side (default 32).")
@variant_option
@click.option("--num-classes", type=int, default=None, callback=number(2, MAX_CLASSES),
              help="Output classes (default: the data set's).")
@click.option("--batch-size", type=int, default=32, show_default=True, callback=number(1, MAX_BATCH_SIZE))
@click.option("--epochs", type=int, default=None, callback=number(1),
              help="Passes over the training split (default 1).")
@click.option("--steps", type=int, default=None, callback=number(1),
              help="Train this many steps in total instead of --epochs.")
@click.option("--lr", type=float, default=None, callback=number(0, low_open=True),
              help="Learning rate (default: 0.01 for sgd, 0.001 for adam).")
@click.option("--lr-schedule", default="constant", show_default=True, help="constant | cosine | step | step:N[:GAMMA]")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option("--momentum", type=float, default=0.9, show_default=True, callback=number(0, 1, high_open=True),
              help="SGD momentum.")
@click.option("--nesterov", is_flag=True, help="Nesterov momentum (SGD).")
@click.option("--update-after-backward", is_flag=True,  # issue 13: the update in backward (engine.optim)
              help="Keep every layer's gradients to the end of backward and update once. Default in one process: "
                   "each layer is updated right after its backward, keeping one layer's gradients (same weights).")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, callback=number(0),
              help="L2 weight decay.")
@click.option("--seed", type=int, default=0, show_default=True, callback=number(0, 2**63 - 1),
              help="Weights, shuffling, augmentation, dropout.")
@click.option("--backend", "backend_name", type=click.Choice(BACKEND_NAMES), default="auto", show_default=True)
@click.option("--workspace-mode", type=click.Choice(["enabled", "none"]), default="enabled", show_default=True,
              help="none: every tensor its own allocation (to compare against workspaces).")
@click.option("--weights", type=click.Path(dir_okay=False), default=None,
              help="Initial weights: a checkpoint or a PyTorch state_dict saved as safetensors.")
@click.option("--save", type=click.Path(dir_okay=False), default=None,
              help="Write a checkpoint here at the end (and at a signal, a diverging loss or a disk fault).")
@click.option("--checkpoint-every", type=int, default=0, show_default=True, callback=number(0),
              help="Also write the --save checkpoint every N steps (0: only at the end).")
@click.option("--override", default="", help="With --resume: options allowed to differ from the checkpoint's, "
              "comma-separated (e.g. lr,steps).")
@click.option("--resume", type=click.Path(dir_okay=False), default=None,
              help="Continue a run from its checkpoint (same bits as never stopping).")
@click.option("--memory-log", type=click.Path(dir_okay=False), default=None, help="Per-step memory, JSON lines.")
@click.option("--memory-plot", type=click.Path(dir_okay=False), default=None, help="Memory timeline PNG.")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None, help="Write the summary as JSON.")
@click.option("--no-shuffle", is_flag=True, help="Serve the training split in file order.")
@click.option("--augment", is_flag=True, help="Random crop (padding 4) and horizontal flip.")
@click.option("--threads", type=int, default=None, callback=number(1),
              help="Threads for Numba kernels and BLAS (default: all cores).")
@click.option("--prefetch", type=int, default=None, callback=number(0, 64),
              help="Batches prepared ahead; 0 turns it off. Default: 2, or fewer when the memory limit needs it.")
@click.option("--gc-every", type=int, default=100, show_default=True, callback=number(0),
              help="Python's cyclic GC is off during steps and runs every K steps (0: never explicitly).")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar.")
@click.option("--progress-interval", type=float, default=10.0, show_default=True, callback=number(0),
              help="Seconds between progress lines when the output is not a terminal (a pipe, a log file).")
@click.option("--cuda-graph/--no-cuda-graph", "cuda_graph", default=None,
              help="Capture the training step as one CUDA graph and replay it (same weights as eager). Default: on "
                   "with --backend cuda, offload included while it swaps to pinned host memory (the disk tier and "
                   "--offload-n auto run eagerly; the summary says why); off with --offload-params or --workers; "
                   "--backend cudasim: the simulator's stand-in, off unless asked for.")
# --- offload options (offload issue): --offload-n, --offload-budget, --offload-dir, --offload-params go here ---
@click.option("--offload-n", "offload_n", default=None,
              help="Swap saved tensors to disk, keeping a window of N layers in memory; 'auto' adapts N.")
@click.option("--offload-budget", "offload_budget", default=None,
              help="Resident bytes for the offload plan (e.g. 256MB), a share of what the step keeps without offload "
                   "(e.g. 0.3x), or 'auto' (the cgroup limit or available RAM less everything else; --offload-n auto "
                   "uses it too); what the window leaves of it keeps units instead of writing them; alone, N=4.")
@click.option("--offload-dir", "offload_dir", default=None, type=click.Path(file_okay=False),
              help="Where the private swap directory goes (default: the system temp directory).")
@click.option("--offload-params", "offload_params", is_flag=True,
              help="Also keep the optimizer state on disk between updates (with --offload-n/--offload-budget).")
@click.option("--offload-verify", "offload_verify", default="full", show_default=True,
              type=click.Choice(["full", "header", "off"]),
              help="Check swapped records when read back: XXH3 of every byte, length/step/unit + a sample, or nothing.")
@click.option("--offload-host-memory", "offload_host_memory", default="auto", show_default=True,
              help="GPU runs: swap to pinned host memory while the swapped bytes fit this many (e.g. 8GB; 'auto': "
                   "half of what the run may use of the host's RAM; 0: always the swap file on disk).")
@click.option("--chunks", "chunks", default="auto", show_default=True,
              type=click.Choice(["auto", "keep", "recompute", "pairs"]),
              help="The conv + batch norm chains on 112- and 56-pixel planes run 8 images at a time: 'keep' their "
                   "batch norm's output for backward, 'recompute' their chunks in backward instead (less memory, "
                   "at most two more conv passes each in backward), 'auto': recompute the fewest, largest first, "
                   "that let the run fit its memory limit (and with --offload-n auto, pairs where nothing else "
                   "fits); 'pairs': recompute, and two chains where the second "
                   "is the only reader of the first run as one, so the tensor between them is never whole (the "
                   "least memory; three passes over both). The same weights every way.")
# --- end of offload options ---
# --- data parallel options (issue 12) ---
@click.option("--workers", type=int, default=None,
              help="Data-parallel ranks: starts K ranks on this machine (mpiexec); under mpiexec/srun the world "
                   "decides. --batch-size is per worker.")
@click.option("--averaging", type=click.Choice(["gradients", "parameters"]), default="gradients", show_default=True,
              help="With workers: average gradients every step, or parameters and optimizer state every F steps.")
@click.option("--averaging-frequency", type=click.IntRange(1), default=1, show_default=True,
              help="F for --averaging parameters.")
@_abort_on_error_in_ranks
# --- end of data parallel options ---
def train(**params) -> None:
    """Train a model; prints a progress bar and a summary.

    Start with: engine train --model resnet18 --offload-n 4   (digits, one epoch; --model cnn takes seconds)
    """
    from engine.train_options import TrainOptions

    options = TrainOptions.from_cli(params)  # every check of the options alone, before anything starts
    backend = select_backend(options.backend)  # first: cudasim must be switched on before numba is imported
    from engine.signals import StopSignals

    stop = StopSignals().install()  # records SIGINT/TERM/HUP/QUIT; the run stops between two steps
    click.get_current_context().call_on_close(stop.restore)
    # --- data parallel (issue 12): rank 0 alone prints and writes; K is 1 in one process ---
    world = _parallel_world(options.parallel.workers, "train", stop)
    K, root, parallel = (world.size, world.is_root, None) if world is not None else (1, True, None)
    threads = options.threads
    if world is not None:
        from engine.parallel.wrapper import DataParallel

        threads = threads if threads is not None else world.threads_per_rank()
        try:
            parallel = DataParallel(world, options.parallel.averaging, options.parallel.frequency)
        except ValueError as exc:
            fail(str(exc))
        options.check_parallel()
    ranks_stop = parallel.agreed_stop(stop) if parallel is not None else stop  # ranks stop at the same point
    # --- end of data parallel ---
    if options.outputs.save and root:  # one running engine train per --save file (two both said they wrote it)
        from engine.checkpoint import SaveClaim

        claim = SaveClaim(options.outputs.save).acquire()
        click.get_current_context().call_on_close(claim.release)
    _set_threads(threads)
    early_workers = None
    if backend.name == "cpu" and world is None:  # a cold cache's warm-up workers start now, beside the set-up
        # (after the checks of the options alone: a mistyped command fails at once, without spawning them)
        from engine.warmup import start_workers

        early_workers = start_workers(options.model)

    from engine.checkpoint import save_checkpoint
    from engine.memory.monitor import MemoryMonitor
    from engine.summary import render_training_summary
    from engine.train import Trainer, TrainingDiverged

    data = _load_data(options.data, options.num_classes, options.seed, options.image_size)
    if K > 1 and data.name == "imagefolder":
        fail(f"--workers {K} with --data imagefolder: not supported yet (the sharded batch source reads in-memory "
             "data sets); train image folders in one process")
    if options.batch_size * K > len(data.y_train):
        fail(f"--batch-size must be between 1 and the training split's size ({len(data.y_train)})"
             + (f" divided by {K} workers" if K > 1 else "") + f", got {options.batch_size}")
    net = _build_network(options.model, data, backend, options.seed, options.workspace_mode, options.variant,
                         chunkable="pairs" if options.offload.chunks == "pairs" else True)
    total_steps = options.total_steps(len(data.y_train), K)
    run = options.run_record(data.num_classes, net.variant, net.graph.input_shape[-1])
    hyper = options.hyper(total_steps)
    graph = _cuda_graph_mode(options, backend.name, K)

    def weights_and_optimizer(net, say: bool = True):  # the checkpoint or --weights read into net, its optimizer
        checkpoint = _read_initial_weights(options, net, data, run, hyper, say=say)
        return (checkpoint, *_make_optimizer(options, net, backend, total_steps, checkpoint, K,
                                             in_backward=graph is None))

    checkpoint, schedule, opt, start_step = weights_and_optimizer(net)
    fitted = _fit_limit(options, net, opt, world)
    if fitted.refusal is not None and _pairs_may_fit(options, net, world):
        # --chunks auto under --offload-n auto: where nothing fits, the chained chunked chains run as one
        # (--chunks pairs, the least the run can hold); the network is built again with them, after this one is
        # gone, and planned from the setup measured before this one's plans (the same layers and blocks)
        del checkpoint, opt, net
        gc.collect()
        net = _build_network(options.model, data, backend, options.seed, options.workspace_mode, options.variant,
                             chunkable="pairs")
        checkpoint, schedule, opt, start_step = weights_and_optimizer(net, say=False)
        paired = _fit_limit(options, net, opt, world, pairs_taken=True, setup=fitted.setup)
        if paired.refusal is None or (paired.floor_bytes or 0) < (fitted.floor_bytes or 0):
            fitted = paired  # it fits, or its refusal names the smaller limit (pairs hold more on some shapes:
            # MobileNetV2 112, batch 16, 200 MiB against 188 planned at the floor)
    offload, needs, prefetch = _offload_session(options, net, opt, root, world, fitted)
    if prefetch != options.prefetch_depth:  # the memory limit took a shallower INPUT ring (resolve_budget)
        options = dataclasses.replace(options, prefetch=prefetch)
    from engine.checkpoint import checkpoint_nbytes

    options.outputs.check_writable(checkpoint_nbytes(net, opt))
    ranks_stop.check("before the first step")

    from engine.summary import make_console

    console = make_console()
    console.quiet = not root  # data parallel: rank 0 alone speaks
    shown = f"{options.model} ({net.variant} variant)" if net.variant else options.model
    console.print(f"[bold]{shown}[/bold] on {data.describe()}; backend {backend.name}"
                  f"{' (the step as one CUDA graph)' if graph else ''}, "
                  f"{net.num_parameters:,} parameters, {options.optimizer} lr {schedule(start_step):g} "
                  f"({options.lr_schedule})")
    from engine.info import blas_pin_advice

    if blas_pin_advice():
        console.print(f"[yellow]note:[/yellow] {blas_pin_advice()}", markup=True, highlight=False)
    # --- data parallel (issue 12) ---
    if parallel is not None:
        console.print(f"{parallel.describe(options.batch_size)}; {threads} thread(s) per rank")
    saved_workers = (checkpoint.json("workers") or 1) if checkpoint is not None else K
    if saved_workers != K:
        console.print(f"[yellow]note:[/yellow] {options.resume} was written with {saved_workers} worker(s), this run "
                      f"has {K}: the global batch changed, so the run continues at step {start_step}, but not bit for "
                      "bit as an uninterrupted run", markup=True, highlight=False)
    # --- end of data parallel ---
    warmed = None  # kernels compiled up front: the summary's time names them apart from the steps
    if backend.name == "cpu" and root:  # kernels issue: compile what this model uses in worker processes, once
        from engine.warmup import warm_for_training

        warmed = warm_for_training(net.graph, options.optimizer, options.model, pool=early_workers)
    outputs = options.outputs
    monitor = MemoryMonitor(net.mgr, path=outputs.memory_log if root else None)
    from engine.guard import CheckpointWriter, guarded_fit

    def write_checkpoint(path: str, trainer: Trainer) -> None:
        save_checkpoint(path, net, opt, step=trainer.step,
                        metadata={"run": {**run, **hyper}, **({"workers": K} if K > 1 else {})})

    swap_dirs = (options.offload.directory or tempfile.gettempdir(),) if offload else ()
    if parallel is not None:  # data parallel: rank 0 writes (the lowest rank left, after one was lost)
        writer = parallel.checkpoint_writer(outputs.save, write_checkpoint, fault_dirs=swap_dirs,
                                            state_on_disk=options.offload.params)
    else:
        writer = CheckpointWriter(outputs.save, write_checkpoint, fault_dirs=swap_dirs,
                                  state_on_disk=options.offload.params)
    try:
        trainer = Trainer.from_options(
            options, net, opt, data, steps=total_steps, start_step=start_step, monitor=monitor, offload=offload,
            parallel=parallel, stop=ranks_stop, cuda_graph=graph,
            listeners=_progress_listeners(options, console, K) if root else [],
            on_checkpoint=(lambda t: write_checkpoint(outputs.save, t)) if root else None,  # rank 0 writes
        )
        result = guarded_fit(trainer, writer)
    except (ValueError, TrainingDiverged) as exc:
        fail(str(exc))
    except MemoryError as exc:  # issue 30: a limit the check could not see through (one line, not a traceback)
        from engine.memory.limits import memory_limit

        fail(f"out of memory ({exc}); this process may use {memory_limit().describe()}: raise the limit or lower "
             "--batch-size")
    finally:
        monitor.close()
    if not root:  # data parallel: rank 0 alone writes
        return
    result.compile_seconds = warmed.seconds if warmed is not None else None
    if trainer.cuda_graph_error:
        console.print(f"[yellow]note:[/yellow] the step could not be captured as a CUDA graph and ran eagerly "
                      f"({trainer.cuda_graph_error}); --no-cuda-graph skips the attempt", markup=True, highlight=False)
    elif graph and trainer.cuda_graph_eager_reason:  # decided at capture time (offload on the disk tier)
        console.print(f"[yellow]note:[/yellow] the step ran eagerly, not as a CUDA graph: "
                      f"{trainer.cuda_graph_eager_reason}", markup=True, highlight=False)
    if outputs.save:
        write_checkpoint(outputs.save, trainer)
    render_training_summary(result, console)
    _write_outputs(options, result, trainer, monitor, console,
                   {**run, "backend": backend.name,
                    "cuda_graph": graph is not None and not trainer.cuda_graph_error
                    and not trainer.cuda_graph_eager_reason,
                    **({"cuda_graph_error": trainer.cuda_graph_error} if trainer.cuda_graph_error else {}),
                    **({"cuda_graph_eager_reason": trainer.cuda_graph_eager_reason}
                       if graph and trainer.cuda_graph_eager_reason else {}),
                    "threads": threads,
                    **_parallel_fields(options, parallel, K),
                    **({"memory_needs": needs.as_dict()} if needs is not None else {})})  # issue 30: the prediction
    stop.check("at the end of the run", "the run finished and its results were written")


def _progress_listeners(options, console, workers: int) -> list:
    """A live bar on a terminal; where it would print nothing (a pipe, a log file), a plain line every
    --progress-interval seconds (engine.train.LineProgressListener)."""
    from engine.train import LineProgressListener, ProgressListener

    if not options.progress:
        return []
    if console.is_terminal:
        return [ProgressListener(console, workers=workers)]
    return [LineProgressListener(interval_s=options.progress_interval, workers=workers)]


def _read_initial_weights(options, net, data, run: dict, hyper: dict, say: bool = True):
    """The --resume checkpoint (checked against this run; restored later, with the optimizer), or the
    --weights loaded into ``net``; returns the checkpoint or None. ``say``: print its notes (not when the network
    is built a second time)."""
    from engine.checkpoint import CheckpointError, check_resume, load_weights, read_checkpoint

    try:
        if options.resume:
            if options.weights and say:  # the original command plus the stop's hint: the checkpoint carries on
                click.echo(f"note: --resume {options.resume} continues from its checkpoint; --weights "
                           f"{options.weights}, where the run started, is not read again")
            checkpoint = read_checkpoint(options.resume)
            check_resume(checkpoint, {**run, **hyper}, options.override, known=("steps",))
            return checkpoint
        if options.weights:  # imagenet issue: fine-tuning draws a fresh classifier for another class count
            loaded = load_weights(options.weights, net, fresh_classifier=True)
            if loaded.redrawn and say:
                click.echo(f"{options.weights}: classifier {', '.join(loaded.redrawn)} drawn fresh for "
                           f"{data.num_classes} classes (the file's has another shape); every other tensor loaded")
    except CheckpointError as exc:
        fail(str(exc))
    return None


def _cuda_graph_mode(options, backend: str, workers: int) -> str | None:
    """How the step runs: "cupy" (one CUDA graph on the GPU), "record" (the simulator's stand-in) or None (eager).
    On by default for --backend cuda (an H200, 2026-11-27: engine train ResNet-18 CIFAR b32 1,659 images/s
    captured against 340 with --no-cuda-graph; benchmarks/results/gpu-2026-11-27.md); --offload-params and data
    parallel work between a step's launches (hooks), which a replayed graph skips, so they keep the eager step;
    an explicit --cuda-graph there is refused. Offload of
    activations (--offload-n/--offload-budget) is captured too when its swap tier is pinned host memory: the
    runner decides at capture time, after the first step chose the tier, and names why not otherwise (the disk
    tier, --offload-n auto): ``cuda_graph_eager_reason`` in the summary JSON."""
    if options.cuda_graph is False:
        return None
    reason = None
    if backend not in ("cuda", "cudasim"):
        reason = f"the {backend} backend has no CUDA graph (--backend cuda)"
    elif options.offload.params:
        reason = "--offload-params moves the optimizer state between the step's launches"
    elif workers > 1:
        reason = "data parallel's gradient exchange works between the step's launches"
    if options.cuda_graph is None:
        return "cupy" if backend == "cuda" and reason is None else None
    if reason is not None:
        fail(f"--cuda-graph: {reason}; leave it out (the step then runs eagerly)")
    return "cupy" if backend == "cuda" else "record"


def _make_optimizer(options, net, backend, total_steps: int, checkpoint, workers: int, in_backward: bool = True):
    """The schedule, the optimizer (state restored from ``checkpoint``) and the step the run starts at.
    ``in_backward``: the update may run inside backward (not with a CUDA graph: a hook, which a replay skips;
    its whole-block update gives the same weights)."""
    from engine.checkpoint import CheckpointError, restore
    from engine.optim import make_optimizer
    from engine.schedule import make_schedule

    try:
        schedule = make_schedule(options.lr_schedule, options.lr, total_steps)
        opt = make_optimizer(options.optimizer, net, backend, schedule, momentum=options.momentum,
                             weight_decay=options.weight_decay, nesterov=options.nesterov, manager=net.mgr)
    except ValueError as exc:
        fail(str(exc))
    start_step = 0
    if checkpoint is not None:
        try:
            start_step = restore(checkpoint, net, opt)
        except CheckpointError as exc:
            fail(str(exc))
    if workers == 1 and not options.offload.params and not options.update_after_backward and in_backward:
        from engine.optim import update_in_backward  # why, and what needs the whole block instead: its docstring

        update_in_backward(net, opt)  # before the budget and the summary read the GRADIENTS block
    return schedule, opt, start_step


def _pairable(net) -> bool:
    from engine.chunking import has_chained_pairs

    return has_chained_pairs(net.graph)


def _pairs_may_fit(options, net, world) -> bool:
    """Whether a refused run may take ``--chunks pairs`` itself: ``--chunks auto`` with the limit choosing the
    window (``--offload-n auto``, ``--offload-budget auto``), in one process (data-parallel ranks would have to
    agree on the graph), where the network has chained chunked chains. A fixed window or no offload keeps its
    refusal, which names ``--chunks pairs`` (pairs are slower: MobileNetV2 224 batch 32 under 610 MiB 1.75 s a
    step against 1.36-1.43 without them, so they are taken only where nothing else fits)."""
    from engine.offload.budget import limit_decides, parse_budget

    if options.offload.chunks != "auto" or world is not None or net.backend.is_device:
        return False
    try:
        chosen = limit_decides(options.offload.n, parse_budget(options.offload.budget))
    except ValueError:  # a malformed --offload-budget: its refusal says so
        return False
    return chosen and _pairable(net)


@dataclasses.dataclass
class _Fitted:
    """What ``_fit_limit`` decided: ``resolved`` (``resolve_budget``'s) or the ``refusal``'s line, the prefetch
    depths offered (the first asked for), and whether the network's chained chains run as pairs because nothing
    else fitted (``pairs_taken``)."""

    resolved: Any
    refusal: str | None
    depths: list[int]
    pairs_taken: bool = False
    refused: Any = None  # a refusal's figures (``DoesNotFit.needs``): its floor, and its setup for a second network

    @property
    def floor_bytes(self) -> int | None:
        return None if self.refused is None else self.refused.needed_min_offload

    @property
    def setup(self) -> Any:
        return None if self.refused is None else self.refused.setup


def _fit_limit(options, net, opt, world=None, pairs_taken: bool = False, setup=None) -> _Fitted:
    """What the run needs against its memory limit (issue 30: every run is checked before anything is written)
    and the prefetch depth it may take (``--prefetch``, or without it the default, shallower when the limit needs
    it), or the refusal's one line. With ``--workers`` (``world``) the ranks on this host share its limit
    (``memory_limit``)."""
    from engine.data.prefetch import ring_bytes
    from engine.memory.limits import memory_limit
    from engine.offload.budget import DoesNotFit, parse_budget, resolve_budget
    from engine.report import format_bytes

    chosen = options.offload
    batch = (options.batch_size, *net.graph.input_shape)
    ranks = world.local_size if world is not None else 1
    depths = [options.prefetch_depth] + ([] if options.prefetch is not None else
                                         list(range(options.prefetch_depth - 1, -1, -1)))  # given: that one only

    def resolve(first: int, shallower: list[int], chunks: str = chosen.chunks):  # --offload-budget is read here
        prefetching = [d for d in shallower if d > 0]  # 0 (no prefetch) only after every chunked layer recomputes
        return resolve_budget(net, options.batch_size, getattr(opt.state, "flat", None),
                              ring_bytes(batch, first + 1), ring_bytes(batch, 2), chosen.n, parse_budget(chosen.budget),
                              memory_limit(ranks_on_host=ranks) if ranks > 1 else None,  # None: this process's
                              chunks=chunks, shallower_rings=[ring_bytes(batch, d + 1) for d in prefetching],
                              last_ring=ring_bytes(batch, 1) if 0 in shallower else None, setup=setup)

    try:
        return _Fitted(resolve(depths[0], depths[1:]), None, depths, pairs_taken)
    except ValueError as exc:  # DoesNotFit, or a malformed --offload-budget
        refusal = str(exc) + (f" (the {ranks} ranks on this host share its limit: fewer --workers leave each more)"
                              if ranks > 1 and isinstance(exc, DoesNotFit) else "")
        if not isinstance(exc, DoesNotFit):
            return _Fitted(None, refusal, depths, pairs_taken)
        if pairs_taken:
            refusal += " (with two chained chunked chains run as one, --chunks pairs: the least this run can hold)"
        if options.prefetch:  # the --prefetch given holds it back: say so
            try:
                resolve(0, [])
                refusal += f"; with --prefetch 0 it fits (--prefetch {options.prefetch} holds " \
                           f"{format_bytes(ring_bytes(batch, options.prefetch + 1) - ring_bytes(batch, 1))} more)"
            except ValueError:
                pass
        if chosen.chunks == "keep" and getattr(net, "chunked", None):
            try:  # the --chunks keep given holds it back: say so, and how many layers auto would recompute
                found = resolve(depths[0], depths[1:], chunks="auto").needs
                refusal += (f"; with --chunks auto it fits ({len(found.recomputed)} of {len(found.chunked)} chunked "
                            "layers recompute their chunks in backward)")
            except ValueError:
                pass
        if chosen.chunks in ("keep", "recompute") and _pairable(net):
            refusal += ("; --chunks pairs may hold less (engine memory --pairs with this model, image size and batch "
                        "prints its smallest limit)")
        return _Fitted(None, refusal, depths, pairs_taken, exc.needs)


def _offload_session(options, net, opt, root: bool, world, fitted: _Fitted):
    """The offload session (planned and attached, so a bad directory or a full disk fails now), or None; what the
    run needs against its memory limit (``fitted``, ``_fit_limit``'s); and the prefetch depth it takes. A run
    that does not fit ends here with its one line; with ``--workers`` a rank that does not fit stops every rank
    (``refuse_together``)."""
    from engine.data.prefetch import ring_bytes
    from engine.offload import OffloadError, OffloadStorageError, offload_summary
    from engine.offload.budget import describe_needs
    from engine.offload.session import session_from_options
    from engine.parallel.comm import refuse_together
    from engine.report import format_bytes

    chosen = options.offload
    batch = (options.batch_size, *net.graph.input_shape)
    refuse_together(world, fitted.refusal)
    if fitted.refusal is not None:
        fail(fitted.refusal)
    resolved, depths = fitted.resolved, fitted.depths
    if resolved.from_limit:  # the budget is the machine's: say where it came from
        click.echo(describe_needs(resolved.needs, resolved.budget_bytes))
    needs = resolved.needs
    prefetch = depths[resolved.ring]
    if resolved.ring and root:
        click.echo(f"prefetch: {prefetch} batch{'es' if prefetch != 1 else ''} ahead, not {depths[0]}, to fit the "
                   f"limit (the INPUT ring {format_bytes(ring_bytes(batch, prefetch + 1))} instead of "
                   f"{format_bytes(ring_bytes(batch, depths[0] + 1))}; --prefetch sets it)")
    if fitted.pairs_taken and root:
        click.echo(f"chunked pairs: {len(needs.paired)} pairs of chained chunked layers run as one to fit the limit "
                   "(--chunks pairs: the tensor between them is never whole; three passes over both)")
    if needs is not None and needs.recomputed and root:  # counted as engine memory's --chunks column counts them
        others = [name for name in needs.chunked if name not in needs.paired]
        rest = [name for name in needs.recomputed if name not in needs.paired]
        counted = (f"the {len(needs.paired)} pairs and {len(rest)} of {len(others)} other chunked layers"
                   if needs.paired else f"{len(rest)} of {len(others)}")
        click.echo(f"chunked layers: {counted} recompute their chunks in backward ({', '.join(needs.recomputed)})"
                   + (" to fit the limit" if chosen.chunks == "auto" else ""))
    if resolved.window is not None and root:
        click.echo(f"offload: --offload-n auto at its floor runs N={resolved.window}, its units in the bytes the "
                   "step's own tensors leave free (the limit leaves no room for a window of their own)")
    try:
        offload = session_from_options(net, options.batch_size,
                                       chosen.n if resolved.window is None else str(resolved.window),
                                       resolved.budget_bytes, chosen.directory, chosen.params, chosen.verify,
                                       chosen.host_memory_bytes)
    except (ValueError, OffloadError, OffloadStorageError) as exc:
        fail(str(exc))
    if offload is not None and root:
        scheduler = offload.scheduler
        summary = offload_summary(scheduler.plan_for(options.batch_size), offload.no_offload_bytes,
                                  scheduler.storage.capacity_bytes, scheduler.storage.kind)  # as allocated
        click.echo(f"offload: {summary}"
                   + (" (auto: adapts per step)" if offload.scheduler.adaptive else ""))
    return offload, resolved.needs, prefetch


def _parallel_fields(options, parallel, workers: int) -> dict:
    """The summary JSON's data-parallel fields (none in one process)."""
    if parallel is None:
        return {}
    return {"workers": workers, "global_batch_size": workers * options.batch_size,
            "averaging": options.parallel.averaging, "averaging_frequency": options.parallel.frequency}


def _write_outputs(options, result, trainer, monitor, console, summary_fields: dict) -> None:
    """The memory plot and the summary JSON, then one line per file this run wrote. One output that cannot
    be written (a full disk) does not keep the others from being written: its error is raised after them."""
    from engine.errors import UserError

    outputs = options.outputs
    written, failed = [], []
    if outputs.memory_log:
        written.append(f"memory log {outputs.memory_log} ({sum(monitor.phase_samples.values())} lines)")
    if outputs.memory_plot:
        try:
            monitor.plot(outputs.memory_plot, peak_rss=(result.peak_rss_bytes, result.peak_rss_phase))
            written.append(f"memory plot {outputs.memory_plot}")
        except UserError as exc:
            failed.append(exc)
    if outputs.save:
        written.append(f"checkpoint {outputs.save} (step {trainer.step})")
    if outputs.summary_json:
        from engine.validate import write_output

        try:
            write_output("--summary-json", outputs.summary_json,
                         json.dumps({**result.as_dict(), **summary_fields}, indent=2))
            written.append(f"summary {outputs.summary_json}")
        except UserError as exc:
            failed.append(exc)
    for line in written:
        console.print(f"wrote {line}", markup=False, highlight=False)
    if failed:
        message = "; ".join(str(exc) for exc in failed)
        if outputs.save:
            message += f" (the training finished and its checkpoint {outputs.save} was written)"
        raise type(failed[0])(message)


@main.command(name="eval")
@click.option("--model", required=True, type=click.Choice(MODEL_CHOICES))
@click.option("--weights", required=True, type=click.Path(dir_okay=False),
              help="A checkpoint from engine train --save, or a PyTorch state_dict as safetensors.")
@click.option("--data", "data_spec", default="digits", show_default=True,
              help="synthetic | digits | cifar10:DIR | cifar100:DIR | mnist:DIR | npz:FILE | imagefolder:DIR")
@click.option("--image-size", type=click.IntRange(8), default=None,
              help="imagefolder: crop size (default 224); synthetic: image side (default 32).")
@variant_option
@click.option("--num-classes", type=int, default=None, callback=number(2, MAX_CLASSES),
              help="Output classes (default: the data set's).")
@click.option("--batch-size", type=int, default=64, show_default=True, callback=number(1, MAX_BATCH_SIZE))
@click.option("--split", type=click.Choice(["test", "train"]), default="test", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, callback=number(0, 2**63 - 1),
              help="Only for --data synthetic.")
@click.option("--backend", "backend_name", type=click.Choice(BACKEND_NAMES), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, callback=number(1), help="Threads for Numba kernels and BLAS.")
@click.option("--json", "as_json", is_flag=True, help="Print accuracy, top-5, loss and the confusion matrix as JSON.")
@click.option("--workers", type=int, default=None,  # data parallel (issue 12)
              help="Ranks that share the batches (mpiexec); the result is identical to one worker's.")
@_abort_on_error_in_ranks
def evaluate_command(
    model: str, weights: str, data_spec: str, num_classes: int | None, batch_size: int, split: str, seed: int,
    backend_name: str, threads: int | None, as_json: bool, workers: int | None = None,
    image_size: int | None = None, variant: str | None = None,
) -> None:
    """Accuracy, top-5 accuracy, loss and the confusion matrix of saved weights."""
    backend = select_backend(backend_name)
    world = _parallel_world(workers, "eval")  # data parallel (issue 12)
    if world is not None and threads is None:
        threads = world.threads_per_rank()
    _set_threads(threads)
    from engine.checkpoint import CheckpointError, load_weights
    from engine.evaluate import evaluate
    from engine.summary import render_evaluation

    data = _load_data(data_spec, num_classes, seed, image_size)
    net = _build_network(model, data, backend, seed, variant=variant)
    try:
        load_weights(weights, net)
    except CheckpointError as exc:
        fail(str(exc))
    if world is not None:  # data parallel: batches shared by the ranks, rank 0 prints
        from engine.parallel.evaluate import evaluate_sharded

        result = evaluate_sharded(net, data, backend, world.comm, batch_size=batch_size, split=split)
        if not world.is_root:
            return
    else:
        result = evaluate(net, data, backend, batch_size=batch_size, split=split)
    class_names = list(getattr(data, "classes", None) or []) or None  # an image folder's class folders
    if as_json:
        click.echo(json.dumps({"examples": result.examples, "accuracy": result.accuracy,
                               "top5_accuracy": result.top5_accuracy, "loss": result.loss,
                               "confusion_matrix": result.confusion.tolist(),
                               **({"class_names": class_names} if class_names else {})}, indent=2))
    else:
        render_evaluation(result, class_names=class_names)


@main.command()
@click.option("--model", required=True, type=click.Choice(MODEL_CHOICES))
@click.option("--batch-size", "batch_sizes", default="32", show_default=True,
              help="Batch size, or several comma-separated (e.g. 32,128): then the smallest limits per plan only.")
@click.option("--num-classes", type=int, default=10, show_default=True, callback=number(2, MAX_CLASSES))
@click.option("--image-size", type=int, default=32, show_default=True, callback=number(1, MAX_IMAGE_SIZE))
@variant_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--offload-n", "offload_n", default=None, callback=lambda ctx, param, value: parse_window(value),
              help="Also print the planned peak with offload, keeping a window of N layers in memory; 'auto': the "
                   "window engine train's auto starts at (N=1), within the machine's budget unless --offload-budget.")
@click.option("--offload-budget", "offload_budget", default=None,  # issue 11: keep within a budget
              help="With --offload-n: resident bytes for the offload plan (e.g. 120MB) or a share of what the step "
                   "keeps without offload (e.g. 0.3x); the units it keeps beyond the window show '(budget)'.")
@click.option("--measure", is_flag=True,  # planned arena
              help="Run one real training step and print the measured bytes beside the plan.")
@click.option("--program", "show_program", is_flag=True,  # step program
              help="Print the training step program: every step, the buffers it creates, reads, hands on, retires.")
@click.option("--update-after-backward", is_flag=True,  # issue 13: as engine train
              help="Plan every layer's gradients kept to the end of backward (engine train's default keeps one "
                   "layer's: the update runs in backward).")
@click.option("--pairs", is_flag=True,
              help="Plan the network engine train --chunks pairs runs: two chunked chains where the second is the "
                   "only reader of the first as one node (recomputing).")
def memory(model: str, batch_sizes: str, num_classes: int, image_size: int, as_json: bool,
           offload_n: int | str | None = None, measure: bool = False, show_program: bool = False,
           variant: str | None = None, update_after_backward: bool = False, offload_budget: str | None = None,
           pairs: bool = False) -> None:
    """Per-layer memory of one training step (parameters, kept for backward, working memory) and the planned peak.

    Computed from the step program (shapes and buffer lifespans); nothing is run.
    """
    from engine.backend import get_backend
    from engine.summary import render_memory_report
    from engine.validate import check_number
    from models import build_model

    try:
        sizes = [int(check_number("--batch-size", int(b), low=1, high=MAX_BATCH_SIZE))
                 for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        fail(f"--batch-size takes positive integers, comma-separated (e.g. 32,128), got {batch_sizes!r}")
    if not sizes:
        fail(f"--batch-size takes positive integers, comma-separated (e.g. 32,128), got {batch_sizes!r}")
    batch_size = sizes[0]
    options = {"input_shape": (3, image_size, image_size)} if model == "mlp" else {"image_size": image_size}
    try:
        net = build_model(model, num_classes, get_backend("cpu"), variant=variant,
                          chunkable="pairs" if pairs else True, **options)
    except ValueError as exc:
        fail(str(exc))
    if show_program:  # step program: the table every memory figure below is computed from
        click.echo(net.program(batch_size).table())
        return
    if not update_after_backward:  # engine train's default in one process (engine.optim.update_in_backward)
        net.set_gradient_storage("per_layer")
    import engine.checkpoint  # noqa: F401  # issue 30: what engine train has imported when it plans (the
    import engine.train  # noqa: F401  # smallest limits start from this process's measured memory)
    import kernels.cpu  # noqa: F401
    from engine.data.prefetch import ring_bytes

    pairs_network = None
    if not pairs and _pairable(net):  # what engine train --offload-n auto takes where nothing else fits
        def pairs_network():
            paired = build_model(model, num_classes, get_backend("cpu"), variant=variant, chunkable="pairs", **options)
            if not update_after_backward:
                paired.set_gradient_storage("per_layer")
            return paired

    if len(sizes) > 1:  # issue 30: the smallest limit per plan and batch size
        from engine.offload.budget import limits_for_cli

        try:
            limits_for_cli(net, sizes, ring_bytes, 1 if offload_n == "auto" else offload_n, offload_budget, as_json,
                           pairs_network)
        except ValueError as exc:
            fail(str(exc))
        return
    report = net.memory_report(batch_size)
    if measure:  # planned arena: one real step
        net.measure_memory(batch_size, report)
    # --- offload issue: planned peak with and without offload ---
    peaks = None
    if offload_budget is not None and offload_n is None:
        fail("--offload-budget goes with --offload-n N: the plan keeps units within it beyond the window")
    window = 1 if offload_n == "auto" else offload_n  # auto starts at N=1 (the scheduler's min_window)
    if offload_n is not None:
        from engine.offload.budget import parse_budget
        from engine.offload.session import planned_peaks

        try:
            budget = parse_budget(offload_budget)
            if budget is not None and budget.auto:
                fail("engine memory takes --offload-budget as bytes or a share (e.g. 0.3x); auto is engine train's")
            peaks = planned_peaks(net, batch_size, window, budget.bytes_for(net, batch_size) if budget else None)
        except ValueError as exc:
            fail(str(exc))
    # --- end offload issue ---
    # issue 30: the smallest memory limit per plan (engine train's defaults), against this one
    from engine.offload.budget import limits_table, needs_for_cli
    from engine.report import render_table, table_dict
    from engine.summary import memory_tables

    try:
        needs = needs_for_cli(net, [batch_size], ring_bytes, window, offload_budget, pairs_network)
    except ValueError as exc:
        fail(str(exc))
    shown = f"{model} ({net.variant} variant)" if net.variant else model
    plan_tables = []
    if peaks:  # per layer: what each saved tensor does (keep, swap, recompute)
        from engine.offload.session import plan_layers_table

        plan_tables.append(plan_layers_table(peaks))
    if as_json:
        tables = [table_dict(t) for t in [*memory_tables(report, peaks, shown), *plan_tables]]
        click.echo(json.dumps({**report.as_dict(), **({"offload": peaks} if peaks else {}),
                               "variant": net.variant, "fit": needs[0][1].as_dict(),
                               "tables": [*tables, table_dict(limits_table(needs))]}, indent=2))
    else:
        render_memory_report(report, offload=peaks, model=shown)
        for table in plan_tables:
            render_table(table)
        if offload_n == "auto":
            click.echo("offload auto: planned at N=1, where engine train's auto starts; it grows a window per step "
                       "while the executor waits for loads")
        if net.variant:
            click.echo(f"{model}: {net.variant} variant at {image_size}x{image_size}")
        render_table(limits_table(needs))


# --- bench: offload benchmark (offload issue) ---


@main.command()
@click.option("--model", default="resnet18", show_default=True,
              help="resnet18, mobilenetv2, cnn or mlp; comma-separated for several.")
@click.option("--batch-size", default="10,32,128", show_default=True, help="Comma-separated batch sizes.")
@click.option("--offload-n", default="4", show_default=True, help="Layers kept in memory (N), or 'auto'.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1), help="Measured steps per run.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(1), help="Unmeasured steps first.")
@click.option("--image-size", default=32, show_default=True, type=click.IntRange(4), help="Input height and width.")
@variant_option
@click.option("--backend", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda", "cudasim"]))
@click.option("--offload-dir", default=None, help="Where the swap directory goes (default: the system temp dir).")
@click.option("--offload-budget", "offload_budget", default=None,
              help="Resident bytes for the offload plan (e.g. 120MB), or a share of what the step keeps without "
                   "offload (e.g. 0.3x): what the window leaves of it keeps units instead of writing them.")
@click.option("--format", "output_format", default="table", show_default=True,
              type=click.Choice(["table", "json", "markdown"]))
def bench(model, batch_size, offload_n, steps, warmup, image_size, backend, offload_dir, output_format,
          variant=None, offload_budget=None) -> None:
    """Offload cost and savings per batch size: forward+backward, offload, onload, stall (µs), step time,
    peak resident bytes and RSS, each run with and without offload (in fresh processes)."""
    from engine.bench.offload import format_markdown, format_table, run_bench
    from engine.offload.session import OffloadConfig
    from models import MODEL_NAMES

    models = [m.strip() for m in model.split(",") if m.strip()]
    for name in models or [model]:
        if name not in MODEL_NAMES:
            fail(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    try:
        sizes = [int(b) for b in batch_size.split(",") if b.strip()]
        config = OffloadConfig.from_options(offload_n, None, offload_dir)
    except ValueError as exc:
        fail(f"--batch-size must be comma-separated integers, got {batch_size!r}" if "int()" in str(exc) else str(exc))
    if not sizes or min(sizes) < 1:
        fail(f"--batch-size needs positive integers, got {batch_size!r}")
    if offload_dir:  # checked here: the runs happen in child processes, whose errors are tracebacks
        from engine.offload.storage import check_directory

        check_directory(offload_dir)
    if offload_budget is not None:
        from engine.offload.budget import parse_budget

        try:
            if parse_budget(offload_budget).auto:
                fail("engine bench takes --offload-budget as bytes or a share (e.g. 0.3x), not auto")
        except ValueError as exc:
            fail(str(exc))
    progress = None if output_format == "json" else (lambda text: click.echo(f"... {text}", err=True))
    try:
        results = [r for name in models for r in run_bench(
            name, sizes, config.window, steps=steps, warmup=warmup, image_size=image_size, backend=backend,
            directory=offload_dir, progress=progress, variant=variant, budget=offload_budget)]
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    if output_format == "json":
        click.echo(json.dumps(results, indent=2))
    elif output_format == "markdown":
        click.echo(format_markdown(results))
    else:
        click.echo(format_table(results))



if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "fail", "select_backend", "BACKEND_NAMES"]
