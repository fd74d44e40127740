"""Memory per device before training: weights, gradients, optimizer slots and activations, for each strategy.

The parts come from the model itself: its weights' bytes, its optimizer's
slots (a copy of the optimizer built on the weights), and the activations of
one micro-batch at the compute dtype: the layer outputs that the backward pass
keeps (:func:`kept_activation_values`), plus two of the largest output (the
gradient flowing back and the one being computed). Each strategy says how it
divides them (``Strategy.memory_split``, a :class:`MemorySplit`):

====================  =======================================  ==========================================
strategy              weights, gradients, optimizer slots       activations
====================  =======================================  ==========================================
single                all                                       the global batch
mirrored, multi-worker all (one copy per replica)               the batch / replicas
layers                1/devices (layers spread over devices)    the batch / devices (each stage its layers)
channels              Conv2D/Dense kernels and biases / devices the whole batch: sharded channels / devices,
                                                                whole ones on every device, plus each
                                                                convolution's own buffers
hybrid                as channels, over the "model" axis        as channels, for the batch / data
async-ps              weights and gradients (slots on the ps)   the batch / workers
====================  =======================================  ==========================================

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("2+2")
>>> parts = estimate(model, cnnpar.Single(), batch_size=64)
>>> parts["weights"] == parts["gradients"] == model.count_params() * 4, parts["optimizer"] / parts["weights"]  # Adam
(True, 2.0)
"""

import dataclasses

import keras
import numpy as np

from keras_cnnpar.keras_compat import graph


@dataclasses.dataclass(frozen=True)
class MemorySplit:
    """How a strategy divides a model's memory over its devices, as one device sees it.

    Args:
        state: the share of the weights, their gradients and the optimizer's slots that one device holds.
        slots_here: whether the optimizer's slots live on the devices (not on parameter servers).
        kept_values: values per example of the activations the backward pass keeps, on one device.
        largest_values: values per example of the largest layer output, on one device.
        batch: examples of a step on one device.
    """

    state: float
    slots_here: bool
    kept_values: float
    largest_values: float
    batch: float


def replicated(model, batch):
    """The :class:`MemorySplit` of a device that holds the whole model and trains on ``batch`` examples.

    >>> import keras_cnnpar as cnnpar
    >>> replicated(cnnpar.models.cnn("3+3"), 32).state, replicated(cnnpar.models.cnn("3+3"), 32).batch
    (1.0, 32)
    """
    return MemorySplit(1.0, True, kept_activation_values(model), largest_output_values(model), batch)


def estimate(model, strategy, batch_size, precision="float32"):
    """Bytes per device of ``model`` trained under ``strategy`` at the global ``batch_size``, by part.

    Returns a dict: ``weights``, ``gradients``, ``optimizer``, ``activations`` and their ``total``.
    """
    split = strategy.memory_split(model, batch_size)
    slots = slot_bytes(model) if split.slots_here else 0
    parts = {"weights": bytes_of(model.weights) * split.state,
             "gradients": bytes_of(model.trainable_weights) * split.state, "optimizer": slots * split.state}
    itemsize = 2 if precision.startswith("mixed") else 4
    parts["activations"] = (split.kept_values + 2 * split.largest_values) * split.batch * itemsize
    parts = {name: round(value) for name, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


#: Layers whose gradient reads none of their inputs' values: merges, averages, and activations (whose gradient
#: reads their output). Every other layer keeps its inputs for the backward pass (a convolution's kernel
#: gradient, a BatchNormalization's statistics, a max-pooling's argmax).
INPUT_FREE_LAYERS = (keras.layers.Add, keras.layers.Subtract, keras.layers.Average, keras.layers.Concatenate,
                     keras.layers.AveragePooling2D, keras.layers.GlobalAveragePooling2D, keras.layers.Activation,
                     keras.layers.ReLU, keras.layers.Softmax)
#: Layers whose output is their input's buffer in another shape: it holds no values of its own.
VIEW_LAYERS = (keras.layers.Flatten, keras.layers.Reshape)
#: Layers whose gradient reads their own output (besides those with a non-linear ``activation``).
OUTPUT_KEEPING_LAYERS = (keras.layers.Activation, keras.layers.ReLU, keras.layers.Softmax,
                         keras.layers.MaxPooling2D, keras.layers.Dropout)


def kept_activation_values(model):
    """Values per example of the tensors that ``model``'s backward pass keeps from its forward pass.

    A tensor is kept if a layer that reads it needs it for its gradient (not
    ``INPUT_FREE_LAYERS``; through ``VIEW_LAYERS``, which hold no values of
    their own), if the layer that made it needs its own output (a ReLU, a max
    pooling, a Dense with softmax), or if it is an output of the model (the
    loss reads it). The resnet keeps 58% of all its layers' output values: a
    BatchNormalization's output, read only by a ReLU, is freed.

    >>> import keras_cnnpar as cnnpar
    >>> model = cnnpar.models.cnn("2+2")  # every output but the Flatten's (a view of the pooling's)
    >>> kept_activation_values(model) == sum(int(np.prod(t.shape[1:])) for t in _tensors(model)) - 3136
    True
    >>> resnet = cnnpar.models.cnn("resnet")
    >>> round(kept_activation_values(resnet) / sum(int(np.prod(t.shape[1:])) for t in _tensors(resnet)), 2)
    0.58
    """
    return sum(values(tensor) for _, tensor in kept_tensors(model))


def kept_tensors(model):
    """``(layer, tensor)`` for each tensor of ``model`` that its backward pass keeps, and the layer that made it
    (see :func:`kept_activation_values`)."""
    consumers = {}
    for layer, node in graph.nodes(model):
        for tensor in node.input_tensors:
            consumers.setdefault(id(tensor), []).append((layer, node))
    outputs = {id(tensor) for tensor in model.outputs}

    def read_for_gradient(tensor):
        return id(tensor) in outputs or any(
            read_for_gradient(node.output_tensors[0]) if isinstance(layer, VIEW_LAYERS)
            else not isinstance(layer, INPUT_FREE_LAYERS) for layer, node in consumers.get(id(tensor), []))

    return [(layer, tensor) for layer, node in graph.nodes(model) if not isinstance(layer, VIEW_LAYERS)
            for tensor in node.output_tensors if _keeps_own_output(layer) or read_for_gradient(tensor)]


def largest_output_values(model, shares=None):
    """Values per example of ``model``'s largest layer output (inputs included), on one device where ``shares``
    gives the devices that share a layer's output (layer name -> how many)."""
    shares = shares or {}
    return max(values(tensor) / shares.get(layer.name, 1) for layer, node in graph.nodes(model)
               for tensor in node.output_tensors)


def values(tensor):
    """Values per example of ``tensor`` (its shape without the batch axis); an axis whose size Keras does not know
    until the model runs (a user's layer that reshapes to ``-1``) counts as 1."""
    return int(np.prod([size or 1 for size in tensor.shape[1:]]))


def _keeps_own_output(layer):
    activation = getattr(layer, "activation", None)
    return isinstance(layer, OUTPUT_KEEPING_LAYERS) or (
        activation is not None and getattr(activation, "__name__", "linear") != "linear")


def _tensors(model):
    return [tensor for _, node in graph.nodes(model) for tensor in node.output_tensors]


def bytes_of(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def slot_bytes(model):
    """Bytes of the optimizer's slots (momentum, velocity, ...) for ``model``'s trainable weights, from a copy of
    its optimizer built on them (``iterations`` and the learning rate left out)."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if optimizer is None:
        return 0
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(model.trainable_weights)
    return sum(bytes_of([v]) for v in copy.variables if len(v.shape) > 0)
