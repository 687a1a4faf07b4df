"""The Numba CPU conv against the NumPy reference and against torch, plus determinism and bad input."""

import dataclasses

import numpy as np
import pytest

from kernels.cpu import blas, conv_study
from kernels.cpu import conv as cpu
from kernels.cpu import conv_winograd as winograd
from kernels.cpu import conv_winograd4 as winograd4
from kernels.reference import conv as ref

# (N, C, H, W, K, kernel, stride, pad, groups): odd sizes, stride 2, pad 0/1, groups 2 and = C,
# batch 1, 1×1 at stride 1 and 2, and shapes whose late-layer tiles hold several images.
SHAPES = [
    (2, 3, 7, 9, 5, 3, 1, 1, 1),
    (2, 4, 7, 7, 6, 3, 2, 1, 1),
    (1, 4, 5, 5, 4, 3, 1, 0, 2),
    (3, 6, 9, 9, 6, 3, 2, 1, 6),
    (2, 5, 6, 7, 5, 3, 1, 1, 5),
    (2, 8, 6, 6, 16, 1, 2, 0, 1),
    (2, 8, 6, 6, 12, 1, 1, 0, 1),
    (1, 3, 5, 5, 4, 3, 1, 1, 1),
    (37, 8, 4, 4, 8, 3, 1, 1, 1),
    (40, 6, 2, 2, 4, 1, 1, 0, 2),
    (9, 50, 6, 6, 50, 3, 1, 1, 50),  # depthwise v2: several channel chunks, checked runs at the ends, four-image runs
    (6, 40, 7, 7, 40, 3, 2, 1, 40),  # depthwise v2 at stride 2 (odd plane), several chunks, four-image runs
    (3, 2, 7, 3, 3, 5, 1, 2, 1),  # 5×5 "same" on a plane narrower than the kernel: flat im2col rows, two zeroed columns
    (5, 3, 9, 8, 4, 3, 1, 1, 1),  # 3 channels: im2col since v17 (the study's v16: shifted GEMMs, stacked tiles)
    (2, 2, 32, 33, 3, 3, 1, 1, 1),  # 2 channels: im2col since v17 (v16: shifted, one-image tiles in place)
    (5, 40, 8, 8, 40, 3, 2, 1, 40),  # depthwise stride 2 on even planes: kept outputs on row pairs, several chunks
    (5, 24, 8, 8, 6, 1, 1, 0, 1),  # 1×1, C = 4K on 8×8: v27's row-blocked GEMMs (v8–v26: per image, in place)
    (6, 16, 8, 8, 6, 1, 1, 0, 1),  # 1×1, 2K ≤ C < 4K on 8×8 (v8–v26: backward-data per image, forward in tiles)
    (3, 64, 5, 7, 64, 3, 1, 1, 1),  # 3×3 Winograd (≥ 64 channels): odd plane, blocks across images
    (5, 8, 9, 8, 4, 3, 1, 1, 1),  # shifted GEMMs (≥ 8 channels), every direction: stacked tiles, a partial tile
    (2, 8, 32, 33, 3, 3, 1, 1, 1),  # shifted GEMMs, every direction: one-image tiles in place
    (2, 64, 16, 17, 64, 3, 1, 1, 1),  # Winograd F(4×4) with OpenBLAS (≥ 16×16): a partial last tile column
    (3, 64, 3, 4, 64, 3, 1, 1, 1),  # Winograd by ξ (v23: ≤ 16 pixels): odd plane, forward and backward-data
    (3, 64, 16, 20, 72, 3, 2, 1, 1),  # polyphase Winograd stride 2 forward (v28, OpenBLAS): not square, 3 images
    (2, 3, 80, 82, 3, 3, 2, 1, 3),  # depthwise stride 2 on a large even plane: plane by plane, not direct (v44)
    (2, 40, 60, 60, 8, 1, 1, 0, 1),  # 1×1 on ≥ 56×56, 8 rows < 40 deep: forward in pixel blocks (v46), a partial last
    (2, 8, 60, 60, 40, 1, 1, 0, 1),  # the same for backward-data (8 rows of dx < 40 deep)
    (2, 64, 60, 60, 96, 1, 1, 0, 1),  # weight gradient split on ≥ 56×56: three pixel blocks a GEMM, the last partial
    (3, 64, 5, 6, 72, 3, 1, 1, 1),  # F(4×4) by output channel (v34, v35 weight; OpenBLAS, 16–64 pixels): partial tiles
]
IDS = ["x".join(map(str, s)) for s in SHAPES]


def _case(shape, seed=0):
    n, c, h, wd, k, r, stride, pad, groups = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c // groups, r, r), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    oh, ow = ref.check_conv2d_shapes(x.shape, w.shape, stride, pad, groups)
    dout = rng.standard_normal((n, k, oh, ow), dtype=np.float32)
    return x, w, b, dout, (stride, pad, groups)


def _scratch(size_function, x, w, args):
    return np.full(size_function(x.shape, w.shape, *args), np.nan, np.float32)  # NaN: unwritten scratch shows


def _run_cpu(x, w, b, dout, args):
    out = np.full(dout.shape, np.nan, np.float32)
    dx = np.full(x.shape, np.nan, np.float32)
    dw = np.full(w.shape, np.nan, np.float32)
    db = np.full(b.shape, np.nan, np.float32)
    cpu.conv2d_forward(x, w, b, out, *args, _scratch(cpu.conv2d_forward_workspace_size, x, w, args))
    cpu.conv2d_backward_data(dout, w, dx, *args, _scratch(cpu.conv2d_backward_data_workspace_size, x, w, args))
    cpu.conv2d_backward_weight(
        x, dout, dw, db, *args, _scratch(cpu.conv2d_backward_weight_workspace_size, x, w, args)
    )
    return out, dx, dw, db


def _reference(x, w, b, dout, args):
    """The NumPy reference's out, dx, dw and db."""
    expected = [np.empty(dout.shape, np.float32), np.empty_like(x), np.empty_like(w), np.empty_like(b)]
    ref.conv2d_forward(x, w, b, expected[0], *args)
    ref.conv2d_backward_data(dout, w, expected[1], *args)
    ref.conv2d_backward_weight(x, dout, expected[2], expected[3], *args)
    return expected


def _run_cpu_at_thread_counts(x, w, b, dout, args, counts):
    """``_run_cpu`` at each of ``counts`` that Numba's pool has (and at its own count), in order."""
    from numba import get_num_threads, set_num_threads

    saved, results = get_num_threads(), []
    try:
        for threads in sorted((set(counts) | {saved}) & set(range(1, saved + 1))):
            set_num_threads(threads)
            results.append(_run_cpu(x, w, b, dout, args))
    finally:
        set_num_threads(saved)
    return results


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_cpu_conv_matches_reference(shape):
    x, w, b, dout, args = _case(shape)
    out, dx, dw, db = _run_cpu(x, w, b, dout, args)
    expected = _reference(x, w, b, dout, args)
    for got, want, direction in zip((out, dx, dw, db), expected, ("forward", "data", "weight", "weight")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=_atol(x.shape, w.shape, args, direction, want))


def _atol(x_shape, w_shape, args, direction, want, paths=cpu.EXPORTED) -> float:
    """1e-4, but on the F(4×4) Winograd path an error that scales with the outputs: its transforms'
    coefficients (up to 8 and 1/24) round at ~5e-6 of the largest output (the unscaled weights here
    make outputs of ~100 and errors of up to 5e-4, where F(2×2) stays under 1e-4)."""
    if cpu.path(x_shape, w_shape, *args, direction, paths) in ("winograd4", "winograd4-by-k", "winograd4-weight-by-k"):
        return max(1e-4, 2e-5 * float(np.abs(want).max()))
    return 1e-4


@pytest.mark.parametrize("shape", SHAPES[:6], ids=IDS[:6])
def test_cpu_conv_matches_torch_autograd(shape):
    torch = pytest.importorskip("torch")
    x, w, b, dout, (stride, pad, groups) = _case(shape, seed=3)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=stride, padding=pad, groups=groups)
    yt.backward(torch.from_numpy(dout))
    got = _run_cpu(x, w, b, dout, (stride, pad, groups))
    for a, t in zip(got, (yt, xt.grad, wt.grad, bt.grad)):
        np.testing.assert_allclose(a, t.detach().numpy(), rtol=1e-4, atol=1e-4)


def test_cpu_conv_without_bias_leaves_no_bias_term():
    x, w, b, dout, args = _case(SHAPES[0])
    out = np.empty(dout.shape, np.float32)
    cpu.conv2d_forward(x, w, None, out, *args, _scratch(cpu.conv2d_forward_workspace_size, x, w, args))
    expected = np.empty_like(out)
    ref.conv2d_forward(x, w, None, expected, *args)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    dw, expected_dw = np.empty_like(w), np.empty_like(w)
    scratch = _scratch(cpu.conv2d_backward_weight_workspace_size, x, w, args)
    cpu.conv2d_backward_weight(x, dout, dw, None, *args, scratch)
    ref.conv2d_backward_weight(x, dout, expected_dw, None, *args)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape", [SHAPES[i] for i in (0, 4, 8, 10, 11, 13, 14, 15, 18, 19, 21, 22, 23, 24)],
    ids=[IDS[i] for i in (0, 4, 8, 10, 11, 13, 14, 15, 18, 19, 21, 22, 23, 24)],
)
def test_cpu_conv_gives_the_same_bits_every_call(shape):
    x, w, b, dout, args = _case(shape)
    first = _run_cpu(x, w, b, dout, args)
    second = _run_cpu(x, w, b, dout, args)
    for a, c in zip(first, second):
        assert np.array_equal(a, c)


@pytest.mark.parametrize("version", conv_study.VERSIONS["forward"])
@pytest.mark.parametrize(
    "shape", [SHAPES[i] for i in (1, 3, 8, 13, 18, 22, 23, 24)], ids=[IDS[i] for i in (1, 3, 8, 13, 18, 22, 23, 24)]
)
def test_numbered_versions_match_reference(version, shape):
    x, w, b, dout, args = _case(shape)
    expected = _reference(x, w, b, dout, args)
    out = np.full(dout.shape, np.nan, np.float32)
    size = conv_study.conv2d_version_workspace_size(version, "forward", x.shape, w.shape, *args)
    conv_study.conv2d_version(version, "forward")(x, w, b, out, *args, np.full(size, np.nan, np.float32))
    paths = conv_study._paths(version)
    atol = _atol(x.shape, w.shape, args, "forward", expected[0], paths)
    np.testing.assert_allclose(out, expected[0], rtol=1e-4, atol=atol)
    if version == 1:
        return
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    size = conv_study.conv2d_version_workspace_size(version, "data", x.shape, w.shape, *args)
    conv_study.conv2d_version(version, "data")(dout, w, dx, *args, np.full(size, np.nan, np.float32))
    size = conv_study.conv2d_version_workspace_size(version, "weight", x.shape, w.shape, *args)
    conv_study.conv2d_version(version, "weight")(x, dout, dw, db, *args, np.full(size, np.nan, np.float32))
    for got, want, direction in zip((dx, dw, db), expected[1:], ("data", "weight", "weight")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=_atol(x.shape, w.shape, args, direction, want, paths))


def test_too_small_scratch_says_how_to_size_it():
    x, w, b, dout, args = _case(SHAPES[0])
    out = np.empty(dout.shape, np.float32)
    with pytest.raises(ValueError, match="conv2d_forward_workspace_size"):
        cpu.conv2d_forward(x, w, b, out, *args, np.empty(1, np.float32))


def test_wrong_dtype_and_shape_are_named():
    x, w, b, dout, args = _case(SHAPES[0])
    scratch = _scratch(cpu.conv2d_forward_workspace_size, x, w, args)
    with pytest.raises(TypeError, match="float32"):
        cpu.conv2d_forward(x.astype(np.float64), w, b, np.empty(dout.shape, np.float32), *args, scratch)
    with pytest.raises(ValueError, match="out has shape"):
        cpu.conv2d_forward(x, w, b, np.empty((1, 1, 1, 1), np.float32), *args, scratch)


