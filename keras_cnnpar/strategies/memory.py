"""Memory per device before training: weights, gradients, optimizer slots and activations, for each strategy.

The parts come from the model itself: its weights' bytes, its optimizer's
slots (a copy of the optimizer built on the weights), and the activations of
one micro-batch at the compute dtype: the layer outputs that the backward pass
keeps (:func:`kept_activation_values`), plus two of the largest output (the
gradient flowing back and the one being computed). Each strategy divides them
as it places them:

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

import collections

import keras
import numpy as np

from keras_cnnpar.keras_compat import graph
from keras_cnnpar.strategies.tensor_parallel.layers import formulation, same_padding
from keras_cnnpar.strategies.tensor_parallel.model import channel_layouts

#: Layers whose weights the tensor-parallel strategies shard over the "model" axis.
SHARDED_LAYERS = (keras.layers.Conv2D, keras.layers.Dense)


def estimate(model, strategy, batch_size, precision="float32"):
    """Bytes per device of ``model`` trained under ``strategy`` at the global ``batch_size``, by part.

    Returns a dict: ``weights``, ``gradients``, ``optimizer``, ``activations`` and their ``total``.
    """
    alias, devices = strategy.alias, strategy.num_devices
    weights = _bytes(model.weights)
    trainable = _bytes(model.trainable_weights)
    slots = _slot_bytes(model)
    data = getattr(strategy, "data", 1)
    shards, batch_axis = devices // data, data > 1  # the mesh's, under channels and hybrid
    if alias in ("channels", "hybrid"):
        modes = {name: layout.mode for name, layout in channel_layouts(model, batch_axis, shards).items()}
        sharded = _bytes([w for layer in model._flatten_layers(include_self=False) if isinstance(layer, SHARDED_LAYERS)
                          and modes.get(layer.name) != "whole" for w in layer.weights])
        share = (weights - sharded * (1 - 1 / shards)) / weights if weights else 1.0
        parts = {"weights": weights * share, "gradients": trainable * share, "optimizer": slots * share}
    elif alias == "layers":
        parts = {"weights": weights / devices, "gradients": trainable / devices, "optimizer": slots / devices}
    elif alias == "async-ps":
        parts = {"weights": weights, "gradients": trainable, "optimizer": 0}
    else:
        parts = {"weights": weights, "gradients": trainable, "optimizer": slots}
    itemsize = 2 if precision.startswith("mixed") else 4
    if alias in ("channels", "hybrid"):
        values, per_device_batch = channel_sharded_values(model, shards, batch_axis), batch_size / data
        largest = largest_output_values(model, channel_shares(model, shards, batch_axis))
    else:
        values, per_device_batch = kept_activation_values(model), batch_size / (1 if alias == "single" else devices)
        largest = largest_output_values(model)
    parts["activations"] = (values + 2 * largest) * per_device_batch * itemsize
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
    return sum(_values(tensor) for _, tensor in _kept_tensors(model))


def _kept_tensors(model):
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
    gives the devices that share a layer's output (:func:`channel_shares`)."""
    shares = shares or {}
    return max(_values(tensor) / shares.get(layer.name, 1) for layer, node in graph.nodes(model)
               for tensor in node.output_tensors)


def channel_shares(model, shards, batch_axis=False):
    """Layer name -> how many devices share its output under channel sharding over ``shards``: all of them
    where its channels are sharded or its batch split, else 1 (whole on every device; ``model``'s input too).

    >>> import keras_cnnpar as cnnpar
    >>> model = cnnpar.models.cnn("2+2")  # convolutions and pooling on a split batch, then Dense layers
    >>> shares = channel_shares(model, 2)
    >>> [shares[layer.name] for layer in model.layers]
    [2, 2, 2, 2, 2, 1, 1, 1]
    """
    return _shares(channel_layouts(model, batch_axis, shards), shards)


def _shares(layouts, shards):
    """:func:`channel_shares` from the layouts of :func:`channel_layouts`."""
    return {name: shards if layout.output_sharded or layout.output_batch_split else 1
            for name, layout in layouts.items()}


