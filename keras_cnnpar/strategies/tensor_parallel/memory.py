"""Memory per device under channel sharding: which outputs the devices share, and what each convolution keeps
(the ``channels`` and ``hybrid`` rows of :mod:`keras_cnnpar.strategies.memory`'s table)."""

import collections

import keras
import numpy as np

from keras_cnnpar.keras_compat import graph
from keras_cnnpar.strategies import memory
from keras_cnnpar.strategies.tensor_parallel.layers import formulation, same_padding
from keras_cnnpar.strategies.tensor_parallel.model import channel_layouts

#: Layers whose weights the tensor-parallel strategies shard over the "model" axis.
SHARDED_LAYERS = (keras.layers.Conv2D, keras.layers.Dense)


def memory_split(model, batch_size, data, shards):
    """The :class:`memory.MemorySplit` of one device of a ``data x shards`` mesh (``data=1``: channels only):
    Conv2D/Dense kernels and biases sharded except where a layer keeps them whole, the kept activations of
    :func:`channel_sharded_values` for ``batch_size / data`` examples.

    >>> import keras_cnnpar as cnnpar
    >>> split = memory_split(cnnpar.models.cnn("2+2"), 64, data=1, shards=2)
    >>> round(split.state, 2), split.batch
    (0.5, 64.0)
    """
    batch_axis = data > 1
    modes = {name: layout.mode for name, layout in channel_layouts(model, batch_axis, shards).items()}
    weights = memory.bytes_of(model.weights)
    sharded = memory.bytes_of([w for layer in model._flatten_layers(include_self=False)
                               if isinstance(layer, SHARDED_LAYERS) and modes.get(layer.name) != "whole"
                               for w in layer.weights])
    state = (weights - sharded * (1 - 1 / shards)) / weights if weights else 1.0
    largest = memory.largest_output_values(model, channel_shares(model, shards, batch_axis))
    return memory.MemorySplit(state, True, channel_sharded_values(model, shards, batch_axis), largest,
                              batch_size / data)


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
    >>> round(channel_sharded_values(resnet, 2) / memory.kept_activation_values(resnet), 2)
    0.51
    """
    layouts = channel_layouts(model, batch_axis, shards)  # the model's input layer is not in it: its images are whole
    shares = _shares(layouts, shards)
    kept = collections.Counter()
    for layer, tensor in memory.kept_tensors(model):
        kept[layer.name] += memory.values(tensor) / shares.get(layer.name, 1)
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
