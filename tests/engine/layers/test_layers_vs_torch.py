"""Every layer, forward and backward, against PyTorch CPU at tiny shapes, on the Numba CPU kernels and
on the NumPy reference table (so a layer bug cannot hide behind a kernel bug, or the other way round)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.backend import Backend, get_backend
from engine.layers import (
    Add,
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    LeakyReLU,
    MaxPool2d,
    ReLU,
    ReLU6,
    SoftmaxCrossEntropy,
)
from engine.memory import ArrayType, ContiguousBlock, WorkspaceManager

BACKENDS = {
    "cpu": lambda: get_backend("cpu"),
    "reference": lambda: Backend("reference", np, "kernels.reference"),
}


@pytest.fixture(params=sorted(BACKENDS), scope="module")
def backend(request):
    return BACKENDS[request.param]()


def run_layer(layer, backend, inputs, dout, training=True, seed=0):
    """Bind ``layer`` to fresh blocks, run forward (and backward when training); everything back on the host."""
    mgr = WorkspaceManager(backend, mode="training" if training else "inference")
    specs = [(p.name, p.shape) for p in layer.parameter_specs()]
    params = ContiguousBlock(backend, ArrayType.PARAMETERS, specs)
    grads = ContiguousBlock(backend, ArrayType.GRADIENTS, specs)
    buffers = ContiguousBlock(backend, ArrayType.PARAMETERS, [(b.name, b.shape) for b in layer.buffer_specs()])
    for spec in layer.buffer_specs():
        buffers.views[spec.name][...] = spec.initial_value
    for name, value in layer.init_parameters(np.random.default_rng(seed)).items():
        params.views[name][...] = value
    layer.bind(backend, mgr, params.views, grads.views, buffers.views)
    result = {"params": {k: v.copy() for k, v in params.views.items()}}
    try:
        with mgr.iteration():
            with mgr.layer(0):
                out = layer.forward(inputs, training)
            result["out"] = np.array(backend.to_host(out.array if hasattr(out, "array") else out))
            if training:
                with mgr.layer(0):
                    dxs = layer.backward(dout, [True] * len(inputs))
                result["dx"] = [np.array(backend.to_host(d.array if hasattr(d, "array") else d)) for d in dxs]
                result["grads"] = {k: v.copy() for k, v in grads.views.items()}
            result["buffers"] = {k: v.copy() for k, v in buffers.views.items()}
            result["saved"] = {k: np.array(v.array) for k, v in layer.saved.items() if hasattr(v, "array")}
    finally:
        mgr.close()
    return result


def close(ours, theirs, rtol=1e-5):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    scale = max(float(np.abs(theirs).max()), 1e-6)
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=rtol * scale)


def torch_check(layer, module, backend, input_shapes, scale=1.0):
    """Same weights into ``module``; compare output, input gradients and parameter gradients."""
    rng = np.random.default_rng(1)
    xs = [(scale * rng.standard_normal(s)).astype(np.float32) for s in input_shapes]
    out_shape = layer.output_shape([tuple(s) for s in input_shapes])
    dout = rng.standard_normal(out_shape).astype(np.float32)
    ours = run_layer(layer, backend, xs, dout)
    with torch.no_grad():
        for name, value in ours["params"].items():
            getattr(module, name).copy_(torch.from_numpy(value))
    txs = [torch.from_numpy(x).requires_grad_(True) for x in xs]
    tout = module(*txs)
    tout.backward(torch.from_numpy(dout))
    close(ours["out"], tout)
    for ours_dx, tx in zip(ours["dx"], txs):
        close(ours_dx, tx.grad)
    for name, grad in ours["grads"].items():
        close(grad, getattr(module, name).grad)
    return ours, module


class Lambda(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *xs):
        return self.function(*xs)


CONV_CASES = {
    "3x3-pad1-bias": (dict(in_channels=3, out_channels=4, kernel_size=3, padding=1), (2, 3, 5, 5)),
    "3x3-stride2-nobias": (
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, bias=False),
        (2, 4, 7, 7),
    ),
    "1x1": (dict(in_channels=4, out_channels=5, kernel_size=1), (2, 4, 3, 3)),
    "depthwise": (dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4, bias=False), (2, 4, 5, 5)),
    "depthwise-stride2": (
        dict(in_channels=3, out_channels=3, kernel_size=3, stride=2, padding=1, groups=3),
        (1, 3, 6, 6),
    ),
    "grouped": (dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2), (2, 4, 4, 4)),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv2d(backend, case):
    kwargs, shape = CONV_CASES[case]
    torch_kwargs = dict(kwargs)
    torch_kwargs["bias"] = kwargs.get("bias", True)
    torch_check(Conv2d(**kwargs), nn.Conv2d(**torch_kwargs), backend, [shape])


def test_conv2d_init_is_pytorch_default_bound():
    layer = Conv2d(8, 4, 3)
    values = layer.init_parameters(np.random.default_rng(0))
    bound = 1 / np.sqrt(8 * 9)
    assert np.abs(values["weight"]).max() <= bound and np.abs(values["weight"]).max() > 0.9 * bound
    assert values["weight"].dtype == np.float32 and values["bias"].shape == (4,)


def test_batchnorm2d_training(backend):
    layer, module = BatchNorm2d(3), nn.BatchNorm2d(3)
    ours, module = torch_check(layer, module, backend, [(2, 3, 4, 4)], scale=2.0)
    close(ours["buffers"]["running_mean"], module.running_mean)
    close(ours["buffers"]["running_var"], module.running_var)
    assert layer.num_batches_tracked == 1
    # In-Place ABN: the output and 1/std are kept, x̂ is rebuilt from the output (the input is not kept)
    assert set(ours["saved"]) == {"out", "save_invstd"}


def test_batchnorm2d_inference_uses_running_statistics(backend):
    layer = BatchNorm2d(3)
    x = np.random.default_rng(2).standard_normal((2, 3, 4, 4)).astype(np.float32)
    ours = run_layer(layer, backend, [x], None, training=False)
    module = nn.BatchNorm2d(3).eval()
    close(ours["out"], module(torch.from_numpy(x)))
    assert layer.num_batches_tracked == 0


SIMPLE_CASES = {
    "relu": (ReLU, lambda: nn.ReLU(), [(2, 3, 4, 4)], 1.0),
    "relu6": (ReLU6, lambda: nn.ReLU6(), [(2, 3, 4, 4)], 5.0),
    "leaky-relu": (lambda: LeakyReLU(0.1), lambda: nn.LeakyReLU(0.1), [(2, 3, 4, 4)], 1.0),
    "leaky-relu-default": (LeakyReLU, lambda: nn.LeakyReLU(), [(2, 3, 4, 4)], 1.0),
    "maxpool2": (lambda: MaxPool2d(2), lambda: nn.MaxPool2d(2), [(2, 3, 4, 6)], 1.0),
    "maxpool3-s2-p1": (lambda: MaxPool2d(3, 2, 1), lambda: nn.MaxPool2d(3, 2, 1), [(2, 2, 5, 5)], 1.0),
    "avgpool2": (lambda: AvgPool2d(2), lambda: nn.AvgPool2d(2), [(2, 3, 4, 6)], 1.0),
    "avgpool3-s2-p1": (lambda: AvgPool2d(3, 2, 1), lambda: nn.AvgPool2d(3, 2, 1), [(2, 2, 5, 5)], 1.0),
    "global-avgpool": (GlobalAvgPool, lambda: Lambda(lambda x: x.mean(dim=(2, 3))), [(2, 3, 4, 5)], 1.0),
    "flatten": (Flatten, lambda: nn.Flatten(), [(2, 3, 2, 2)], 1.0),
    "add": (Add, lambda: Lambda(lambda a, b: a + b), [(2, 3, 4, 4), (2, 3, 4, 4)], 1.0),
    "dense": (lambda: Dense(6, 4), lambda: nn.Linear(6, 4), [(3, 6)], 1.0),
    "dense-nobias": (lambda: Dense(6, 4, bias=False), lambda: nn.Linear(6, 4, bias=False), [(3, 6)], 1.0),
}


@pytest.mark.parametrize("case", sorted(SIMPLE_CASES))
def test_layer(backend, case):
    make_layer, make_module, shapes, scale = SIMPLE_CASES[case]
    torch_check(make_layer(), make_module(), backend, shapes, scale)


@pytest.mark.parametrize("make_layer", [ReLU, ReLU6, LeakyReLU])
def test_activation_backward_may_write_over_dout(backend, make_layer):
    layer = make_layer()
    x = 4 * np.random.default_rng(5).standard_normal((2, 3, 4, 4)).astype(np.float32)
    dout = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32)
    expected = run_layer(make_layer(), backend, [x], dout)["dx"][0]
    mgr = WorkspaceManager(backend, "training")
    layer.bind(backend, mgr, {}, {}, {})
    with mgr.iteration():
        layer.forward([x], True)
        given = dout.copy()
        (dx,) = layer.backward(given, [True], reuse_dout=True)
        assert dx is given and np.array_equal(given, expected)
    mgr.close()


def test_leaky_relu_refuses_a_negative_slope():
    with pytest.raises(ValueError, match="negative_slope must be >= 0"):
        LeakyReLU(-0.1)


def test_dropout_applies_its_mask_and_scale(backend):
    layer = Dropout(0.25)
    layer.rng = np.random.default_rng(7)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    ours = run_layer(layer, backend, [x], dout)
    mask = ours["saved"]["mask"]
    assert mask.dtype == np.uint8 and 0.6 < mask.mean() < 0.9
    close(ours["out"], x * mask / 0.75)
    close(ours["dx"][0], dout * mask / 0.75)
    again = Dropout(0.25)
    again.rng = np.random.default_rng(7)
    assert np.array_equal(run_layer(again, backend, [x], dout)["saved"]["mask"], mask)  # seeded: same mask


def test_dropout_is_identity_in_inference(backend):
    layer = Dropout(0.5)
    x = np.ones((2, 3), np.float32)
    assert np.array_equal(run_layer(layer, backend, [x], None, training=False)["out"], x)


def test_softmax_cross_entropy(backend):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, 7)).astype(np.float32) * 3
    labels = rng.integers(0, 7, 5).astype(np.int64)
    mgr = WorkspaceManager(backend, "training")
    head = SoftmaxCrossEntropy(backend)
    with mgr.iteration():
        loss = head.forward(mgr, logits, labels)
        dlogits = np.array(head.backward(mgr).array)
    mgr.close()
    tlogits = torch.from_numpy(logits).requires_grad_(True)
    tloss = F.cross_entropy(tlogits, torch.from_numpy(labels))
    tloss.backward()
    assert loss == pytest.approx(tloss.item(), rel=1e-6)
    close(dlogits, tlogits.grad)


@pytest.mark.parametrize(
    "labels, message",
    [
        (np.array([0, 9], np.int64), r"labels must lie in \[0, 7\)"),
        (np.array([0, 1], np.int32), "int64"),
        (np.array([0, 1, 2], np.int64), r"labels of shape \(2,\)"),
    ],
)
def test_softmax_cross_entropy_rejects_bad_labels(labels, message):
    backend = get_backend("cpu")
    mgr = WorkspaceManager(backend, "training")
    try:
        with mgr.iteration(), pytest.raises(ValueError, match=message):
            SoftmaxCrossEntropy(backend).forward(mgr, np.zeros((2, 7), np.float32), labels)
    finally:
        mgr.close()


WRONG_SHAPES = {
    "conv-channels": (lambda: Conv2d(3, 4, 3), [(2, 5, 8, 8)], r"\(N, 3, H, W\).*\(2, 5, 8, 8\)"),
    "conv-too-small": (lambda: Conv2d(3, 4, 5), [(2, 3, 2, 2)], r"\(N, 3, H, W\).*\(2, 3, 2, 2\)"),
    "conv-not-4d": (lambda: Conv2d(3, 4, 3), [(2, 3)], r"\(N, 3, H, W\).*\(2, 3\)"),
    "batchnorm": (lambda: BatchNorm2d(8), [(2, 4, 3, 3)], r"\(N, 8, H, W\).*\(2, 4, 3, 3\)"),
    "dense": (lambda: Dense(10, 3), [(2, 12)], r"\(N, 10\).*\(2, 12\)"),
    "maxpool": (lambda: MaxPool2d(3), [(1, 2, 2, 2)], r"\(N, C, H, W\).*\(1, 2, 2, 2\)"),
    "global-avgpool": (GlobalAvgPool, [(4, 5)], r"\(N, C, H, W\).*\(4, 5\)"),
    "add": (Add, [(2, 3, 4, 4), (2, 3, 4, 5)], r"\(2, 3, 4, 4\) and \(2, 3, 4, 5\)"),
}


@pytest.mark.parametrize("case", sorted(WRONG_SHAPES))
def test_wrong_input_shape_names_the_layer_and_both_shapes(case):
    make_layer, shapes, pattern = WRONG_SHAPES[case]
    layer = make_layer()
    layer.name = "block.7"
    with pytest.raises(ValueError, match=rf"{type(layer).__name__} 'block.7'.*{pattern}"):
        layer.output_shape(shapes)
