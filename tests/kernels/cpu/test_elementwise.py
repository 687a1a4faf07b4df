import numpy as np
import pytest

from kernels.cpu import elementwise
from kernels.reference import elementwise as reference

SHAPES = [(1,), (7, 3), (2, 3, 5, 5), (1, 1, 1, 1)]
LARGE = (3, 17, 64, 64)  # 208,896 values: past threads.RANGE_MIN_VALUES, so two and three threads split it


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["relu", "relu6"])
def test_activation_matches_reference(name, shape, rng):
    x = rng.uniform(-4, 10, size=shape).astype(np.float32)
    x.reshape(-1)[:2] = [0.0, 6.0][: x.size]  # the kinks: gradient 0 there, as in PyTorch
    dout = rng.standard_normal(shape).astype(np.float32)
    out, expected = np.empty_like(x), np.empty_like(x)
    getattr(elementwise, f"{name}_forward")(x, out)
    getattr(reference, f"{name}_forward")(x, expected)
    np.testing.assert_array_equal(out, expected)
    dx, expected_dx = np.empty_like(x), np.empty_like(x)
    getattr(elementwise, f"{name}_backward")(out, dout, dx)
    getattr(reference, f"{name}_backward")(expected, dout, expected_dx)
    np.testing.assert_array_equal(dx, expected_dx)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slope", [0.0, 0.01, 0.2])
def test_leaky_relu_matches_reference(shape, slope, rng):
    x = rng.uniform(-4, 4, size=shape).astype(np.float32)
    x.reshape(-1)[:1] = 0.0  # the kink: PyTorch takes the slope there
    dout = rng.standard_normal(shape).astype(np.float32)
    out, expected = np.empty_like(x), np.empty_like(x)
    elementwise.leaky_relu_forward(x, out, slope)
    reference.leaky_relu_forward(x, expected, slope)
    np.testing.assert_array_equal(out, expected)
    dx, expected_dx = np.empty_like(x), np.empty_like(x)
    elementwise.leaky_relu_backward(out, dout, dx, slope)
    reference.leaky_relu_backward(expected, dout, expected_dx, slope)
    np.testing.assert_array_equal(dx, expected_dx)
    elementwise.leaky_relu_backward(out, dout, dout, slope)  # in place over dout, as the layer runs it
    np.testing.assert_array_equal(dout, expected_dx)
    with pytest.raises(ValueError, match="negative_slope must be >= 0"):
        elementwise.leaky_relu_forward(x, out, -0.5)


def test_activations_run_in_place(rng):
    x = rng.standard_normal((4, 5)).astype(np.float32)
    expected = np.maximum(x, 0)
    elementwise.relu_forward(x, x)
    np.testing.assert_array_equal(x, expected)
    dout = rng.standard_normal((4, 5)).astype(np.float32)
    expected_dx = np.where(x > 0, dout, 0)
    elementwise.relu_backward(x, dout, dout)
    np.testing.assert_array_equal(dout, expected_dx)


@pytest.mark.parametrize("shape", SHAPES)
def test_add_and_dropout_match_reference(shape, rng):
    a, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    out, expected = np.empty_like(a), np.empty_like(a)
    elementwise.add_forward(a, b, out)
    reference.add_forward(a, b, expected)
    np.testing.assert_array_equal(out, expected)
    mask = (rng.random(shape) > 0.3).astype(np.uint8)
    elementwise.dropout_forward(a, mask, 1 / 0.7, out)
    reference.dropout_forward(a, mask, 1 / 0.7, expected)
    np.testing.assert_array_equal(out, expected)
    elementwise.dropout_backward(b, mask, 1 / 0.7, out)
    reference.dropout_backward(b, mask, 1 / 0.7, expected)
    np.testing.assert_array_equal(out, expected)