def channel_sharded_values(model, shards, batch_axis=False):
    """Values per example, on one device, that ``model``'s backward pass holds at its peak under channel sharding
    over ``shards`` (``batch_axis``: a mesh that also splits the batch).

    Each kept tensor counts whole where its channels are whole (every device holds all of them: a row-mode
    layer's output, and what follows it up to the next column-mode one) and ``1/shards`` where they are
    sharded or split over the batch; each convolution adds the copy its formulation keeps for its gradient:
    its input padded and split over the batch (split batch; none for an input split already that the op
    pads itself, Keras's ``"same"``; with a ``"batch"`` axis, its input with whole channels where they were
    sharded or it is padded first), its sharded input transposed (filter gradient), or its ``kh*kw``
    stacked windows (im2col). An im2col convolution's input gradient adds ``kh*kw`` padded inputs for a
    moment (one per window, summed at the end); the backward pass meets it when the tensors kept after that
    convolution are already freed, so the peak is the largest of those moments and the whole kept set.

    On two devices the resnet's tensors are all split over the batch; only the first convolution keeps a
    copy of its input (the images, split), so one device holds about half of what Single holds per example:

    >>> import keras_cnnpar as cnnpar
    >>> resnet = cnnpar.models.cnn("resnet")
    >>> round(channel_sharded_values(resnet, 2) / kept_activation_values(resnet), 2)
    0.51
    """
    layouts = channel_layouts(model, batch_axis, shards)  # the model's input layer is not in it: its images are whole
    shares = _shares(layouts, shards)
    kept = collections.Counter()
    for layer, tensor in _kept_tensors(model):
        kept[layer.name] += _values(tensor) / shares.get(layer.name, 1)
    held = peak = 0
    for layer, node in graph.nodes(model):
        held += kept.pop(layer.name, 0)
        if isinstance(layer, keras.layers.Conv2D):
            copy, transient = _convolution_buffers(layer, node, layouts[layer.name], shards, batch_axis)
            held += copy
            peak = max(peak, held + transient)
    return max(held, peak)


def _convolution_buffers(layer, node, layout, shards, batch_axis):
    """Values per example of a channel-sharded convolution's own buffers (its :class:`ChannelLayout` given):
    the copy it keeps for its gradient besides its input, and what its input gradient holds for a moment
    (im2col's ``kh*kw`` padded pieces)."""
    _, height, width, channels = node.input_tensors[0].shape
    (top, bottom), (left, right) = same_padding((height, width), layer.kernel_size, layer.strides, layer.padding)
    padded = (shards, height + top + bottom, width + left + right, channels)  # a batch the shards divide
    mode = layout.mode
    form = formulation(mode, layer.kernel_size, layer.strides, padded, shards, batch_axis)
    padded_inside = layer.padding == "same" or not top + bottom + left + right
    if form == "split batch" and layout.input_batch_split and padded_inside:
        return 0, 0  # its input is the split batch already, padded inside the op: nothing more to keep
    if form == "split batch" and batch_axis:  # a replica's input with whole channels: gathered, or padded
        return (int(np.prod(padded[1:])) if layout.input_sharded or not padded_inside else 0), 0
    if form in ("split batch", "filter gradient"):
        return int(np.prod(padded[1:])) / shards, 0
    (kh, kw), (_, out_height, out_width, _) = layer.kernel_size, node.output_tensors[0].shape
    share = shards if mode == "row" else 1  # column mode gathers its input's channels first
    pieces = kh * kw * int(np.prod(padded[1:])) / share if layout.input_gradient else 0
    return kh * kw * out_height * out_width * channels / share, pieces


def _values(tensor):
    """Values per example of ``tensor`` (its shape without the batch axis); an axis whose size Keras does not know
    until the model runs (a user's layer that reshapes to ``-1``) counts as 1."""
    return int(np.prod([size or 1 for size in tensor.shape[1:]]))


def _keeps_own_output(layer):
    activation = getattr(layer, "activation", None)
    return isinstance(layer, OUTPUT_KEEPING_LAYERS) or (
        activation is not None and getattr(activation, "__name__", "linear") != "linear")


def _tensors(model):
    return [tensor for _, node in graph.nodes(model) for tensor in node.output_tensors]


def _bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def _slot_bytes(model):
    """Bytes of the optimizer's slots (momentum, velocity, ...) for ``model``'s trainable weights, from a copy of
    its optimizer built on them (``iterations`` and the learning rate left out)."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if optimizer is None:
        return 0
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(model.trainable_weights)
    return sum(_bytes([v]) for v in copy.variables if len(v.shape) > 0)
