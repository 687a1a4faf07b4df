"""Benchmark tools, kept out of the runtime: ``kernels`` (``engine kernels``: every kernel version
timed against its reference and PyTorch) and ``offload`` (``engine bench``: what offload costs in
time and saves in memory). They sit above the trainer in the dependency order
(cli → engine.bench → engine.train → ...), so they may import ``models``; the runtime may not
(``tests/engine/test_layering.py`` checks both).

Why the tools build their models themselves instead of taking built ones from the command line, as
``engine train`` does: the measured runs of ``engine bench`` happen in fresh processes (``python -m
engine.bench.offload --worker``; the MPI ranks of ``engine.bench.parallel``), so that one run's
compiled kernels, page cache and RSS high-water mark do not leak into the next. A built network
cannot cross into a fresh process; its name and options can, and that process must call
``models.build_model`` itself. The in-process tools (the conv shapes of ``kernels``, the launch
counts of ``cuda_launches``, ``gpu_acceptance``) read the same model names and could take built
graphs, but then one tool would have two ways in for one concept. Handing in a builder function
would only hide the same import behind an argument. So the tools are faces of their own beside
``cli``; they live under ``engine/`` because the layout fixes the top-level directories and
``python -m engine.bench.offload`` must be importable from the installed package."""