def test_wrong_arrays_are_named():
    x = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(TypeError, match="relu_forward: out must be float32"):
        elementwise.relu_forward(x, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="add_forward: b has shape"):
        elementwise.add_forward(x, np.zeros(6, np.float32), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        elementwise.relu_forward(x.T, x.T)


def _reference_sums(x):
    """(Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over the 32-bit words of x, in NumPy's uint64 (whose sums and products wrap mod
    2⁶⁴, the kernel's arithmetic written another way)."""
    words = x.reshape(-1).view(np.uint32).astype(np.uint64)
    index = np.arange(1, words.size + 1, dtype=np.uint64)
    return int(words.sum(dtype=np.uint64)), int((index * words).sum(dtype=np.uint64))


# LARGE: past threads.RANGE_MIN_VALUES, so the sums of two or three ranges are combined (``_forward_checksum``)
@pytest.mark.parametrize("shape", SHAPES + [(3, 17, 9, 9), LARGE])
@pytest.mark.parametrize("name", ["relu", "relu6"])
def test_activation_with_checksum_gives_the_same_bits_and_the_sums(name, shape, rng):
    """The offload rebuild's fused pass: the activation's exact bits, and the word sums of its input at any
    thread count (integer sums: order does not matter); one flipped byte anywhere changes the sums."""
    import numba

    x = rng.uniform(-4, 10, size=shape).astype(np.float32)
    x.reshape(-1)[-1] = np.float32(3e9)  # words above 2³¹: the sums are unsigned
    expected = np.empty_like(x)
    getattr(reference, f"{name}_forward")(x, expected)
    sums = _reference_sums(x)
    previous = numba.get_num_threads()
    try:
        for threads in range(1, previous + 1):
            numba.set_num_threads(threads)
            out = np.full_like(x, np.nan)
            assert getattr(elementwise, f"{name}_forward_checksum")(x, out) == sums
            np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    finally:
        numba.set_num_threads(previous)
    raw = x.reshape(-1).view(np.uint8)
    for position in {0, raw.size // 2, raw.size - 1}:
        for flip in (0x01, 0x80, 0xFF):
            raw[position] ^= flip
            assert _reference_sums(x) != sums
            assert getattr(elementwise, f"{name}_forward_checksum")(x, np.empty_like(x)) != sums
            raw[position] ^= flip
    in_place = x.copy()  # out may be x: the sums are of the input
    assert getattr(elementwise, f"{name}_forward_checksum")(in_place, in_place) == sums
    np.testing.assert_array_equal(in_place.view(np.uint32), expected.view(np.uint32))



def _edge_values(x: np.ndarray) -> np.ndarray:
    """x with the values the kernels must pass as PyTorch does at its head: the kinks, ±inf and NaN."""
    x.reshape(-1)[:7] = [0.0, 6.0, np.inf, -np.inf, np.nan, -1e-30, 6.5]
    x.reshape(-1)[-3:] = [np.inf, np.nan, 0.0]  # and at the tail (the last range's)
    return x


def _at_threads(threads: int):
    import numba

    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return previous


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_every_kernel_gives_the_reference_bits_split_over_threads(threads, in_place, rng):
    """Serial kernels over ``run_ranges`` with an in-place branch (module docstring): the reference's bits on
    a tensor the threads split, in place (the written array is the read one, as the layers call them) and
    not, with the kinks, ±inf and NaN at both ends."""
    import numba

    x = _edge_values(rng.uniform(-4, 10, size=LARGE).astype(np.float32))
    dout = _edge_values(rng.standard_normal(LARGE).astype(np.float32))[::-1].copy()
    mask = (rng.random(LARGE) > 0.3).astype(np.uint8)

    previous = _at_threads(threads)
    try:
        assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
        cases = [
            ("relu_forward", (x,), ()), ("relu6_forward", (x,), ()), ("leaky_relu_forward", (x,), (0.2,)),
            ("relu_backward", (np.maximum(x, 0), dout), ()), ("relu6_backward", (np.clip(x, 0, 6), dout), ()),
            ("leaky_relu_backward", (x, dout), (0.2,)), ("add_forward", (x, dout), ()),
            # finite: a dropped value is 0 here, the reference's x·0 can be NaN
            ("dropout_forward", (np.nan_to_num(x, posinf=1.0, neginf=-1.0), mask), (1 / 0.7,)),
        ]
        for name, arrays, extra in cases:
            want = np.empty_like(x)
            if name.startswith("dropout"):
                reference.dropout_forward(arrays[0], arrays[1], *extra, want)
            else:
                getattr(reference, name)(*arrays, want, *extra)
            arrays = [a.copy() for a in arrays]
            if in_place:  # over the last float input: x (forward), dout (backward), b (add)
                target = arrays[0] if name.startswith("dropout") else arrays[-1]
            else:
                target = np.full_like(x, 123.0)
            if name.startswith("dropout"):
                elementwise.dropout_forward(arrays[0], arrays[1], *extra, target)
            else:
                getattr(elementwise, name)(*arrays, target, *extra)
            if name.startswith("dropout"):  # the reference's x·0 is −0 for x < 0; the kernel writes 0
                np.testing.assert_array_equal(target, want, err_msg=name)
            else:
                np.testing.assert_array_equal(target.view(np.uint32), want.view(np.uint32), err_msg=name)
        a, b = x.copy(), dout.copy()
        elementwise.add_forward(a, b, a)  # out = a, the other in-place case
        np.testing.assert_array_equal(a.view(np.uint32), (x + dout).view(np.uint32))
    finally:
        numba.set_num_threads(previous)
