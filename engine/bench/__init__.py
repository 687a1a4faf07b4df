"""Benchmark tools, kept out of the runtime: ``kernels`` (``engine kernels``: every kernel version
timed against its reference and PyTorch) and ``offload`` (``engine bench``: what offload costs in
time and saves in memory). They sit above the trainer in the dependency order
(cli → engine.bench → engine.train → ...), so they may import ``models``; the runtime may not."""