def test_scratch_stays_modest_on_resnet_shapes():
    # the column tile is a few MB, never the whole batch's columns (75 MB for this layer)
    size = cpu.conv2d_backward_weight_workspace_size((32, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1)
    assert size * 4 <= 6 * 2**20


def test_scipy_blas_is_single_threaded_inside_the_parallel_gemms_and_restored():
    # v4/v5 call BLAS from inside Numba's parallel loop: a multithreaded pthreads OpenBLAS there
    # oversubscribes the cores (and can print "Detect OpenMP Loop and this application may hang")
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        libraries = threadpoolctl.threadpool_info()
        return {lib["filepath"]: lib["num_threads"] for lib in libraries if lib["user_api"] == "blas"}

    before = blas_threads()
    with cpu.blas_on_calling_thread:
        inside = blas_threads()
    scipy_libs = [path for path in inside if "scipy" in path.replace("\\", "/").split("/")[-2]]
    assert scipy_libs and all(inside[path] == 1 for path in scipy_libs)
    assert blas_threads() == before


def test_blas_limit_holds_until_the_last_concurrent_conv_leaves():
    """ParallelInference runs convs on several threads: one leaving must not lift the limit under
    another, and the count afterwards must be what it was before (not a stuck 1). Read from the
    main thread (OpenBLAS's count as threadpoolctl reads it from a fresh thread is not reliable)."""
    import threading

    threadpoolctl = pytest.importorskip("threadpoolctl")

    def scipy_blas_threads():
        return [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
                if lib["user_api"] == "blas" and "scipy" in lib["filepath"].replace("\\", "/").split("/")[-2]]

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        before = scipy_blas_threads()
        other_inside, main_inside, other_left = threading.Event(), threading.Event(), threading.Event()

        def other():
            with cpu.blas_on_calling_thread:
                other_inside.set()
                main_inside.wait(10)
            other_left.set()

        thread = threading.Thread(target=other)
        thread.start()
        assert other_inside.wait(10)
        under_other = scipy_blas_threads()  # a limit set from a worker thread (not threadpoolctl's
        # "controlling thread") took effect
        with cpu.blas_on_calling_thread:
            main_inside.set()
            assert other_left.wait(10)
            under_main = scipy_blas_threads()
        thread.join(10)
        after = scipy_blas_threads()
    assert before and before[0] == 2
    assert all(n == 1 for n in under_other)
    assert all(n == 1 for n in under_main)  # the other thread's exit did not lift it
    assert after == before  # restored once, by the last to leave


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "stride", "pad", "groups", "expected"),
    [
        # 256 @8x8: F(4x4) with OpenBLAS since v18 (test_winograd4_takes_the_planes_the_figures_chose)
        ((32, 512, 4, 4), (512, 512, 3, 3), 1, 1, 1, "winograd4-by-k"),  # v34, OpenBLAS (v23-v30: F(2x2) by ξ)
        ((32, 3, 32, 32), (64, 3, 3, 3), 1, 1, 1, "stem"),  # the stem: im2col (v17), its own columns (v36)
        ((32, 64, 32, 32), (128, 64, 3, 3), 2, 1, 1, "winograd-s2"),  # v28, with OpenBLAS (else im2col)
        ((32, 256, 8, 8), (512, 256, 3, 3), 2, 1, 1, "winograd-s2"),  # v28: threads split by output channel
        ((32, 64, 32, 32), (128, 64, 1, 1), 2, 0, 1, "pointwise-strided"),  # v33 (v30 and before: im2col)
        ((32, 144, 32, 32), (144, 1, 3, 3), 1, 1, 144, "depthwise-registers"),  # v25 (v21: plane by plane)
        ((32, 144, 32, 32), (144, 1, 3, 3), 2, 1, 144, "depthwise-registers"),
        ((32, 144, 24, 24), (144, 1, 3, 3), 1, 1, 144, "depthwise-planes"),  # no register geometry: v21's
        ((32, 576, 8, 8), (576, 1, 3, 3), 2, 1, 576, "depthwise-registers"),  # small planes: in registers (v25)
        ((32, 960, 4, 4), (960, 1, 3, 3), 1, 1, 960, "depthwise-registers"),
        ((32, 192, 16, 16), (192, 1, 3, 3), 2, 1, 192, "depthwise-registers"),
        ((16, 144, 64, 64), (144, 1, 3, 3), 2, 1, 144, "depthwise-direct"),
        ((32, 96, 112, 112), (96, 1, 3, 3), 2, 1, 96, "depthwise-planes"),  # v44: 18.7 → 13.1 ms (direct before)
        ((8, 96, 112, 113), (96, 1, 3, 3), 2, 1, 96, "depthwise-direct"),  # odd: no row pairs, direct
    ],
)
def test_model_shapes_take_the_path_the_figures_chose(x_shape, w_shape, stride, pad, groups, expected):
    if expected == "winograd-s2" and blas.select_sgemm() != blas.OPENBLAS:
        expected = "gemm"
    if expected == "winograd4-by-k" and blas.select_sgemm() != blas.OPENBLAS:
        expected = "winograd-by-xi"
    # the speed figures chose ENGINE_CONV=fast's forward; auto's differs on F(4×4)'s layers only (test_conv_precision)
    assert cpu.path(x_shape, w_shape, stride, pad, groups, "forward", cpu.paths_for("fast")) == expected


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "openblas", "mkl"),
    [
        ((32, 64, 32, 32), (64, 64, 3, 3), "winograd4", "shifted"),  # F(4x4): 10.2 -> 7.7 ms (AMD, OpenBLAS)
        ((32, 128, 16, 16), (128, 128, 3, 3), "winograd4", "winograd"),  # 9.9 -> 8.0
        ((32, 256, 16, 16), (256, 256, 3, 3), "winograd4", "winograd"),  # ≤ 256 channels
        ((32, 512, 16, 16), (512, 512, 3, 3), "winograd", "winograd"),  # 36·K·C of U: F(2x2)
        # v18: 10.4 -> 7.5 ms (v14-v17: F(2x2)); v34: by output channel, 8.0 -> 5.7
        ((32, 256, 8, 8), (256, 256, 3, 3), "winograd4-by-k", "winograd"),
        # v18: F(4x4) 11.1 -> 13.0 ms, F(2x2); v23: F(2x2) split by Winograd position; v34: F(4x4) by k 10.2 -> 6.7
        ((32, 512, 4, 4), (512, 512, 3, 3), "winograd4-by-k", "winograd-by-xi"),
        ((32, 64, 64, 64), (64, 64, 3, 3), "shifted", "shifted"),  # not measured
    ],
)
@pytest.mark.parametrize("direction", ["forward", "data"])
def test_winograd4_takes_the_planes_the_figures_chose(x_shape, w_shape, openblas, mkl, direction):
    expected = openblas if blas.select_sgemm() == blas.OPENBLAS else mkl
    fast = cpu.paths_for("fast")  # the figures are F(4×4)'s speed; auto's forward is test_conv_precision's
    assert cpu.path(x_shape, w_shape, 1, 1, 1, direction, fast) == expected
    if expected == "winograd4-by-k":
        before_v34 = dataclasses.replace(fast, **conv_study.flags_off(34))
        expected = "winograd4" if x_shape[2] == 8 else "winograd-by-xi"
        assert cpu.path(x_shape, w_shape, 1, 1, 1, direction, before_v34) == expected
    if expected == "winograd4":
        assert cpu.path(x_shape, w_shape, 1, 1, 1, direction, conv_study._paths(13)) == "winograd"
    if x_shape[2] * x_shape[3] < 256:  # 8x8 planes took F(2x2) until v18
        assert cpu.path(x_shape, w_shape, 1, 1, 1, direction, conv_study._paths(17)) == "winograd"


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "openblas", "mkl"),
    [
        ((32, 64, 32, 32), (64, 64, 3, 3), "winograd4", "shifted"),  # v15: 15.5 -> 11.3 ms (AMD, OpenBLAS)
        ((32, 128, 16, 16), (128, 128, 3, 3), "winograd4", "winograd"),  # 10.6 -> 9.1
        # v15: 10.3 -> 9.2 (forward: no); v35: by output channel, 7.4 -> 6.9 and 6.6 -> 5.7
        ((32, 256, 8, 8), (256, 256, 3, 3), "winograd4-weight-by-k", "winograd"),
        ((32, 512, 4, 4), (512, 512, 3, 3), "winograd4-weight-by-k", "winograd"),  # v35: F(2x2) 10.2 -> 7.9
        ((32, 256, 4, 4), (256, 256, 3, 3), "winograd4-weight-by-k", "winograd"),  # v35's rule (not measured)
        ((32, 64, 64, 64), (64, 64, 3, 3), "shifted", "shifted"),  # not measured
    ],
)
def test_winograd4_weight_gradient_takes_the_planes_the_figures_chose(x_shape, w_shape, openblas, mkl):
    expected = openblas if blas.select_sgemm() == blas.OPENBLAS else mkl
    assert cpu.path(x_shape, w_shape, 1, 1, 1, "weight") == expected
    if expected == "winograd4-weight-by-k":
        expected = "winograd4" if x_shape[2] == 8 else "winograd"
        assert cpu.path(x_shape, w_shape, 1, 1, 1, "weight", conv_study._paths(34)) == expected
    if expected == "winograd4":
        assert cpu.path(x_shape, w_shape, 1, 1, 1, "weight", conv_study._paths(14)) != "winograd4"


def test_winograd4_runs_on_the_tested_shape():
    # the reference and determinism tests reach conv_winograd4 through the table only with OpenBLAS
    n, c, h, wd, k, r, stride, pad, groups = SHAPES[21]
    shapes = ((n, c, h, wd), (k, c, r, r), stride, pad, groups)
    expected = "winograd4" if blas.select_sgemm() == blas.OPENBLAS else "winograd"
    fast = cpu.paths_for("fast")
    assert cpu.path(*shapes, "forward", fast) == cpu.path(*shapes, "data") == cpu.path(*shapes, "weight") == expected
    assert cpu.path(*shapes, "forward", cpu.paths_for("auto")) == "winograd"  # v38: F(2×2) decides the masks


def test_the_fast_forward_matches_reference():
    # ENGINE_CONV=fast's forward (F(4×4), v34's by-k on small planes) is no longer the table's default
    fast = cpu.paths_for("fast")
    for index in (21, 18, 24):
        x, w, b, dout, args = _case(SHAPES[index])
        expected = _reference(x, w, b, dout, args)[0]
        out = np.full(dout.shape, np.nan, np.float32)
        size = cpu.workspace_size(x.shape, w.shape, *args, "forward", fast)
        cpu.forward(x, w, b, out, *args, np.full(max(size, 1), np.nan, np.float32), fast)
        atol = _atol(x.shape, w.shape, args, "forward", expected, fast)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("target", [1, 256])
def test_winograd4_weight_gradient_blocks_and_thread_ranges_match_reference(threads, target):
    # odd, non-square planes (dout past the edge is zero), one-row blocks that split images (dU summed
    # over many blocks) up to one block for the batch, a plane one pixel high
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3), (3, 7, 13, 6, 5)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        dw = np.full(w.shape, np.nan, np.float32)
        rows = winograd4.weight_block_rows(x.shape, c, k, target)
        size = winograd4.weight_workspace_size(x.shape, w.shape, threads, rows)
        with cpu.blas_on_calling_thread:
            winograd4.backward_weight(x, dout, dw, threads, rows, np.full(size, np.nan, np.float32))
        want, db = np.empty_like(w), np.empty(k, np.float32)
        ref.conv2d_backward_weight(x, dout, want, db, *args)
        np.testing.assert_allclose(dw, want, rtol=1e-5, atol=2e-5 * float(np.abs(want).max()))


def test_winograd4_weight_gradient_bits_do_not_depend_on_the_thread_count():
    x, w, _, dout, _ = _case((6, 16, 9, 10, 12, 3, 1, 1, 1))
    rows = winograd4.weight_block_rows(x.shape, 16, 12, 6)
    results = []
    for threads in (1, 2, 3):
        dw = np.empty_like(w)
        size = winograd4.weight_workspace_size(x.shape, w.shape, threads, rows)
        with cpu.blas_on_calling_thread:
            winograd4.backward_weight(x, dout, dw, threads, rows, np.full(size, np.nan, np.float32))
        results.append(dw)
    assert rows < 6 * 3  # several blocks
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("target", [1, 128])
def test_winograd4_blocks_and_thread_ranges_match_reference(threads, target):
    # odd, non-square planes (partial last tiles in both directions), planes smaller than a tile, blocks
    # of one tile row up to whole images, ranges that split images; forward and backward-data
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3), (3, 7, 13, 6, 5)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        want_out, want_dx = np.empty((n, k, h, wd), np.float32), np.empty_like(x)
        ref.conv2d_forward(x, w, None, want_out, *args)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        for direction, src, want, c_in, c_out in (("forward", x, want_out, c, k), ("data", dout, want_dx, k, c)):
            rows = winograd4.block_rows(x.shape, c_in, c_out, threads, target)
            size = winograd4.workspace_size(x.shape, w.shape, direction, threads, rows)
            got = np.full(want.shape, np.nan, np.float32)
            with cpu.blas_on_calling_thread:
                winograd4.forward(src, w, got, direction == "data", threads, rows, np.full(size, np.nan, np.float32))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _winograd4_tiles_reference(x, left, r0, nr, pad):
    """left · tile · leftᵀ in float64 for the tiles of tile rows [r0, r0 + nr) of x (tiles of
    left.shape[1] pixels every 4, x zero-padded by ``pad`` at the top and left), as t[ξ, c, tx·nr + r]:
    the column-major order within a block of v18's input transform and v23's dout transform."""
    size = left.shape[1]
    n, c, h, wd = x.shape
    th, tw = (h + 3) // 4, (wd + 3) // 4
    padded = np.zeros((n, c, 4 * th + size - 4, 4 * tw + size - 4))
    padded[:, :, pad : h + pad, pad : wd + pad] = x
    t = np.empty((len(left) ** 2, c, nr * tw))
    for r in range(nr):
        image, ty = divmod(r0 + r, th)
        for tx in range(tw):
            tile = padded[image, :, 4 * ty : 4 * ty + size, 4 * tx : 4 * tx + size]
            t[:, :, tx * nr + r] = np.einsum("ia,cab,kb->ikc", left, tile, left).reshape(-1, c)
    return t


def _winograd4_input_reference(x, r0, nr):
    """(Bᵀ d B) of 6×6 input tiles (one pixel of padding)."""
    bt = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                   [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64)
    return _winograd4_tiles_reference(x, bt, r0, nr, pad=1)


@pytest.mark.parametrize(("n", "c", "h", "wd", "r0", "nr"),
                         [(2, 3, 8, 8, 0, 4), (3, 2, 7, 9, 1, 5), (2, 2, 4, 4, 0, 2), (1, 2, 13, 6, 2, 2),
                          (2, 1, 1, 3, 0, 2), (2, 2, 16, 12, 3, 4)])
