"""Layers: each declares its parameters, buffers and saved tensors, and runs through the kernel table.

See ``engine.layers.base`` for the contract between a layer and the graph.
"""

from engine.layers.activation import LeakyReLU, ReLU, ReLU6
from engine.layers.base import BufferSpec, InputGradients, Layer, ParameterSpec, SavedSpec
from engine.layers.batchnorm import BatchNorm2d
from engine.layers.conv import Conv2d
from engine.layers.dense import Dense, Flatten
from engine.layers.dropout import Dropout
from engine.layers.loss import SoftmaxCrossEntropy
from engine.layers.merge import Add
from engine.layers.pool import AvgPool2d, GlobalAvgPool, MaxPool2d

__all__ = [
    "Add",
    "AvgPool2d",
    "BatchNorm2d",
    "BufferSpec",
    "Conv2d",
    "Dense",
    "Dropout",
    "Flatten",
    "GlobalAvgPool",
    "InputGradients",
    "Layer",
    "LeakyReLU",
    "MaxPool2d",
    "ParameterSpec",
    "ReLU",
    "ReLU6",
    "SavedSpec",
    "SoftmaxCrossEntropy",
]