def test_winograd4_input_transform_writes_tiles_column_major(n, c, h, wd, r0, nr):
    # v18: the block's tiles go tile column by tile column (j = tx·nr + r), so that B across each tile's
    # six columns is one loop over the whole block; V must hold Bᵀ d B of each tile at that column
    x = np.random.default_rng(3).standard_normal((n, c, h, wd), dtype=np.float32)
    tw = (wd + 3) // 4
    skew = winograd4.SKEW
    v = np.full(36 * (c * nr * tw + skew), np.nan, np.float32)
    buf = np.full(winograd4._buffer(wd, nr), np.nan, np.float32)
    winograd4._input_transform(x.reshape(-1), r0, nr, c, h, wd, v, buf, 0, c)
    got = np.stack([v[xi * (c * nr * tw + skew) : xi * (c * nr * tw + skew) + c * nr * tw] for xi in range(36)])
    want = _winograd4_input_reference(x.astype(np.float64), r0, nr)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-4)


def _winograd4_dout_reference(d, r0, nr):
    """(A dY Aᵀ) of 4×4 dout tiles (no padding)."""
    a = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [1, -1, 1, -1], [1, 2, 4, 8], [1, -2, 4, -8], [0, 0, 0, 1]], np.float64)
    return _winograd4_tiles_reference(d, a, r0, nr, pad=0)


@pytest.mark.parametrize(("n", "k", "h", "wd", "r0", "nr", "k_lo", "k_hi"),
                         [(2, 3, 8, 8, 0, 4, 0, 3), (3, 2, 7, 9, 1, 5, 1, 2), (2, 2, 4, 4, 0, 2, 0, 2),
                          (1, 3, 13, 6, 2, 2, 1, 3), (2, 1, 1, 3, 0, 2, 0, 1), (2, 2, 16, 12, 3, 4, 0, 2)])
def test_winograd4_dout_transform_writes_tiles_column_major(n, k, h, wd, r0, nr, k_lo, k_hi):
    # v23: the weight gradient's dout transform runs over the whole block (tile (r, tx) at column
    # tx·nr + r, as V); M must hold A dY Aᵀ of each tile there, for the channels asked only
    d = np.random.default_rng(4).standard_normal((n, k, h, wd), dtype=np.float32)
    tw = (wd + 3) // 4
    step = k * nr * tw + winograd4.SKEW
    m = np.full(36 * step, np.nan, np.float32)
    buf = np.full(winograd4._weight_buffer(wd, nr), np.nan, np.float32)
    winograd4._dout_transform(d.reshape(-1), r0, nr, k_lo, k_hi, k, h, wd, m, buf)
    got = np.stack([m[xi * step : xi * step + k * nr * tw] for xi in range(36)]).reshape(36, k, nr * tw)
    want = _winograd4_dout_reference(d.astype(np.float64), r0, nr)
    np.testing.assert_allclose(got[:, k_lo:k_hi], want[:, k_lo:k_hi], rtol=1e-5, atol=1e-4)
    assert np.isnan(got[:, :k_lo]).all() and np.isnan(got[:, k_hi:]).all()


@pytest.mark.parametrize("direction", ["forward", "data"])
def test_32x32_takes_winograd_when_the_sgemm_is_openblas(direction):
    # v12: on OpenBLAS Winograd beat the shifted GEMMs at 64 @32x32 (AMD 15.4 -> 9.7 ms, Intel 11.4 -> 8.6);
    # with MKL's sgemm the two were level (Intel 7.6 vs 8.0), so 32x32 keeps the shifted GEMMs there
    shapes = ((32, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1, direction)
    assert cpu.winograd_max_pixels(direction, conv_study._paths(40), sgemm=blas.OPENBLAS) == 32 * 32
    assert cpu.winograd_max_pixels(direction, sgemm=blas.OPENBLAS) == 56 * 56  # v41: ImageNet's 64 @56×56
    assert cpu.winograd_max_pixels(direction, sgemm="MKL 2026.2 (sequential, reproducible mode)") == 16 * 16
    assert cpu.winograd_max_pixels("weight", sgemm=blas.OPENBLAS) == 16 * 16  # level at 32x32: shifted
    openblas = blas.select_sgemm() == blas.OPENBLAS
    assert cpu.path(*shapes, conv_study._paths(13)) == ("winograd" if openblas else "shifted")
    assert cpu.path(*shapes, conv_study._paths(11)) == "shifted"
    assert cpu.path((32, 64, 64, 64), (64, 64, 3, 3), 1, 1, 1, direction) == "shifted"  # not measured: shifted
    # F(2x2) was level with the shifted GEMMs on the weight gradient at 32x32; F(4x4) is not (v15)
    assert cpu.path((32, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1, "weight", conv_study._paths(14)) == "shifted"


@pytest.mark.parametrize(("index", "direction", "per_image"), [
    (16, "forward", True), (16, "data", True), (16, "weight", False),
    (17, "forward", False), (17, "data", True), (6, "forward", False), (6, "data", False),
])
def test_pointwise_per_image_is_reached_by_the_tested_shapes(index, direction, per_image):
    """The reference tests above reach the per-image 1×1 GEMMs (v8) only if these shapes plan one image
    a tile, and the stacked tiles where the rule says no (with the rule off they would stack)."""
    n, c, h, wd, k, r, stride, pad, groups = SHAPES[index]
    args = ((n, c, h, wd), (k, c, r, r), stride, pad, groups, direction, 1, 256)
    assert (cpu.gemm_tile_images(*args) == 1) == per_image
    assert cpu.gemm_tile_images(*args, per_image=False) > 1


def test_pointwise_on_4x4_planes_keeps_its_tiles():
    # MobileNetV2's 960->320 @4x4 backward-data ran 2.6 -> 5.0 ms per image (16-column GEMMs)
    assert cpu.gemm_tile_images((32, 960, 4, 4), (320, 960, 1, 1), 1, 0, 1, "data", 2, 256) > 1


@pytest.mark.parametrize(("x_shape", "w_shape", "in_place"), [
    ((32, 144, 16, 16), (32, 144, 1, 1), True),  # 16x16: tiles of 4 images before v16
    ((32, 384, 8, 8), (64, 384, 1, 1), True),
    ((32, 24, 32, 32), (144, 24, 1, 1), True),  # one-image tiles already: beta = 1 instead of a partial add
    ((32, 960, 4, 4), (160, 960, 1, 1), False),  # 4x4: 16-deep GEMMs per image lost, tiles stay
    ((32, 64, 32, 32), (128, 64, 1, 1), False),  # stride 2 (the call passes stride 2): im2col tiles
])
def test_pointwise_weight_gradient_accumulates_in_place_where_the_figures_chose(x_shape, w_shape, in_place):
    """v16: the 1x1 stride-1 weight gradient on planes of >= 64 pixels is one beta = 1 GEMM per image,
    with no column tile and no dw-sized partial per thread (the scratch shows it)."""
    stride = 2 if x_shape[1] == 64 else 1
    args = (x_shape, w_shape, stride, 0, 1)
    if in_place:
        assert cpu.gemm_tile_images(*args, "weight", 2, 1024, weight_in_place=True) == 1
    new = cpu.workspace_size(*args, "weight", conv_study._paths(17))  # v16's rule alone (v20 takes the stride 2)
    old = cpu.workspace_size(*args, "weight", conv_study._paths(15))
    extra_threads_slots = (cpu.get_num_threads() - 1) * int(np.prod(w_shape))
    if in_place:
        assert new == extra_threads_slots < old
    else:
        assert new == old


def test_pointwise_weight_in_place_is_reached_by_the_tested_shapes():
    """The reference tests reach v16's in-place weight gradient through SHAPES[16] and [17] (8x8 1x1)."""
    for index in (16, 17):
        n, c, h, wd, k, r, stride, pad, groups = SHAPES[index]
        args = ((n, c, h, wd), (k, c, r, r), stride, pad, groups, "weight", 1, 1024)
        assert cpu.gemm_tile_images(*args, weight_in_place=True) == 1
        assert cpu.gemm_tile_images(*args) > 1


def test_winograd_runs_on_the_tested_shape_in_every_direction():
    # the reference, determinism and numbered-version tests reach conv_winograd only through this shape
    # (through the numbered versions v10-v30 where the sgemm is OpenBLAS: since v34 the table runs
    # forward and backward-data by output channel in F(4x4), since v35 the weight gradient too)
    n, c, h, wd, k, r, stride, pad, groups = SHAPES[18]
    shapes = ((n, c, h, wd), (k, c, r, r), stride, pad, groups)
    v30 = conv_study._paths(30)
    assert cpu.path(*shapes, "forward", v30) == cpu.path(*shapes, "data", v30) == "winograd"
    assert cpu.path(*shapes, "weight", v30) == "winograd"
    if blas.select_sgemm() == blas.OPENBLAS:  # v35: the weight gradient too
        fast = cpu.paths_for("fast")
        assert cpu.path(*shapes, "forward", fast) == cpu.path(*shapes, "data") == "winograd4-by-k"
        assert cpu.path(*shapes, "weight") == "winograd4-weight-by-k"
        assert cpu.path(*shapes, "forward", conv_study._paths(42)) == "winograd"  # v38-v42: the table's forward
        assert cpu.path(*shapes, "forward", cpu.paths_for("auto")) == "winograd-by-xi"  # v43: by ξ on ≤ 7×7
    assert cpu.path(*shapes, "weight", conv_study._paths(10)) == "gemm"  # v10: 35 pixels, below the shifted path's 64
    assert cpu.path(*shapes, "forward", conv_study._paths(9)) == "gemm"  # v9 keeps its own path


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "expected"),
    [
        ((32, 64, 32, 32), (64, 64, 3, 3), "shifted"),  # 32x32: Winograd level with the shifted GEMMs
        ((32, 128, 16, 16), (128, 128, 3, 3), "winograd"),
        ((32, 256, 8, 8), (256, 256, 3, 3), "winograd"),
        ((32, 512, 4, 4), (512, 512, 3, 3), "winograd"),
        ((32, 3, 32, 32), (64, 3, 3, 3), "gemm"),  # the stem: im2col (SHIFTED_MIN_CHANNELS)
        ((32, 8, 32, 32), (64, 8, 3, 3), "shifted"),
    ],
)
def test_weight_gradient_takes_the_path_the_figures_chose(x_shape, w_shape, expected):
    # v14's rules (with OpenBLAS, v15 moves the first two to F(4x4): test_winograd4_takes_the_planes_...)
    assert cpu.path(x_shape, w_shape, 1, 1, 1, "weight", conv_study._paths(14)) == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("target", [2, 512])
def test_winograd_weight_gradient_blocks_and_thread_ranges_match_reference(threads, target):
    # odd, non-square planes (the last tile's dout column / row past the edge is zero); one-row blocks
    # that split images (dU accumulated over many blocks) up to one block for the batch; a 1-pixel-high plane
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3), (4, 9, 6, 5, 7)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        dw = np.full(w.shape, np.nan, np.float32)
        rows = winograd.weight_block_rows(x.shape, c, k, target)
        size = winograd.weight_workspace_size(x.shape, w.shape, threads, rows)
        with cpu.blas_on_calling_thread:
            winograd.backward_weight(x, dout, dw, threads, rows, np.full(size, np.nan, np.float32))
        want, db = np.empty_like(w), np.empty(k, np.float32)
        ref.conv2d_backward_weight(x, dout, want, db, *args)
        np.testing.assert_allclose(dw, want, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_winograd_by_xi_matches_reference_and_the_tile_split(threads):
    # v23: the threads split the GEMMs by Winograd position, the transforms by channel; odd and 4×4
    # planes, a block for the whole batch or several (c_in, c_out large enough for the budget: no)
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3), (37, 8, 4, 4, 7)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        want_out, want_dx = np.empty((n, k, h, wd), np.float32), np.empty_like(x)
        ref.conv2d_forward(x, w, None, want_out, *args)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        for direction, src, want, c_in, c_out in (("forward", x, want_out, c, k), ("data", dout, want_dx, k, c)):
            rows = winograd.by_xi_block_rows(x.shape, c_in, c_out)
            size = winograd.by_xi_workspace_size(x.shape, w.shape, direction, threads)
            got, tiles = np.full(want.shape, np.nan, np.float32), np.full(want.shape, np.nan, np.float32)
            tile_rows = winograd.block_rows(x.shape, c_in, c_out, threads)
            tile_size = winograd.workspace_size(x.shape, w.shape, direction, threads)
            with cpu.blas_on_calling_thread:
                winograd.forward_by_xi(src, w, got, direction == "data", threads, rows,
                                       np.full(size, np.nan, np.float32))
                winograd.forward(src, w, tiles, direction == "data", threads, tile_rows,
                                 np.full(tile_size, np.nan, np.float32), transposed=True)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * float(np.abs(want).max()))
            np.testing.assert_array_equal(got, tiles)  # the same transforms, the same GEMM columns


def test_winograd_by_xi_bits_do_not_depend_on_the_thread_count():
    x, w, _, _, _ = _case((9, 8, 4, 4, 6, 3, 1, 1, 1))
    results = []
    for threads in (1, 2, 3):
        out = np.empty((9, 6, 4, 4), np.float32)
        size = winograd.by_xi_workspace_size(x.shape, w.shape, "forward", threads)
        with cpu.blas_on_calling_thread:
            winograd.forward_by_xi(x, w, out, False, threads, winograd.by_xi_block_rows(x.shape, 8, 6),
                                   np.full(size, np.nan, np.float32))
        results.append(out)
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("direction", ["forward", "data"])
def test_512_channels_on_4x4_take_winograd_by_xi(direction):
    # v23: 512 @4x4 forward 9.6 -> 9.15 ms, backward-data 10.05 -> 9.65 (two threads, batch 32); 8x8 lost.
    # Until v34 (F(4x4) by output channel), and still where the sgemm is not OpenBLAS.
    shapes = ((32, 512, 4, 4), (512, 512, 3, 3), 1, 1, 1)
    before_v34 = dataclasses.replace(cpu.paths_for("fast"), **conv_study.flags_off(34))  # v38's forward: tiles
    assert cpu.path(*shapes, direction, before_v34) == "winograd-by-xi"
    assert cpu.path(*shapes, direction, conv_study._paths(20)) == "winograd"
    assert cpu.path(*shapes, "weight", conv_study._paths(34)) == "winograd"
    assert cpu.path((32, 512, 8, 8), (512, 512, 3, 3), 1, 1, 1, direction, before_v34) == "winograd"


def test_winograd_by_xi_is_reached_by_the_tested_shapes():
    # the reference, determinism and numbered-version tests reach forward_by_xi through this shape
    n, c, h, wd, k, r, stride, pad, groups = SHAPES[22]
    shapes = ((n, c, h, wd), (k, c, r, r), stride, pad, groups)
    assert cpu.path(*shapes, "forward", cpu.paths_for("fast")) == cpu.path(*shapes, "data") == "winograd-by-xi"
    assert cpu.path(*shapes, "forward", conv_study._paths(42)) == "winograd"  # v38-v42: the float32 forward in tiles
    assert cpu.path(*shapes, "forward") == "winograd-by-xi"  # v43: by ξ again on ≤ 7×7 (no compile job of its own)


def test_winograd_weight_gradient_bits_do_not_depend_on_the_thread_count():
    # the blocks (and so the order of every sum) are fixed by the shape; threads only split the work
    x, w, _, dout, _ = _case((6, 16, 6, 10, 12, 3, 1, 1, 1))
    rows = winograd.weight_block_rows(x.shape, 16, 12, 8)
    results = []
    for threads in (1, 2, 3):
        dw = np.empty_like(w)
        size = winograd.weight_workspace_size(x.shape, w.shape, threads, rows)
        with cpu.blas_on_calling_thread:
            winograd.backward_weight(x, dout, dw, threads, rows, np.full(size, np.nan, np.float32))
        results.append(dw)
    assert rows < 6 * 3  # several blocks
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("target", [2, 128])
def test_winograd_blocks_and_thread_ranges_match_reference(threads, target):
    # odd, non-square planes; blocks of one tile row up to whole images; ranges that split images
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        out, dx = np.full(dout.shape, np.nan, np.float32), np.full(x.shape, np.nan, np.float32)
        dx_t = np.full(x.shape, np.nan, np.float32)  # v13: the flipped filter transformed into U' itself
        with cpu.blas_on_calling_thread:
            for direction, src, dst, c_in, c_out, transposed in (
                ("forward", x, out, c, k, False), ("data", dout, dx, k, c, False), ("data", dout, dx_t, k, c, True)
            ):
                rows = winograd.block_rows(x.shape, c_in, c_out, threads, target)
                size = winograd.workspace_size(x.shape, w.shape, direction, threads, target)
                winograd.forward(src, w, dst, direction == "data", threads, rows, np.full(size, np.nan, np.float32),
                                 transposed=transposed)
        want_out, want_dx = np.empty_like(out), np.empty_like(dx)
        ref.conv2d_forward(x, w, None, want_out, *args)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(dx_t, want_dx, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_winograd_split_by_output_channel_matches_reference(threads):
    # the dropped variant kept in the study (conv_study.forward_by_channels): channel ranges that
    # split unevenly, one-row blocks and one block for the batch
    for n, c, h, wd, k in ((3, 5, 7, 9, 4), (5, 3, 4, 4, 6), (2, 4, 1, 3, 3)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        want_out, want_dx = np.empty((n, k, h, wd), np.float32), np.empty_like(x)
        ref.conv2d_forward(x, w, None, want_out, *args)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        for target in (2, 512):
            for direction, src, want, c_in, c_out in (("forward", x, want_out, c, k), ("data", dout, want_dx, k, c)):
                rows = conv_study.channel_block_rows(x.shape, c_in, c_out, target, 1 << 20)
                size = conv_study.channel_workspace_size(x.shape, w.shape, direction, threads, rows)
                got = np.full(want.shape, np.nan, np.float32)
                with cpu.blas_on_calling_thread:
                    conv_study.forward_by_channels(src, w, got, direction == "data", threads, rows,
                                                   np.full(size, np.nan, np.float32))
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("flipped", [False, True])
def test_chunked_filter_transform_gives_the_same_bits(flipped):
    # the dropped vectorized filter transform (conv_study._filter_transform_chunks): partial chunks,
    # more lanes than one chunk, and ranges split in two
    for k, c in ((5, 7), (130, 3), (3, 300)):
        w = np.random.default_rng(1).standard_normal((k, c, 3, 3), dtype=np.float32)
        size = 16 * (k * c + winograd.SKEW)
        want, got = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)
        n = c if flipped else k
        if flipped:
            winograd._filter_transform_flipped(w, 0, c, want)
        else:
            winograd._filter_transform(w, 0, k, want)
        tmp = np.empty(15 * conv_study.FILTER_CHUNK, np.float32)
        conv_study._filter_transform_chunks(w, 0, n // 2, got, flipped, tmp)
        conv_study._filter_transform_chunks(w, n // 2, n, got, flipped, tmp)
        np.testing.assert_array_equal(got, want)  # NaN in the same places (the skew) counts as equal


def test_shifted_path_runs_on_the_tested_shapes():
    # the reference tests above reach the shifted kernels only if these shapes pick them: since v17
    # the < 8-channel shapes 13 and 14 take im2col in every direction (the study's v16 still runs them
    # on the shifted GEMMs; since v36 their forward and weight gradient run conv_stem), and 19 and 20
    # (8 channels) cover the shifted forward and weight gradient
    for i in (13, 14):
        n, c, h, wd, k, r, stride, pad, groups = SHAPES[i]
        for direction in ("forward", "weight"):
            assert cpu.path((n, c, h, wd), (k, c, r, r), stride, pad, groups, direction) == "stem"  # < 8 channels
            before = conv_study._paths(35)
            assert cpu.path((n, c, h, wd), (k, c, r, r), stride, pad, groups, direction, before) == "gemm"
        assert cpu.path((n, c, h, wd), (k, c, r, r), stride, pad, groups, "forward", conv_study._paths(16)) == "shifted"
        assert cpu.path((n, c, h, wd), (k, c, r, r), stride, pad, groups, "weight", conv_study._paths(10)) == "shifted"
    for i in (19, 20):
        n, c, h, wd, k, r, stride, pad, groups = SHAPES[i]
        for direction in ("forward", "data", "weight"):
            assert cpu.path((n, c, h, wd), (k, c, r, r), stride, pad, groups, direction) == "shifted"


@pytest.fixture
def without_registers(monkeypatch):
    """The v21-era depthwise kernels on their shapes: v25's planes in registers off (no geometry fits)."""
    from kernels.cpu import conv_depthwise_regs

    monkeypatch.setattr(conv_depthwise_regs, "GEOMETRIES", ())


DEPTHWISE_SHAPES = [  # flat depthwise shapes of more than one chunk at 1024 floats a chunk
    s for s in SHAPES if s[8] > 1 and s[8] == s[1] == s[4] and s[5] == 3 and s[7] == 1 and s[1] * s[2] * s[3] > 1024
    and s[2] * s[3] < 1024  # larger planes run plane by plane
]


@pytest.mark.parametrize("elements", [256, 1024])
@pytest.mark.parametrize("shape", DEPTHWISE_SHAPES, ids=["x".join(map(str, s)) for s in DEPTHWISE_SHAPES])
@pytest.mark.usefixtures("without_registers")
def test_depthwise_flat_matches_reference_at_every_chunk_size_the_rule_picks(shape, elements, monkeypatch):
    """The chunk size follows the machine's L1 (``conv_depthwise.chunk_elements``): each size it can
    pick must give the reference's results, chunk borders included."""
    from kernels.cpu import conv_depthwise

    monkeypatch.setattr(conv_depthwise, "CHUNK_ELEMENTS", elements)
    x, w, b, dout, args = _case(shape)
    assert cpu.path(x.shape, w.shape, args[0], args[1], args[2], "forward") == "depthwise-flat"
    assert conv_depthwise.channels_per_chunk(x.shape) < x.shape[1]  # several chunks
    out, dx, dw, db = _run_cpu(x, w, b, dout, args)
    expected = _reference(x, w, b, dout, args)
    for got, want in zip((out, dx, dw, db), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_depthwise_chunk_follows_the_l1_data_cache(tmp_path):
    """512 floats a chunk on a 32 KiB L1d (nine position-weights of 1024 would not fit), 1024 from
    48 KiB, read from sysfs, and the 32 KiB answer where the OS says nothing."""
    from kernels.cpu import conv_depthwise as dwc

    assert [dwc.chunk_elements(k * 1024) for k in (16, 32, 48, 64, 1024)] == [256, 512, 1024, 1024, 1024]
    caches = [("1", "Instruction", "64K"), ("1", "Data", "48K"), ("2", "Unified", "1024K")]
    for index, (level, kind, size) in enumerate(caches):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    assert dwc.l1d_bytes(str(tmp_path)) == 48 * 1024
    assert dwc.l1d_bytes(str(tmp_path / "missing")) == dwc.L1D_FALLBACK_BYTES == 32 * 1024
    assert dwc.CHUNK_ELEMENTS == dwc.chunk_elements(dwc.l1d_bytes())


def test_add_partials_adds_slot_after_slot_in_order_within_its_range():
    """The weight gradients' per-thread partials: total + slot 0 + slot 1 + ... in that order (the
    same bits as NumPy's adds in that order), only inside [lo, hi)."""
    rng = np.random.default_rng(3)
    total = rng.standard_normal(1001).astype(np.float32)
    partials = (rng.standard_normal(3 * 1001) * 1e3).astype(np.float32)
    got = total.copy()
    cpu.add_partials(got, partials, 3, 7, 990)
    expected = total.copy()
    for t in range(3):
        expected[7:990] = expected[7:990] + partials[t * 1001 + 7 : t * 1001 + 990]
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("direction", ["forward", "data", "weight"])
def test_stems_take_their_own_path_and_backward_data_stays_on_im2col(direction):
    # v36: a 3×3 stride-1 pad-1 conv of ≤ 4 input channels runs forward and weight gradient on conv_stem
    # (v17–v35: im2col; v16 kept forward and backward-data on the shifted GEMMs); its backward-data (never
    # called on a network's input) stays on im2col, and so does an ImageNet stem (stride 2)
    stem, wide = ((32, 3, 32, 32), (64, 3, 3, 3)), ((32, 8, 32, 32), (64, 8, 3, 3))
    assert cpu.path(*stem, 1, 1, 1, direction) == ("gemm" if direction == "data" else "stem")
    assert cpu.path(*stem, 1, 1, 1, direction, conv_study._paths(35)) == "gemm"
    # the ImageNet stems (stride 2): their own columns by output rows in v39–v41 (test_conv_stem); in v42–v46 only
    # the 7×7 forward, where they measured faster than im2col (conv.STEM_STRIDED_MIN_KERNEL); since v47 (columns
    # from the phase-split image, the weight gradient in one transposed sgemm) the weight gradients too
    assert cpu.path((32, 3, 224, 224), (32, 3, 3, 3), 2, 1, 1, direction, conv_study._paths(41)) == (
        "gemm" if direction == "data" else "stem-strided")
    assert cpu.path((32, 3, 224, 224), (32, 3, 3, 3), 2, 1, 1, direction, conv_study._paths(46)) == "gemm"
    assert cpu.path((32, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1, direction, conv_study._paths(46)) == (
        "stem-strided" if direction == "forward" else "gemm")
    assert cpu.path((32, 3, 224, 224), (32, 3, 3, 3), 2, 1, 1, direction) == (
        "stem-strided" if direction == "weight" else "gemm")
    assert cpu.path((32, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1, direction) == (
        "gemm" if direction == "data" else "stem-strided")
    assert cpu.path((32, 3, 224, 224), (32, 3, 3, 3), 2, 1, 1, direction, conv_study._paths(38)) == "gemm"
    assert cpu.path((32, 3, 32, 32), (64, 3, 3, 3), 1, 0, 1, direction) == "gemm"  # "valid": not a stem shape
    assert cpu.path(*wide, 1, 1, 1, direction, conv_study._paths(13)) == "shifted"
    if direction != "weight":
        assert cpu.path(*stem, 1, 1, 1, direction, conv_study._paths(16)) == "shifted"


@pytest.mark.parametrize(
    "shape", [(5, 3, 9, 8, 8, 3, 1, 1, 1), (3, 1, 4, 6, 40, 3, 1, 1, 1), (4, 4, 7, 5, 3, 3, 1, 1, 1)],
    ids=["3ch-odd", "1ch-two-k-blocks", "4ch-3k"],
)
def test_stem_matches_reference_at_every_thread_count(shape):
    """v36 (``conv_stem``): its columns (edges zeroed, the wrapped column too), K blocks of 32, image shares."""
    x, w, b, dout, args = _case(shape)
    assert cpu.path(x.shape, w.shape, *args, "forward") == "stem"
    expected = _reference(x, w, b, dout, args)
    for got in _run_cpu_at_thread_counts(x, w, b, dout, args, (1, 2, 3)):
        for name, g, e in zip(("out", "dx", "dw", "db"), got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4, err_msg=name)


def test_stem_forward_gives_the_bits_of_im2col():
    """The same sgemm depth (27) over the same columns: v36's forward is v35's bits on a ResNet stem shape."""
    x, w, b, dout, args = _case((4, 3, 32, 32, 64, 3, 1, 1, 1))
    outs = []
    for version in (35, 36):
        out = np.empty(dout.shape, np.float32)
        size = conv_study.conv2d_version_workspace_size(version, "forward", x.shape, w.shape, *args)
        conv_study.conv2d_version(version, "forward")(x, w, None, out, *args, np.empty(max(1, size), np.float32))
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes()


DEPTHWISE_THREAD_SHAPES = [  # (n, c, h, w, k, r, stride, pad, groups): row pairs, full resolution, stride 1
    (6, 40, 8, 8, 40, 3, 2, 1, 40),
    (5, 24, 7, 7, 24, 3, 2, 1, 24),
    (5, 48, 4, 4, 48, 3, 1, 1, 48),
    (3, 12, 12, 12, 12, 3, 2, 1, 12),  # 12×12: under plane by plane (v45: from 14×14)
]


@pytest.mark.parametrize("shape", DEPTHWISE_THREAD_SHAPES, ids=["x".join(map(str, s)) for s in DEPTHWISE_THREAD_SHAPES])
@pytest.mark.usefixtures("without_registers")
def test_depthwise_flat_shares_match_reference_and_give_the_same_bits_at_any_thread_count(shape, monkeypatch):
    """The flat depthwise kernels run one share per thread (``threads.run_shares``), several channel
    chunks each (256 floats a chunk here), each chunk computed the same way whichever thread owns it:
    the reference's results, and the same bits at any thread count."""

    from kernels.cpu import conv_depthwise

    monkeypatch.setattr(conv_depthwise, "CHUNK_ELEMENTS", 256)
    x, w, b, dout, args = _case(shape, seed=3)
    assert cpu.path(x.shape, w.shape, args[0], args[1], args[2], "forward") == "depthwise-flat"
    expected = _reference(x, w, b, dout, args)
    results = _run_cpu_at_thread_counts(x, w, b, dout, args, (1, 2))
    for got, want in zip(results[0], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for other in results[1:]:
        for a, b_ in zip(results[0], other):
            np.testing.assert_array_equal(a, b_)


IM2COL_IN_PLACE_SHAPES = [  # (n, c, h, w, k, r, stride, pad, groups): im2col weight gradients with >= 16x16 outputs
    (5, 3, 16, 16, 8, 3, 1, 1, 1),  # a stem
    (7, 4, 32, 32, 6, 1, 2, 0, 1),  # 1x1 stride 2 on 32x32
    (5, 5, 33, 32, 7, 3, 2, 1, 1),  # 3x3 stride 2, odd plane
]


@pytest.mark.parametrize("shape", IM2COL_IN_PLACE_SHAPES, ids=["x".join(map(str, s)) for s in IM2COL_IN_PLACE_SHAPES])
def test_im2col_weight_gradient_in_place_matches_reference_at_one_and_two_threads(shape):
    """v20: one image's im2col and one beta = 1 sgemm into dW per image, several images per thread
    (the beta = 1 accumulation), no column tile of several images and no per-tile partial in scratch. With
    v30's paths: since v33 the 1×1 stride-2 weight gradient runs on its kept pixels (``pointwise-strided``)."""
    from numba import get_num_threads, set_num_threads

    x, w, b, dout, args = _case(shape, seed=5)
    stride, pad, groups = args
    paths = conv_study._paths(30)
    assert cpu.path(x.shape, w.shape, stride, pad, groups, "weight", paths) == "gemm"
    assert cpu._im2col_weight_in_place(x.shape, w.shape, stride, pad, groups)
    assert cpu.gemm_tile_images(x.shape, w.shape, *args, "weight", 2, 4096, im2col_in_place=True) == 1
    assert cpu.gemm_tile_images(x.shape, w.shape, *args, "weight", 2, 4096) > 1  # v17 tiled them
    oh, ow = ref.check_conv2d_shapes(x.shape, w.shape, *args)
    threads = cpu.get_num_threads()
    rows = w.shape[1] * w.shape[2] * w.shape[3]
    assert cpu.workspace_size(x.shape, w.shape, *args, "weight", paths) == (
        threads * rows * oh * ow + (threads - 1) * w.size
    )
    want_dw, want_db = np.empty_like(w), np.empty_like(b)
    ref.conv2d_backward_weight(x, dout, want_dw, want_db, *args)
    saved = get_num_threads()
    try:
        for count in sorted({1, saved}):
            set_num_threads(count)
            dw, db = np.full(w.shape, np.nan, np.float32), np.full(b.shape, np.nan, np.float32)
            scratch = np.full(cpu.workspace_size(x.shape, w.shape, *args, "weight", paths), np.nan, np.float32)
            cpu.backward_weight(x, dout, dw, db, *args, scratch, paths)
            np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(db, want_db, rtol=1e-4, atol=1e-4)
    finally:
        set_num_threads(saved)


WEIGHT_GROUP_SHAPES = [  # (n, c, h, w, k, r, stride, pad, groups): depthwise weight gradients by image groups
    (9, 20, 8, 8, 20, 3, 1, 1, 20),  # two groups of four and one of one; the tensor's first and last planes
    (10, 12, 10, 10, 12, 3, 2, 1, 12),  # stride 2, row pairs, groups of four and of two
    (7, 40, 8, 8, 40, 3, 2, 1, 40),  # stride 2, several channel chunks (256 floats)
    (5, 6, 16, 12, 6, 3, 1, 1, 6),  # a plane that is not square
    (9, 10, 7, 7, 10, 3, 1, 1, 10),  # 7×7: by groups since v45 (MobileNetV2's ImageNet 960 @7×7)
]


@pytest.mark.parametrize("shape", WEIGHT_GROUP_SHAPES, ids=["x".join(map(str, s)) for s in WEIGHT_GROUP_SHAPES])
@pytest.mark.usefixtures("without_registers")
def test_depthwise_weight_by_groups_matches_reference_and_gives_the_same_bits_at_any_thread_count(shape, monkeypatch):
    """v21: the weight gradient sums each plane's taps in lanes, four images a pass, into one partial
    per image group, the groups added in order: the reference's dW, and the same bits at 1, 2 and 3
    threads (3 where Numba's pool has them); the study's v20 (per-position accumulators) agrees."""
    from numba import get_num_threads, set_num_threads

    from kernels.cpu import conv_depthwise

    monkeypatch.setattr(conv_depthwise, "CHUNK_ELEMENTS", 256)
    x, w, b, dout, args = _case(shape, seed=7)
    stride, pad, groups = args
    assert cpu.path(x.shape, w.shape, stride, pad, groups, "weight") == "depthwise-groups"
    assert conv_depthwise.by_groups(x.shape, stride)
    want = np.empty_like(w)
    ref.conv2d_backward_weight(x, dout, want, None, *args)
    saved, results = get_num_threads(), []
    try:
        for threads in sorted({1, 2, 3, saved} & set(range(1, saved + 1))):
            set_num_threads(threads)
            dw = np.full(w.shape, np.nan, np.float32)
            scratch = _scratch(cpu.conv2d_backward_weight_workspace_size, x, w, args)
            cpu.conv2d_backward_weight(x, dout, dw, None, *args, scratch)
            results.append(dw)
        old = np.full(w.shape, np.nan, np.float32)
        size = conv_study.conv2d_version_workspace_size(20, "weight", x.shape, w.shape, *args)
        conv_study.conv2d_version(20, "weight")(x, dout, old, None, *args, np.full(size, np.nan, np.float32))
    finally:
        set_num_threads(saved)
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(old, want, rtol=1e-4, atol=1e-4)
    for other in results[1:]:
        assert other.tobytes() == results[0].tobytes()


@pytest.mark.usefixtures("without_registers")
def test_depthwise_weight_by_groups_keeps_a_nan_in_its_own_channel():
    """The taps off the plane read the neighbour plane's pixels; the masks select them away (not a
    product with 0), so an inf or NaN in one channel's input reaches only that channel's dW."""
    from kernels.cpu import conv_depthwise

    for stride in (1, 2):
        x, w, b, dout, args = _case((8, 6, 8, 8, 6, 3, stride, 1, 6), seed=2)
        assert conv_depthwise.by_groups(x.shape, stride)
        x[:, 2] = np.inf
        x[3, 4, 0, 0] = np.nan
        dw = np.empty_like(w)
        scratch = _scratch(cpu.conv2d_backward_weight_workspace_size, x, w, args)
        cpu.conv2d_backward_weight(x, dout, dw, None, *args, scratch)
        finite = [c for c in range(6) if c not in (2, 4)]
        assert np.isfinite(dw[finite]).all()
        want = np.empty_like(w)
        ref.conv2d_backward_weight(x, dout, want, None, *args)
        np.testing.assert_allclose(dw[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_depthwise_weight_by_groups_from_7x7_planes_at_even_sizes():
    from kernels.cpu import conv_depthwise

    assert conv_depthwise.by_groups((32, 576, 8, 8), 2) and conv_depthwise.by_groups((32, 144, 32, 32), 1)
    assert conv_depthwise.by_groups((32, 960, 7, 7), 1)  # v45 (v21–v44: from 8×8)
    assert not conv_depthwise.by_groups((32, 960, 7, 7), 1, imagenet=False)
    assert not conv_depthwise.by_groups((32, 960, 4, 4), 1)  # 4×4: the per-position accumulators (v20)
    assert not conv_depthwise.by_groups((6, 40, 7, 7), 2)  # odd plane at stride 2: no row pairs


def test_pointwise_pixel_blocks_take_the_narrow_side_of_large_planes():
    """v46: pixel blocks where the GEMM's output rows are fewer than its depth on planes of ≥ 56×56, each block
    within OpenBLAS's small-matrix kernel in whole vectors; every other GEMM keeps all its pixels."""
    from kernels.cpu import conv_pointwise as pw

    limit = pw.SMALL_GEMM_MNK
    assert pw.pixel_block(16, 96, 112 * 112, limit) == 640  # 96→16 backward-data: 16·96·640 ≤ 10⁶
    assert pw.pixel_block(24, 144, 56 * 56, limit) == 288
    assert 24 * 144 * 288 <= limit < 24 * 144 * (288 + 16)
    assert pw.pixel_block(96, 16, 112 * 112, limit) == 112 * 112  # the wide side: rows are cut instead
    assert pw.pixel_block(16, 96, 28 * 28, limit) == 28 * 28  # under 56×56
    assert pw.pixel_block(16, 96, 112 * 112, 0) == 112 * 112  # no limit
    assert pw.pixel_block(64, 8192, 112 * 112, limit) == 112 * 112  # a block would be under 64 pixels
    for shape in ((2, 40, 60, 60, 8, 1, 1, 0, 1), (2, 8, 60, 60, 40, 1, 1, 0, 1)):  # SHAPES' two v46 shapes
        assert shape in SHAPES
    assert 60 * 60 // 2 < pw.pixel_block(8, 40, 60 * 60, limit) < 60 * 60  # there: two blocks, the last partial
    # the weight gradient's (v46): a 24 × 32 sub-block of a 48 × 64 thread block, pixels in blocks of 1296
    assert (2, 64, 60, 60, 96, 1, 1, 0, 1) in SHAPES
    assert pw.weight_steps(48, 64, 3600, False, limit) == (24, 32, 1296)
    assert pw.weight_steps(48, 64, 3600, False, limit, pixel_blocks=False)[2] == 3600
    assert pw.weight_steps(48, 64, 28 * 28, False, limit)[2] == 28 * 28  # under 56×56: every pixel in one GEMM


def test_depthwise_plane_by_plane_from_14x14_since_v45():
    from kernels.cpu import conv_depthwise

    for stride in (1, 2):
        assert conv_depthwise.plane_by_plane((32, 576, 14, 14), stride)
        assert not conv_depthwise.plane_by_plane((32, 576, 14, 14), stride, imagenet=False)
        assert not conv_depthwise.plane_by_plane((32, 576, 12, 12), stride)  # below: the chunk runs
    assert not conv_depthwise.plane_by_plane((32, 576, 15, 15), 2)  # odd at stride 2: no row pairs


PLANE_SHAPES = [  # (n, c, h, w, k, r, stride, pad, groups): depthwise forward and backward-data plane by plane
    (3, 5, 16, 16, 5, 3, 1, 1, 5),  # two planes a chunk; the tensor's first and last planes (checked loop)
    (3, 4, 17, 16, 4, 3, 1, 1, 4),  # odd rows
    (2, 3, 32, 32, 3, 3, 2, 1, 3),  # stride 2: kept outputs on row pairs; backward-data upsampled
    (3, 6, 14, 14, 6, 3, 1, 1, 6),  # 14×14 (v45): MobileNetV2's ImageNet planes
    (3, 6, 14, 14, 6, 3, 2, 1, 6),  # 14×14 at stride 2 (v45)
]


@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=["x".join(map(str, s)) for s in PLANE_SHAPES])
@pytest.mark.usefixtures("without_registers")
def test_depthwise_plane_by_plane_matches_reference_and_gives_the_same_bits_at_any_thread_count(shape):
    """v21: forward and backward-data on planes of ≥ 16×16 (≥ 32×32 at stride 2) run plane by plane
    with the channel's weights in registers: the reference's results, the study's v20 (chunk runs
    with position weights) agrees, and the same bits at 1, 2 and 3 threads."""
    from numba import get_num_threads, set_num_threads

    from kernels.cpu import conv_depthwise

    x, w, b, dout, args = _case(shape, seed=11)
    stride, pad, groups = args
    assert cpu.path(x.shape, w.shape, stride, pad, groups, "forward") == "depthwise-planes"
    assert cpu.path(x.shape, w.shape, stride, pad, groups, "data") == "depthwise-planes"
    assert conv_depthwise.plane_by_plane(x.shape, stride)
    want_out, want_dx = np.empty_like(dout), np.empty_like(x)
    ref.conv2d_forward(x, w, None, want_out, *args)
    ref.conv2d_backward_data(dout, w, want_dx, *args)
    saved, results = get_num_threads(), []
    try:
        for threads in sorted({1, 2, 3, saved} & set(range(1, saved + 1))):
            set_num_threads(threads)
            out, dx = np.full(dout.shape, np.nan, np.float32), np.full(x.shape, np.nan, np.float32)
            cpu.conv2d_forward(x, w, None, out, *args, _scratch(cpu.conv2d_forward_workspace_size, x, w, args))
            cpu.conv2d_backward_data(dout, w, dx, *args, _scratch(cpu.conv2d_backward_data_workspace_size, x, w, args))
            results.append((out, dx))
        olds = []
        for direction, shape_ in (("forward", dout.shape), ("data", x.shape)):
            got = np.full(shape_, np.nan, np.float32)
            size = conv_study.conv2d_version_workspace_size(20, direction, x.shape, w.shape, *args)
            if direction == "forward":
                conv_study.conv2d_version(20, direction)(x, w, None, got, *args, np.full(size, np.nan, np.float32))
            else:
                conv_study.conv2d_version(20, direction)(dout, w, got, *args, np.full(size, np.nan, np.float32))
            olds.append(got)
    finally:
        set_num_threads(saved)
    for got, old, want in zip(results[0], olds, (want_out, want_dx)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(old, want, rtol=1e-4, atol=1e-4)
    for other in results[1:]:
        for a, b_ in zip(results[0], other):
            assert a.tobytes() == b_.tobytes()


REGISTER_SHAPES = [  # (n, c, h, w, k, r, stride, pad, groups): every geometry of conv_depthwise_regs
    (5, 7, 4, 4, 7, 3, 1, 1, 7),
    (3, 6, 8, 8, 6, 3, 1, 1, 6),
    (4, 5, 8, 8, 5, 3, 2, 1, 5),
    (3, 4, 16, 16, 4, 3, 1, 1, 4),
    (2, 5, 16, 16, 5, 3, 2, 1, 5),
    (2, 4, 32, 32, 4, 3, 1, 1, 4),
    (3, 4, 32, 32, 4, 3, 2, 1, 4),
]


@pytest.mark.parametrize("shape", REGISTER_SHAPES, ids=["x".join(map(str, s)) for s in REGISTER_SHAPES])
def test_depthwise_in_registers_matches_reference_and_gives_the_same_bits_at_any_thread_count(shape):
    """v25: 4×4 to 32×32 planes, stride 1 and 2, with whole planes in vector registers (no
    scratch): the reference's results in every direction, and the same bits at 1, 2 and 3 threads (3
    where Numba's pool has them). v23 (the chunk runs, groups and planes) still runs these shapes."""

    x, w, b, dout, args = _case(shape, seed=11)
    stride, pad, groups = args
    for direction in ("forward", "data", "weight"):
        assert cpu.path(x.shape, w.shape, stride, pad, groups, direction) == "depthwise-registers"
        assert cpu.workspace_size(x.shape, w.shape, stride, pad, groups, direction) == 0
        v23 = conv_study._paths(23)
        assert cpu.path(x.shape, w.shape, stride, pad, groups, direction, v23) != "depthwise-registers"
    expected = _reference(x, w, b, dout, args)
    results = _run_cpu_at_thread_counts(x, w, b, dout, args, (1, 2, 3))
    for got, want in zip(results[0], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for other in results[1:]:
        for a, b_ in zip(results[0], other):
            assert a.tobytes() == b_.tobytes()


@pytest.mark.parametrize("shape", REGISTER_SHAPES, ids=["x".join(map(str, s)) for s in REGISTER_SHAPES])
def test_depthwise_in_registers_keeps_a_nan_in_its_own_channel(shape):
    """A tap off the plane is a zero lane of a shuffle, never the neighbour plane's pixel: an inf or NaN
    in one channel reaches that channel's outputs and dW only, in every direction."""
    x, w, b, dout, args = _case(shape, seed=2)
    x[:, 1] = np.inf
    x[1, 3, 0, 0] = np.nan
    dout[:, 1] = np.inf
    dout[1, 3, -1, -1] = np.nan
    out, dx, dw, _ = _run_cpu(x, w, b, dout, args)
    expected = [np.empty_like(a) for a in (out, dx, dw)]
    ref.conv2d_forward(x, w, b, expected[0], *args)
    ref.conv2d_backward_data(dout, w, expected[1], *args)
    ref.conv2d_backward_weight(x, dout, expected[2], None, *args)
    finite = [c for c in range(x.shape[1]) if c not in (1, 3)]
    for got, want, kept in zip((out, dx, dw), expected, (np.s_[:, finite], np.s_[:, finite], np.s_[finite])):
        assert np.isfinite(got[kept]).all()
        np.testing.assert_allclose(got[kept], want[kept], rtol=1e-4, atol=1e-4)
    assert not np.isfinite(out[:, 1]).all() and not np.isfinite(dx[:, 1]).all() and not np.isfinite(dw[1]).all()


S2_WINOGRAD_SHAPES = [  # (n, c, h, w, k): stride 2, pad 1, 3×3; sides multiples of 4
    (2, 8, 8, 8, 16),  # a 2×2 tile grid, the padding row and column in every tile of the first row / column
    (3, 5, 12, 16, 7),  # planes that are not square, odd channel counts, blocks across images
    (2, 64, 32, 32, 128),  # ResNet-18's 64→128 downsampling shape (two images)
    (5, 16, 16, 16, 8),  # blocks of 1 to 5 images, a last block shorter than the others
    (10, 16, 8, 8, 24),  # 8x8: threads split by output channel, blocks of 8 images and a last of 2
]


@pytest.mark.parametrize("shape", S2_WINOGRAD_SHAPES, ids=["x".join(map(str, s)) for s in S2_WINOGRAD_SHAPES])
def test_winograd_s2_matches_reference_and_gives_the_same_bits_every_call(shape):
    """v28: the polyphase Winograd stride-2 forward against the NumPy reference at 1, 2 and 3 threads and
    at blocks of 1 image and of the planner's size (8x8 inputs: the threads split by output channel); the
    same bits on a second call. v29: the same with each GEMM in row blocks (a limit of 3000 multiply-adds
    cuts every shape here into several, the last one shorter)."""
    from kernels.cpu import conv_winograd_s2 as s2

    n, c, h, wd, k = shape
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    assert s2.supported(x.shape, w.shape, 2, 1, 1)
    want = np.empty((n, k, h // 2, wd // 2), np.float32)
    ref.conv2d_forward(x, w, None, want, 2, 1, 1)
    scale = np.abs(want).max()
    for threads, limit in ((1, 0), (2, 0), (3, 0), (1, 3000), (2, 3000), (3, 3000)):
        for images in sorted({1, s2.block_images(x.shape, c, k, threads)}):
            size = s2._filter_size(c, k) + threads * s2._per_thread(c, k, h, wd, images)
            got = [np.full(want.shape, np.nan, np.float32) for _ in range(2)]
            for out in got:
                s2.forward(x, w, out, threads, images, np.full(size, np.nan, np.float32), limit)
            np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-6 * scale)
            assert np.array_equal(got[0], got[1])


def test_winograd_s2_is_taken_from_v28_on_8x8_and_larger_inputs():
    """The polyphase stride-2 forward is the table's path (v28) on inputs of >= 8x8 with OpenBLAS, not v26's,
    and never backward or below 8x8 (``conv.WINOGRAD_S2_MIN_PIXELS``)."""
    big = ((32, 64, 32, 32), (128, 64, 3, 3), 2, 1, 1)
    on = "winograd-s2" if blas.select_sgemm() == blas.OPENBLAS else "gemm"
    assert cpu.path(*big, "forward") == cpu.path(*big, "forward", conv_study._paths(28)) == on
    assert conv_study._paths(29).winograd_s2_small_gemms and not conv_study._paths(28).winograd_s2_small_gemms
    assert cpu.path(*big, "forward", conv_study._paths(26)) == "gemm"
    # v32 took backward-data and the >= 16x16 weight gradients (test_winograd_s2_backward_is_taken_from_v32)
    assert cpu.path(*big, "data", conv_study._paths(30)) == cpu.path(*big, "weight", conv_study._paths(30)) == "gemm"
    assert cpu.path((32, 128, 16, 16), (256, 128, 3, 3), 2, 1, 1, "forward") == on
    assert cpu.path((32, 256, 8, 8), (512, 256, 3, 3), 2, 1, 1, "forward") == on
    assert cpu.conv_winograd_s2.by_channel((32, 256, 8, 8)) and not cpu.conv_winograd_s2.by_channel((32, 128, 16, 16))
    assert cpu.path((32, 512, 4, 4), (512, 512, 3, 3), 2, 1, 1, "forward") == "gemm"
    assert not cpu.conv_winograd_s2.supported((2, 64, 30, 30), (128, 64, 3, 3), 2, 1, 1)
    if blas.select_sgemm() == blas.OPENBLAS:  # through conv.forward: workspace, BLAS on the calling thread
        x, w, _, dout, args = _case((2, 64, 32, 32, 128, 3, 2, 1, 1), seed=2)
        want, got = np.empty(dout.shape, np.float32), np.full(dout.shape, np.nan, np.float32)
        ref.conv2d_forward(x, w, None, want, *args)
        size = cpu.workspace_size(x.shape, w.shape, *args, "forward")
        cpu.forward(x, w, None, got, *args, np.full(size, np.nan, np.float32))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


S2_BACKWARD_SHAPES = S2_WINOGRAD_SHAPES + [
    (3, 5, 16, 12, 9),  # taller than wide, odd channel counts
    (7, 3, 4, 8, 5),  # one tile row per image, three channels in
]


@pytest.mark.parametrize("shape", S2_BACKWARD_SHAPES, ids=["x".join(map(str, s)) for s in S2_BACKWARD_SHAPES])
def test_winograd_s2_backward_matches_reference_and_gives_the_same_bits_every_call(shape, monkeypatch):
    """v32: the polyphase stride-2 backward-data and weight gradient against the NumPy reference at 1, 2 and 3
    threads, in blocks of 1 image and of the planner's size, with and without the small-GEMM cuts (a limit of
    3000 multiply-adds cuts every shape here into several blocks); the weight gradient both split by images
    (partial dU per extra thread) and by output channel. The same bits on a second call."""
    from kernels.cpu import conv_winograd_s2 as s2

    n, c, h, wd, k = shape
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    dout = rng.standard_normal((n, k, h // 2, wd // 2), dtype=np.float32)
    want_dx, want_dw = np.empty_like(x), np.empty_like(w)
    ref.conv2d_backward_data(dout, w, want_dx, 2, 1, 1)
    ref.conv2d_backward_weight(x, dout, want_dw, None, 2, 1, 1)
    for threads, limit in ((1, 0), (2, 0), (3, 0), (1, 3000), (2, 3000), (3, 3000)):
        for images in sorted({1, s2.data_block_images(x.shape, w.shape, threads)}):
            size = s2._filter_size(c, k) + threads * s2._per_thread(k, c, h, wd, images)
            got = [np.full(x.shape, np.nan, np.float32) for _ in range(2)]
            for dx in got:
                s2.backward_data(dout, w, dx, threads, images, np.full(size, np.nan, np.float32), limit)
            np.testing.assert_allclose(got[0], want_dx, rtol=0, atol=2e-6 * np.abs(want_dx).max())
            assert np.array_equal(got[0], got[1])
        for by_images in (True, False):
            monkeypatch.setattr(s2, "WEIGHT_BY_IMAGES_MAX", 1 << 40 if by_images else 0)
            assert s2.weight_by_images(w.shape) == by_images
            for images in sorted({1, s2.weight_block_images(x.shape, w.shape, threads)}):
                k_share = k if by_images else -(-k // threads)
                size = (threads if by_images else 1) * s2._filter_size(c, k)
                size += threads * s2._per_thread(c, k_share, h, wd, images)
                got = [np.full(w.shape, np.nan, np.float32) for _ in range(2)]
                for dw in got:
                    s2.backward_weight(x, dout, dw, threads, images, np.full(size, np.nan, np.float32), limit)
                np.testing.assert_allclose(got[0], want_dw, rtol=0, atol=4e-6 * np.abs(want_dw).max())
                assert np.array_equal(got[0], got[1])


def test_winograd_s2_backward_is_taken_from_v32():
    """v32: backward-data of v28's stride-2 layers and the weight gradient on >= 16x16 inputs take the polyphase
    transform with OpenBLAS (not before v32); 256->512 @8x8's weight gradient stayed on im2col until v37. Through
    the table's entries (scratch from the planner, BLAS on the calling thread) against the reference."""
    on = "winograd-s2" if blas.select_sgemm() == blas.OPENBLAS else "gemm"
    for x_shape, w_shape in (((32, 64, 32, 32), (128, 64, 3, 3)), ((32, 128, 16, 16), (256, 128, 3, 3))):
        assert cpu.path(x_shape, w_shape, 2, 1, 1, "data") == cpu.path(x_shape, w_shape, 2, 1, 1, "weight") == on
        for direction in ("data", "weight"):
            assert cpu.path(x_shape, w_shape, 2, 1, 1, direction, conv_study._paths(30)) == "gemm"
    assert cpu.path((32, 256, 8, 8), (512, 256, 3, 3), 2, 1, 1, "data") == on
    assert cpu.path((32, 256, 8, 8), (512, 256, 3, 3), 2, 1, 1, "weight", conv_study._paths(36)) == "gemm"
    assert cpu.path((32, 256, 8, 8), (512, 256, 3, 3), 2, 1, 1, "weight") == on  # v37
    assert cpu.path((32, 64, 32, 32), (128, 64, 3, 3), 2, 1, 1, "weight", conv_study._paths(32)) == on
    for shape in ((3, 64, 16, 20, 72, 3, 2, 1, 1), (5, 64, 8, 8, 72, 3, 2, 1, 1)):  # v32; v37's 8×8 weight gradient
        if blas.select_sgemm() != blas.OPENBLAS:
            break
        x, w, b, dout, args = _case(shape, seed=3)
        want_dx, want_dw, want_db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        ref.conv2d_backward_weight(x, dout, want_dw, want_db, *args)
        assert cpu.path(x.shape, w.shape, *args, "data") == cpu.path(x.shape, w.shape, *args, "weight") == on
        for _ in range(2):
            _, dx, dw, db = _run_cpu(x, w, b, dout, args)
            np.testing.assert_allclose(dx, want_dx, rtol=0, atol=2e-6 * np.abs(want_dx).max())
            np.testing.assert_allclose(dw, want_dw, rtol=0, atol=4e-6 * np.abs(want_dw).max())
            np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [64, 40])
def test_stem_weight_gradient_in_32_channel_gemms_matches_reference_at_any_thread_count(k):
    """v26: the 3-channel stem's in-place im2col weight gradient in GEMMs of 32 output channels (K = 40: 32 +
    8), against the reference at 1, 2 and 3 threads, the same bits on a second call, and v23's one GEMM."""
    from numba import get_num_threads, set_num_threads

    x, w, b, dout, args = _case((5, 3, 16, 16, k, 3, 1, 1, 1), seed=3)
    assert cpu.stem_weight_k_block(x.shape, w.shape, *args) == 32
    assert cpu.stem_weight_k_block(x.shape, (32, 3, 3, 3), *args) == 0  # one GEMM is already 32 rows
    assert cpu.stem_weight_k_block((5, 8, 16, 16), (64, 8, 3, 3), *args) == 0  # 72 columns: not narrow
    want = np.empty_like(w)
    ref.conv2d_backward_weight(x, dout, want, None, *args)
    saved = get_num_threads()
    try:
        for count in sorted({1, 2, 3} & set(range(1, saved + 1)) | {1}):
            set_num_threads(count)
            got = []
            for paths in (conv_study._paths(35), conv_study._paths(35), conv_study._paths(23)):  # v36: conv_stem
                dw = np.full(w.shape, np.nan, np.float32)
                size = cpu.workspace_size(x.shape, w.shape, *args, "weight", paths)
                cpu.backward_weight(x, dout, dw, None, *args, np.full(size, np.nan, np.float32), paths)
                np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-4)
                got.append(dw)
            assert np.array_equal(got[0], got[1])
    finally:
        set_num_threads(saved)


POINTWISE_SHAPES = [  # (n, c, h, w, k): 1×1 stride 1, groups 1 (v27)
    (5, 40, 16, 16, 12),  # C ≥ K: the weight gradient split over input channels
    (4, 12, 16, 16, 40),  # K > C: split over output channels
    (3, 24, 8, 8, 10),  # 8×8: the weight gradient on v31's path (v16–v30: images split)
    (3, 30, 4, 4, 9),  # 4×4 (v8–v26: stacked tiles; the weight gradient: v31's path)
    (6, 96, 16, 16, 24),  # ≥ 16×16: the weight gradient in ≤ 32-row, ≤ 1200-element dW blocks
    (2, 40, 16, 16, 100),  # ≥ 16×16, K > C: several 32-row blocks per thread, a short last one
    (3, 8, 5, 7, 200),  # odd plane below 8×8
]


@pytest.mark.parametrize("shape", POINTWISE_SHAPES, ids=["x".join(map(str, s)) for s in POINTWISE_SHAPES])
@pytest.mark.parametrize("limit", [None, 20_000])
def test_pointwise_row_blocks_and_weight_split_match_reference_at_one_two_and_three_threads(shape, limit, monkeypatch):
    """v27: a 1×1 stride-1 conv's forward and backward-data as one sgemm per block of output rows per image
    (``conv_pointwise.images``), its weight gradient with each thread owning a block of dW
    (``conv_pointwise.backward_weight``): the reference's results at 1, 2 and 3 threads, with the table's
    limit and with one small enough to cut every GEMM into several blocks; forward and backward-data the
    same bits at every thread count (the row blocks do not depend on it), the weight gradient the same
    bits on a second call at each."""
    from kernels.cpu import conv_pointwise

    if limit is not None:
        monkeypatch.setattr(conv_pointwise, "SMALL_GEMM_MNK", limit)
    n, c, h, wd, k = shape
    x, w, b, dout, args = _case((n, c, h, wd, k, 1, 1, 0, 1), seed=7)
    split = not conv_pointwise.takes_transposed(x.shape)  # below 16×16: v31's path
    assert [cpu.path(x.shape, w.shape, *args, d) for d in ("forward", "data", "weight")] == [
        "pointwise", "pointwise", "pointwise-weight-split" if split else "pointwise-weight-transposed"
    ]
    assert cpu.path(x.shape, w.shape, *args, "weight", conv_study._paths(30)) == (
        "pointwise-weight-split" if h * wd >= conv_pointwise.WEIGHT_SPLIT_MIN_PIXELS else "gemm"
    )
    assert [cpu.path(x.shape, w.shape, *args, d, conv_study._paths(26)) for d in ("forward", "data", "weight")] == [
        "gemm", "gemm", "gemm"
    ]
    assert cpu.workspace_size(x.shape, w.shape, *args, "forward") == cpu.workspace_size(x.shape, w.shape, *args, "data")
    assert cpu.workspace_size(x.shape, w.shape, *args, "forward") == 0
    assert (cpu.workspace_size(x.shape, w.shape, *args, "weight") == 0) == split
    expected = _reference(x, w, b, dout, args)
    first = _run_cpu_at_thread_counts(x, w, b, dout, args, (1, 2, 3))
    second = _run_cpu_at_thread_counts(x, w, b, dout, args, (1, 2, 3))
    for results, again in zip(first, second):
        for got, want in zip(results, expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        for a, b_ in zip(results, again):
            assert a.tobytes() == b_.tobytes()
    for other in first[1:]:
        assert other[0].tobytes() == first[0][0].tobytes()
        assert other[1].tobytes() == first[0][1].tobytes()


TRANSPOSED_SHAPES = [  # (n, c, h, w, k): 1×1 stride 1 on planes under 16×16 (v31)
    (5, 24, 8, 8, 10),  # 8×8, C ≥ K: split over input channels, dout transposed, dWᵀ written back
    (4, 10, 8, 8, 24),  # 8×8, K > C: split over output channels, x transposed, straight into dw
    (3, 17, 8, 8, 17),  # C = K, odd
    (11, 30, 4, 4, 9),  # 4×4: 8 images per GEMM (gathered), a short last group
    (9, 7, 4, 4, 33),  # 4×4, K > C
    (3, 13, 3, 5, 6),  # odd plane of 15 pixels: 3 images per group, fewer images than a full group
    (4, 2, 5, 7, 1),  # the larger side narrower than the thread count: fewer shares than threads
    (1, 19, 1, 1, 21),  # one pixel, one image
    (3, 12, 16, 16, 40),  # 16×16 (the table keeps v27's split there), one image per GEMM
]


@pytest.mark.parametrize("shape", TRANSPOSED_SHAPES, ids=["x".join(map(str, s)) for s in TRANSPOSED_SHAPES])
@pytest.mark.parametrize("limit", [None, 600])
def test_pointwise_weight_transposed_matches_reference_at_one_two_and_three_threads(shape, limit):
    """v31: the 1×1 stride-1 weight gradient on planes under 16×16 as NN GEMMs over the smaller side transposed
    (``conv_pointwise.backward_weight_transposed``), each thread owning a range of dW's larger side: the NumPy
    reference's dW at 1, 2 and 3 threads (called directly, so the thread count is the shares', whatever Numba's
    pool holds), with the table's limit and one that cuts every GEMM into several row blocks; scratch from the
    planning function, filled with NaN (a read of unwritten scratch shows); the same bits on a second call."""
    from kernels.cpu import conv_pointwise

    n, c, h, wd, k = shape
    x, w, b, dout, args = _case((n, c, h, wd, k, 1, 1, 0, 1), seed=11)
    want = np.empty(w.shape, np.float32)
    ref.conv2d_backward_weight(x, dout, want, None, *args)
    for threads in (1, 2, 3):
        size = conv_pointwise.transposed_workspace_size(x.shape, w.shape, threads)
        got = []
        for _ in range(2):
            dw = np.full(w.shape, np.nan, np.float32)
            with cpu.blas_on_calling_thread:
                conv_pointwise.backward_weight_transposed(x, dout, dw, threads, np.full(size, np.nan, np.float32),
                                                          limit)  # fmt: skip
            np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-4)
            got.append(dw)
        assert got[0].tobytes() == got[1].tobytes()


def test_pointwise_weight_transposed_is_the_table_path_below_16x16_with_its_scratch():
    """v31 takes the plain 1×1 weight gradient on planes under 16×16 (v30: im2col tiles or v16's per-image GEMMs),
    its scratch from ``transposed_workspace_size``; ≥ 16×16 stays on v27's split, stride 2 on im2col."""
    from kernels.cpu import conv_pointwise

    threads = cpu.get_num_threads()
    for x_shape, w_shape in (((32, 192, 8, 8), (64, 192, 1, 1)), ((32, 160, 4, 4), (960, 160, 1, 1))):
        assert cpu.path(x_shape, w_shape, 1, 0, 1, "weight") == "pointwise-weight-transposed"
        assert cpu.workspace_size(x_shape, w_shape, 1, 0, 1, "weight") == conv_pointwise.transposed_workspace_size(
            x_shape, w_shape, threads
        )
        assert cpu.path(x_shape, w_shape, 1, 0, 1, "weight", conv_study._paths(30)) == "gemm"
    assert conv_pointwise.transposed_group((32, 192, 8, 8)) == 1
    assert conv_pointwise.transposed_group((32, 160, 4, 4)) == 8
    assert conv_pointwise.transposed_group((3, 160, 4, 4)) == 3
    assert cpu.path((32, 144, 16, 16), (32, 144, 1, 1), 1, 0, 1, "weight") == "pointwise-weight-split"
    assert cpu.path((32, 32, 16, 16), (192, 32, 1, 1), 1, 0, 1, "weight") == "pointwise-weight-split"
    assert cpu.path((32, 16, 32, 32), (96, 16, 1, 1), 1, 0, 1, "weight") == "pointwise-weight-split"
    # stride 2 is not v31's: im2col until v32, its kept pixels since v33
    assert cpu.path((32, 64, 8, 8), (128, 64, 1, 1), 2, 0, 1, "weight", conv_study._paths(32)) == "gemm"
    assert conv_study._paths(31).pointwise_weight_transposed and not conv_study._paths(30).pointwise_weight_transposed


@pytest.mark.parametrize(
    "rows, depth, pixels, limit",
    [(32, 144, 256, 10**6), (96, 384, 64, 10**6), (1280, 320, 16, 10**6), (7, 1000, 1000, 10**6), (10, 5, 4, 60)],
)
def test_pointwise_row_block_keeps_each_gemm_under_the_limit_in_as_few_blocks_as_it_needs(rows, depth, pixels, limit):
    from kernels.cpu import conv_pointwise

    block = conv_pointwise.row_block(rows, depth, pixels, limit)
    most = max(1, limit // (depth * pixels))
    assert 1 <= block <= min(rows, most)
    assert -(-rows // block) == -(-rows // most)  # as few GEMMs as the limit allows, the rows spread over them


@pytest.mark.parametrize("k, c, threads", [(32, 144, 2), (384, 64, 2), (5, 3, 3), (2, 1, 3), (7, 7, 1)])
def test_pointwise_weight_split_blocks_cover_dw_once(k, c, threads):
    from kernels.cpu import conv_pointwise

    covered = np.zeros((k, c), np.int64)
    blocks = conv_pointwise.split_blocks(k, c, threads)
    assert 1 <= len(blocks) <= threads
    for k0, k1, c0, c1 in blocks:
        covered[k0:k1, c0:c1] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("shape", [(3, 24, 16, 16, 40), (5, 16, 8, 12, 8)], ids=["3x24x16x16x40", "5x16x8x12x8"])
def test_winograd4_in_small_gemm_blocks_matches_reference_and_gives_the_same_bits_every_call(shape):
    """v30: F(4×4)'s 36 GEMMs in row blocks of ≤ ``limit`` multiply-adds (3000 cuts these into several, the
    last shorter), forward and flipped (backward-data), against the NumPy reference at 1, 2 and 3 threads;
    the same bits on a second call (the forward's are also the same at every thread count here; the
    flipped one's differ between 1 and 2 threads with or without blocks, as before v30)."""
    n, c, h, wd, k = shape
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    dout = rng.standard_normal((n, k, h, wd), dtype=np.float32)
    want_out, want_dx = np.empty((n, k, h, wd), np.float32), np.empty(x.shape, np.float32)
    ref.conv2d_forward(x, w, None, want_out, 1, 1, 1)
    ref.conv2d_backward_data(dout, w, want_dx, 1, 1, 1)
    for src, want, flipped in ((x, want_out, False), (dout, want_dx, True)):
        c_in, c_out = src.shape[1], want.shape[1]
        for threads in (1, 2, 3):
            rows = winograd4.block_rows(src.shape, c_in, c_out, threads)
            size = 36 * (c_in * c_out + winograd4.SKEW) + threads * winograd4._per_thread(c_in, c_out, wd, rows)
            got = [np.full(want.shape, np.nan, np.float32) for _ in range(2)]
            for out in got:
                winograd4.forward(src, w, out, flipped, threads, rows, np.full(size, np.nan, np.float32), 3000)
            np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=max(1e-4, 2e-5 * float(np.abs(want).max())))
            assert np.array_equal(got[0], got[1])
    assert conv_study._paths(30).winograd4_small_gemms and not conv_study._paths(29).winograd4_small_gemms


@pytest.mark.parametrize("flipped", [False, True])
def test_vectorized_filter_rows_give_the_transforms_bits(flipped):
    """``_filter_rows`` (v34) is ``_filter_transform``'s arithmetic as loops over the reduction channel:
    the same bits, written at a block's offsets."""
    w = np.random.default_rng(3).standard_normal((24, 40, 3, 3), dtype=np.float32)
    outer, inner = (40, 24) if flipped else (24, 40)
    plane = 24 * 40 + winograd4.SKEW
    want = np.full(36 * plane, np.nan, np.float32)
    winograd4._filter_transform(w, 0, outer, want, flipped)
    lo, hi = 5, 17  # a block: rows lo..hi at the block's own plane stride
    block_plane = (hi - lo) * inner + 3
    got = np.full(36 * block_plane, np.nan, np.float32)
    winograd4._filter_rows(w, lo, hi, got, block_plane, flipped, np.full(27 * inner, np.nan, np.float32))
    for xi in range(36):
        np.testing.assert_array_equal(got[xi * block_plane : xi * block_plane + (hi - lo) * inner],
                                      want[xi * plane + lo * inner : xi * plane + hi * inner])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("block", "budget"), [(16, winograd4.BY_K_V_BUDGET), (5, 3000)])
def test_winograd4_by_k_matches_reference_and_its_bits_do_not_depend_on_threads(threads, block, budget, monkeypatch):
    """F(4×4) by output channel (v34): odd and non-square planes (partial tiles), blocks that do not
    divide the channels, several image groups (a small V budget); forward and backward-data; each
    output is one GEMM column and one thread's transform, so every thread count gives one thread's bits."""
    monkeypatch.setattr(winograd4, "BY_K_V_BUDGET", budget)
    for n, c, h, wd, k in ((3, 12, 4, 4, 7), (5, 9, 5, 7, 11), (2, 8, 8, 8, 16)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        want_out, want_dx = np.empty((n, k, h, wd), np.float32), np.empty_like(x)
        ref.conv2d_forward(x, w, None, want_out, *args)
        ref.conv2d_backward_data(dout, w, want_dx, *args)
        for direction, src, want in (("forward", x, want_out), ("data", dout, want_dx)):
            bits = []
            for count in (1, threads):
                size = winograd4.by_k_workspace_size(x.shape, w.shape, direction, count, block)
                got = np.full(want.shape, np.nan, np.float32)
                with cpu.blas_on_calling_thread:
                    winograd4.forward_by_k(src, w, got, direction == "data", count, np.full(size, np.nan, np.float32),
                                           block)
                bits.append(got)
            np.testing.assert_allclose(bits[1], want, rtol=1e-5, atol=2e-4)
            np.testing.assert_array_equal(bits[0], bits[1])


def test_winograd4_by_k_is_reached_by_the_tested_shapes():
    # the reference, determinism, torch and numbered-version tests reach forward_by_k through this shape
    n, c, h, wd, k, r, stride, pad, groups = SHAPES[-1]
    shapes = ((n, c, h, wd), (k, c, r, r), stride, pad, groups)
    # (the forward through ENGINE_CONV=fast's paths since v38: test_the_fast_forward_matches_reference)
    expected = "winograd4-by-k" if blas.select_sgemm() == blas.OPENBLAS else "winograd-by-xi"
    assert cpu.path(*shapes, "forward", cpu.paths_for("fast")) == cpu.path(*shapes, "data") == expected
    expected = "winograd4-weight-by-k" if blas.select_sgemm() == blas.OPENBLAS else "winograd"
    assert cpu.path(*shapes, "weight") == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block", [16, 5])
def test_winograd4_weight_by_k_matches_reference_and_its_bits_do_not_depend_on_threads(threads, block):
    """The F(4×4) weight gradient by output channel (v35): odd, non-square planes, blocks that do not
    divide the output channels; each dw element is one GEMM's sums over all tiles and one thread's
    transform, so every thread count gives one thread's bits."""
    for n, c, h, wd, k in ((3, 12, 4, 4, 7), (5, 9, 5, 7, 11), (2, 8, 8, 8, 16), (4, 20, 3, 5, 33)):
        x, w, _, dout, args = _case((n, c, h, wd, k, 3, 1, 1, 1))
        want = np.empty_like(w)
        ref.conv2d_backward_weight(x, dout, want, None, *args)
        bits = []
        for count in (1, threads):
            size = winograd4.by_k_weight_workspace_size(x.shape, w.shape, count, block)
            got = np.full(w.shape, np.nan, np.float32)
            with cpu.blas_on_calling_thread:
                winograd4.backward_weight_by_k(x, dout, got, count, np.full(size, np.nan, np.float32), block)
            bits.append(got)
        np.testing.assert_allclose(bits[1], want, rtol=1e-4, atol=2e-5 * float(np.abs(want).max()))
        np.testing.assert_array_equal(bits[0], bits[1])


def test_winograd4_weight_by_k_needs_the_batch_to_fit():
    # batch 128 at 512 @4x4 fits the 24 MiB of V and M; batch 256 keeps F(2x2)
    w_shape = (512, 512, 3, 3)
    assert winograd4.by_k_weight_fits((128, 512, 4, 4), w_shape)
    assert not winograd4.by_k_weight_fits((256, 512, 4, 4), w_shape)
    if blas.select_sgemm() == blas.OPENBLAS:
        assert cpu.path((128, 512, 4, 4), w_shape, 1, 1, 1, "weight") == "winograd4-weight-by-k"
        assert cpu.path((256, 512, 4, 4), w_shape, 1, 1, 1, "weight") == "winograd"


STRIDED_SHAPES = [  # (n, c, h, w, k): 1×1 stride 2, pad 0, groups 1 (v33)
    (3, 8, 7, 9, 12),  # odd, not square: the last row and column kept, a 4×5 output
    (5, 16, 8, 8, 32),  # even square plane
    (7, 40, 9, 4, 24),  # C > K, a 5×2 output
    (2, 6, 5, 5, 4),  # fewer images than threads at 3: a share with no image
    (4, 3, 1, 3, 5),  # one row: a 1×2 output
    (19, 8, 5, 6, 12),  # with small tiles, chunks of 4–5 images in gathers of 3: partial last gathers
]


def _strided_parts(x, w, dout, threads):
    """v33's forward, backward-data and weight gradient on ``threads`` threads (the drivers conv.py calls,
    so 3 threads run where Numba's pool has 2), each with NaN-filled scratch of the planned size."""
    from kernels.cpu import conv_pointwise

    out = np.full(dout.shape, np.nan, np.float32)
    dx, dw = np.full(x.shape, np.nan, np.float32), np.full(w.shape, np.nan, np.float32)
    scratch = {
        d: np.full(conv_pointwise.strided_workspace_size(x.shape, w.shape, 2, d, threads), np.nan, np.float32)
        for d in ("forward", "data", "weight")
    }
    with cpu.blas_on_calling_thread:
        conv_pointwise.run_images(x, w, out, False, threads, stride=2, scratch=scratch["forward"])
        conv_pointwise.run_images(dout, w, dx, True, threads, stride=2, scratch=scratch["data"])
        cpu.pointwise_strided_backward_weight(x, dout, dw, 2, threads, scratch["weight"])
    return out, dx, dw


@pytest.mark.parametrize("shape", STRIDED_SHAPES, ids=["x".join(map(str, s)) for s in STRIDED_SHAPES])
@pytest.mark.parametrize("small", [False, True])
def test_pointwise_strided_matches_reference_at_one_two_and_three_threads(shape, small, monkeypatch):
    """v33: a 1×1 stride-2 conv on its kept pixels (``conv_pointwise.images`` with a stride, ``strided_weight``)
    against the NumPy reference at 1, 2 and 3 threads, with the table's tile sizes and with ``small`` ones
    (gathers of three images, a partial last one, GEMMs of a few rows, weight blocks of three images):
    forward and backward-data the same bits at every thread count, the weight gradient on a second call at
    each; dx's skipped pixels exactly zero."""
    from kernels.cpu import conv_pointwise

    n, c, h, wd, k = shape
    x, w, b, dout, args = _case((n, c, h, wd, k, 1, 2, 0, 1), seed=11)
    assert dout.shape[2:] == ((h + 1) // 2, (wd + 1) // 2)
    if small:
        pixels = dout.shape[2] * dout.shape[3]
        monkeypatch.setattr(conv_pointwise, "STRIDED_TILE_ELEMENTS", 3 * c * pixels)
        monkeypatch.setattr(conv_pointwise, "SMALL_GEMM_MNK", 3 * c * pixels)
        monkeypatch.setattr(conv_pointwise, "STRIDED_WEIGHT_MIN_DEPTH", 3 * pixels)
    assert [cpu.path(x.shape, w.shape, *args, d) for d in ("forward", "data", "weight")] == ["pointwise-strided"] * 3
    assert {cpu.path(x.shape, w.shape, *args, d, conv_study._paths(30)) for d in ("forward", "data", "weight")} == {
        "gemm"
    }
    expected = _reference(x, w, np.zeros_like(b), dout, args)[:3]  # the drivers add no bias
    first = [_strided_parts(x, w, dout, t) for t in (1, 2, 3)]
    second = [_strided_parts(x, w, dout, t) for t in (1, 2, 3)]
    for results, again in zip(first, second):
        for got, want in zip(results, expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        skipped = np.ones(x.shape, bool)
        skipped[:, :, ::2, ::2] = False
        assert (results[1][skipped] == 0).all()
        for a, b_ in zip(results, again):
            assert a.tobytes() == b_.tobytes()
    for other in first[1:]:
        assert other[0].tobytes() == first[0][0].tobytes()
        assert other[1].tobytes() == first[0][1].tobytes()


def test_pointwise_strided_through_the_table_gives_the_same_bits_every_call():
    """The table's entries on the path (scratch sized by its planning function): the reference's results and the
    same bits on a second call at Numba's thread count."""
    x, w, b, dout, args = _case((6, 24, 11, 10, 40, 1, 2, 0, 1), seed=2)
    first, second = _run_cpu(x, w, b, dout, args), _run_cpu(x, w, b, dout, args)
    for got, again, want in zip(first, second, _reference(x, w, b, dout, args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert got.tobytes() == again.tobytes()


@pytest.mark.parametrize("direction", ["forward", "data", "weight"])
def test_pointwise_strided_scratch_is_what_the_drivers_use(direction):
    """The planned scratch of each direction (``conv.workspace_size`` → ``strided_workspace_size``) on the three
    ResNet-18 shortcuts: the forward's gather tiles, backward-data's GEMM results of as many images, the weight
    gradient's tiles plus a K × C partial per extra thread."""
    from numba import get_num_threads

    from kernels.cpu import conv_pointwise

    threads = get_num_threads()
    for c, k, h in ((64, 128, 32), (128, 256, 16), (256, 512, 8)):
        x_shape, w_shape, pixels = (32, c, h, h), (k, c, 1, 1), (h // 2) ** 2
        size = cpu.workspace_size(x_shape, w_shape, 2, 0, 1, direction)
        if direction in ("forward", "data"):
            assert size == threads * c * pixels * conv_pointwise.strided_tile_images(x_shape, pixels, threads)
        else:
            count = conv_pointwise.strided_weight_images(x_shape, pixels, threads)
            tiles = (c + (k if count > 1 else 0)) * pixels * count
            assert size == threads * tiles + (threads - 1) * k * c


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True)])
def test_the_gemm_helper_matches_numpy_on_views_and_refuses_strided_or_mismatched_operands(trans_a, trans_b):
    """``conv_shifted.gemm`` (the dense layers' and im2col's GEMM): op(a) @ op(b) into c, each a C-contiguous view at
    an offset of a larger array as im2col passes them, within float32 rounding of float64; a strided operand is
    refused (its reshape would be a copy, and c's result lost)."""
    from kernels.cpu.conv_shifted import gemm

    rng = np.random.default_rng(5)
    m, n, k = 7, 9, 13
    a_big = rng.standard_normal((3, k if trans_a else m, m if trans_a else k), dtype=np.float32)
    b_big = rng.standard_normal((3, n if trans_b else k, k if trans_b else n), dtype=np.float32)
    c_big = np.full((3, m, n), np.nan, np.float32)
    a, b, c = a_big[1], b_big[2], c_big[1]  # contiguous views that do not start at their base
    gemm(a, b, c, trans_a=trans_a, trans_b=trans_b)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
    assert np.isnan(c_big[0]).all() and np.isnan(c_big[2]).all()  # nothing outside c written
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm(a, b, np.empty((n, m), np.float32).T, trans_a=trans_a, trans_b=trans_b)
    with pytest.raises(ValueError, match="does not make c"):  # shapes that disagree: refused, nothing written
        gemm(a, b, c_big[0][:, : n - 1].copy(), trans_a=trans_a, trans_b=trans_b)
    with pytest.raises(ValueError, match="does not make c"):
        gemm(a, b[:-1], c, trans_a=trans_a, trans_b=trans_b)  # one row short: k (or n, transposed) disagrees
