"""A Keras CNN rebuilt on a DTensor mesh: sharded Conv2D/Dense, BatchNormalization, and the layers between them.

The model is a ``keras.Sequential`` or a functional graph (one input, one
output, each layer called once); a model nested in it is read as its layers.
The weightless layers at its input that the mesh cannot run (augmentation) run
on the host, on each batch before it goes to the mesh (:func:`host_prefix`).
Its layers run in a topological order of the graph, and each tensor keeps a
layout: channels whole, channels sharded over ``"model"``, or (a mesh without a
``"batch"`` axis) the batch split over ``"model"`` with whole channels. On a
mesh without a ``"batch"`` axis every Conv2D runs in column mode: its kernel,
sharded at rest, is gathered for the step and the convolution runs on the batch
split over ``"model"``, which takes any input layout, and its output stays
split over the batch, so the tensors from one convolution to the next
(BatchNormalization with statistics all-reduced over the batch, pooling,
activations, merges) need no communication. On a mesh with a ``"batch"`` axis,
and for Dense layers, a layer whose input is sharded (or split over the batch)
runs in row mode, else in column mode, so a chain alternates column and row as
Megatron pairs its layers; a Dense whose output is gathered anyway (a softmax,
the model's output) runs in row mode, so its units need not split. A layer
whose channels in its mode the shards do not divide (a convolution of 6 or 1
output channels over 4 or 2 shards, say) runs in ``"whole"`` mode: its kernel
whole on every device, its input and output channels whole.
BatchNormalization, LayerNormalization, RMSNormalization, Normalization,
DepthwiseConv2D, Conv2DTranspose, pooling, padding, cropping, upsampling,
dropout, ``Flatten``, a ``Reshape`` of axes of size 1 and activations keep the
layout they get (GroupNormalization, UnitNormalization and a softmax gather the
channels); an ``Add`` (or another elementwise merge, or an element-wise operation
called on tensors: ``a + b``, ``keras.ops.relu(x)``) takes the layout of its inputs, split
over the batch if any is, else sharded if any is, and re-lays the others out to
it (cutting a whole tensor needs no communication); ``Concatenate`` of tensors
split over the batch stays split, else it gathers its inputs' channels. A
``Flatten`` of sharded channels (on a mesh with ``"batch"``) that only Dense
layers read (directly, or through dropout and activations) is folded into them,
and each holds its kernel as ``(h, w, c, units)`` sharded on ``c``; any other
``Flatten`` (the model's output, say) gathers the channels and reshapes. Where
the shards do not divide a batch, a tensor split over the batch is whole on
every device. The output of the model always has whole channels.
Every layer's output is pinned to its layout (``dtensor.relayout``): left to
DTensor's layout propagation, a sharded layout reached the moments of a
BatchNormalization on whole channels, and the step failed.

Example:

>>> import keras, numpy as np
>>> from tensorflow.experimental import dtensor
>>> from keras_cnnpar import devices, models
>>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
>>> model = models.cnn("2+2")
>>> sharded = ShardedModel(model, mesh)
>>> [(type(layer).__name__, layer.mode) for layer in sharded.sharded_layers]  # doctest: +NORMALIZE_WHITESPACE
[('ChannelShardedConv2D', 'column'), ('ChannelShardedConv2D', 'column'),
 ('ShardedDense', 'row'), ('ShardedDense', 'row')]
>>> x = np.random.default_rng(0).random((2, 28, 28, 1), dtype="float32")
>>> bool(np.allclose(sharded.forward(x), model.predict(x, verbose=0), atol=1e-5))
True
"""

import collections
import functools
import math
import typing

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_cnnpar.keras_compat import graph
from keras_cnnpar.strategies.tensor_parallel.layers import (
    ChannelShardedConv2D,
    ShardedBatchNormalization,
    ShardedConv2DTranspose,
    ShardedDense,
    ShardedDepthwiseConv2D,
    ShardedGroupNormalization,
    ShardedLayer,
    ShardedLayerNormalization,
    ShardedNormalization,
    ShardedSeparableConv2D,
    WeightedModule,
    activation_layout,
    mixes_channels,
    module_name,
    require_settings,
    same_padding,
    to_mesh,
    to_numpy,
    windows,
)

#: Layers without weights that work elementwise and keep the layout (``Softmax``, a softmax activation and
#: ``UnitNormalization`` gather the channels; ``ActivityRegularization`` passes its input on).
ELEMENTWISE = ("Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Rescaling", "Identity", "UnitNormalization",
               "ActivityRegularization")
#: The element-wise operations a model may call on tensors instead of layers (``a + b``, ``x * 0.5``,
#: ``keras.ops.relu(x)``; Keras keeps them out of ``model.layers``), by their Keras class names.
OPERATIONS = ("Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Maximum", "Minimum", "Negative", "Abs", "Square",
              "Sqrt", "Exp", "Relu", "Relu6", "ReLU", "Gelu", "Silu", "Sigmoid", "HardSigmoid", "HardSilu", "Tanh",
              "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign")
#: The convolutions that run as ``ChannelShardedConv2D`` (a ``SeparableConv2D``'s pointwise part does).
CONVOLUTIONS = ("Conv2D", "SeparableConv2D")
class Pooling(tf.Module):
    """``MaxPooling2D`` or ``AveragePooling2D``, in the fastest form DTensor accepts for the input's layout.

    DTensor runs TensorFlow's own max pooling on whole channels and on a
    sharded batch, not on sharded channels, and has no layout rule for average
    pooling's gradient. So max pooling of sharded channels re-lays the batch
    over ``"model"`` for the native op and back (on a mesh without a
    ``"batch"`` axis, when the shards divide the batch); otherwise a window that
    tiles the image (window = strides) is a reshape and a reduction, and any
    other window the maximum or mean of its strided slices (docs/measurements/2026-12-01-zen4.md);
    with ``"same"`` padding, the mean divides by the image's values in each
    window, as Keras's does.
    """

    def __init__(self, layer, mesh, channels_sharded):
        super().__init__(name=module_name(layer.name))
        self.window, self.strides = tuple(layer.pool_size), tuple(layer.strides)
        self.padding = layer.padding
        self.max = isinstance(layer, keras.layers.MaxPooling2D)
        self.mesh, self.sharded = mesh, channels_sharded

    def __call__(self, x, training=False):
        if self.max and not self.sharded:
            return self._native(x)
        if self.max and "batch" not in self.mesh.dim_names and x.shape[0] % self.mesh.dim_size("model") == 0:
            batch_sharded = dtensor.Layout(["model", *[dtensor.UNSHARDED] * 3], self.mesh)
            y = self._native(dtensor.relayout(x, batch_sharded))
            return dtensor.relayout(y, activation_layout(self.mesh, y.shape, channels_sharded=True))
        (h, w), (kh, kw) = x.shape[1:3], self.window
        if self.window == self.strides and h % kh == 0 and w % kw == 0:
            tiles = tf.reshape(x, [-1, h // kh, kh, w // kw, kw, x.shape[-1]])
            return (tf.reduce_max if self.max else tf.reduce_mean)(tiles, axis=[2, 4])
        pads = [[0, 0], *same_padding((h, w), self.window, self.strides, self.padding), [0, 0]]
        padded = any(p for pair in pads for p in pair)
        if padded:
            x = tf.pad(x, pads, constant_values=-np.inf if self.max else 0)
        slices = windows(x, self.window, self.strides)
        if self.max:
            return functools.reduce(tf.math.maximum, slices)
        counts = tf.constant(self._counts((h, w), pads), x.dtype) if padded else len(slices)
        return functools.reduce(tf.math.add, slices) / counts

    def _counts(self, size, pads):
        """How many of the image's values each window holds: Keras's average pooling does not count padding."""
        return sum(windows(np.pad(np.ones((1, *size, 1)), pads), self.window, self.strides))

    def _native(self, x):
        return tf.nn.max_pool2d(x, self.window, self.strides, self.padding.upper())


class Padding(tf.Module):
    """``ZeroPadding2D``."""

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        self.padding = [[0, 0], *map(list, layer.padding), [0, 0]]

    def __call__(self, x, training=False):
        return tf.pad(x, self.padding)


class UpSampling(tf.Module):
    """``UpSampling2D`` (nearest): each pixel repeated ``size`` times, as a reshape and a broadcast, which keep the
    batch's and the channels' layout."""

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        require_settings(layer, "channel sharding", data_format="channels_last", interpolation="nearest")
        self.size = tuple(layer.size)

    def __call__(self, x, training=False):
        (batch, height, width, channels), (sh, sw) = x.shape, self.size
        repeated = tf.broadcast_to(tf.reshape(x, [batch, height, 1, width, 1, channels]),
                                   [batch, height, sh, width, sw, channels])
        return tf.reshape(repeated, [batch, height * sh, width * sw, channels])


class Cropping(tf.Module):
    """``Cropping2D``: a slice of the rows and columns, whatever the channels' or the batch's layout."""

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        (self.top, self.bottom), (self.left, self.right) = layer.cropping

    def __call__(self, x, training=False):
        height, width = x.shape[1:3]
        return x[:, self.top:height - self.bottom, self.left:width - self.right, :]


class Flatten(tf.Module):
    """``Flatten`` as a reshape, of channels gathered whole first where they are ``sharded`` (one that only Dense
    layers read is folded into them instead: :func:`folded_flattens`)."""

    def __init__(self, layer, mesh, sharded=False):
        super().__init__(name=module_name(layer.name))
        self.mesh, self.sharded = mesh, sharded

    def __call__(self, x, training=False):
        if self.sharded:
            x = dtensor.relayout(x, activation_layout(self.mesh, x.shape))
        return tf.reshape(x, [-1, math.prod(x.shape[1:])])


class Reshape(tf.Module):
    """A ``Reshape`` that adds or removes axes of size 1 before the channels, as a squeeze-and-excitation block's
    ``(c,)`` to ``(1, 1, c)``: the channels and the batch keep their layout. Any other reshape is refused."""

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        if not self.keeps_the_layout(layer):
            source, target = tuple(layer.input.shape[1:]), tuple(layer.target_shape)
            raise ValueError(f"channel sharding converts a Reshape that only adds or removes axes of size 1 before "
                             f"the channels (a squeeze-and-excitation block's), or one in the chain of weightless "
                             f"layers at the model's input (which runs on the host); layer {layer.name!r} reshapes "
                             f"{source} to {target}. Received: target_shape={target}")
        self.target = tuple(layer.target_shape)

    def __call__(self, x, training=False):
        return tf.reshape(x, [-1, *self.target])

    @staticmethod
    def keeps_the_layout(layer):
        """Whether the Keras ``Reshape`` ``layer`` only adds or removes axes of size 1 before the channels."""
        source, target = tuple(layer.input.shape[1:]), tuple(layer.target_shape)
        return [n for n in source if n != 1] == [n for n in target if n != 1] and source[-1:] == target[-1:]


class Dropout(tf.Module):
    """``Dropout`` (or ``SpatialDropout2D``) with a stateless random mask, seeded by the training step and the
    layer's position."""

    def __init__(self, layer, step, index):
        super().__init__(name=module_name(layer.name))
        self.rate, self.step, self.index = layer.rate, step, index
        #: None: a mask value per input value; else Keras's broadcast shape (SpatialDropout2D's: per channel).
        self.noise_shape = (None, 1, 1, None) if isinstance(layer, keras.layers.SpatialDropout2D) else \
            layer.noise_shape

    def __call__(self, x, training=False):
        if not training or self.rate == 0:
            return x
        seed = tf.stack([self.step.read_value(), tf.constant(self.index, tf.int64)])
        shape = x.shape if self.noise_shape is None else [n if n is not None else size
                                                           for n, size in zip(self.noise_shape, x.shape)]
        keep = tf.random.stateless_uniform(shape, seed) >= self.rate
        return tf.where(keep, x / (1.0 - self.rate), tf.zeros_like(x))


class Elementwise(tf.Module):
    """An activation layer; ``Softmax`` gathers sharded channels first (a batch split has them whole)."""

    def __init__(self, layer, mesh, batch_split=False):
        super().__init__(name=module_name(layer.name))
        self.layer, self.mesh, self.batch_split = layer, mesh, batch_split
        self.mixing = mixes_channels(layer)

    def __call__(self, x, training=False):
        if self.mixing:
            x = dtensor.relayout(x, activation_layout(self.mesh, x.shape, batch_split=self.batch_split))
        return self.layer.call(x)


class Merge(tf.Module):
    """An elementwise merge (``Add``, ``Subtract``, ``Multiply``, ``Average``, ``Maximum``, ``Minimum``), or an
    element-wise operation the model calls on tensors (one of ``OPERATIONS``, run by :func:`graph.call_operation`), of
    tensors with one layout: ``channels_sharded`` or ``batch_split`` (each input re-laid out to it)."""

    FUNCTIONS: typing.ClassVar = {
        "Add": tf.add_n, "Average": lambda xs: tf.add_n(xs) / len(xs),
        "Subtract": lambda xs: xs[0] - xs[1], "Multiply": lambda xs: functools.reduce(tf.multiply, xs),
        "Maximum": lambda xs: functools.reduce(tf.maximum, xs), "Minimum": lambda xs: functools.reduce(tf.minimum, xs)}

    def __init__(self, layer, mesh, channels_sharded, batch_split=False):
        super().__init__(name=module_name(layer.name))
        self.function = functools.partial(graph.call_operation, layer) if graph.is_operation(layer) else \
            self.FUNCTIONS[type(layer).__name__]
        self.mesh, self.sharded, self.batch_split = mesh, channels_sharded, batch_split

    def __call__(self, *xs, training=False):
        return self.function([dtensor.relayout(x, activation_layout(self.mesh, x.shape, self.sharded, self.batch_split))
                              for x in xs])


class Concatenate(tf.Module):
    """``Concatenate`` on the channel axis: the inputs' channels are gathered whole first, or, ``batch_split``,
    every input is split over the batch (whole channels on each device)."""

    def __init__(self, layer, mesh, batch_split=False):
        super().__init__(name=module_name(layer.name))
        rank = len(layer.output.shape)
        if layer.axis % rank != rank - 1:
            raise ValueError(f"channel sharding concatenates on the channel (last) axis only; layer {layer.name!r} "
                             f"has axis={layer.axis}. Received: axis={layer.axis}")
        self.mesh, self.batch_split = mesh, batch_split

    def __call__(self, *xs, training=False):
        return tf.concat([dtensor.relayout(x, activation_layout(self.mesh, x.shape, batch_split=self.batch_split))
                          for x in xs], axis=-1)


class GlobalPooling(tf.Module):
    """``GlobalAveragePooling2D`` or ``GlobalMaxPooling2D``: a mean or maximum over the spatial axes."""

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        self.reduce = tf.reduce_max if isinstance(layer, keras.layers.GlobalMaxPooling2D) else tf.reduce_mean
        self.keepdims = layer.keepdims

    def __call__(self, x, training=False):
        return self.reduce(x, axis=[1, 2], keepdims=self.keepdims)


class _Tensor(typing.NamedTuple):
    """What is known of a tensor before it runs: its channels sharded, a Flatten folded into it (the unflattened
    shape of one example), whether a gradient flows into it (something before it has weights), and whether it
    is split over the batch (``"model"`` on the batch axis, whole channels)."""

    sharded: bool
    folded: tuple | None
    differentiable: bool
    batch_split: bool = False


class _Node(typing.NamedTuple):
    """One layer call: the module that runs it (None: pass the input through), its input and output keys, and
    what is known of its output (a :class:`_Tensor`)."""

    op: tf.Module | None
    inputs: tuple
    output: object
    tensor: _Tensor
    activity_regularizer: object = None


def sharded_mode(layer, input_sharded, batch_axis=False, model_output=False, shards=2):
    """The mode of a built Conv2D, SeparableConv2D or Dense ``layer`` whose input channels are sharded or not, on
    a mesh with a ``"batch"`` axis or not, as the model's output or not, over ``shards`` model shards: the rule
    of the module docstring, and ``"whole"`` where the shards do not divide the channels that mode would shard.

    >>> conv, logits = keras.layers.Conv2D(8, 3), keras.layers.Dense(10, activation="softmax")
    >>> conv.build((None, 9, 9, 4)), logits.build((None, 6))
    (None, None)
    >>> sharded_mode(conv, input_sharded=True), sharded_mode(conv, input_sharded=True, batch_axis=True)
    ('column', 'row')
    >>> sharded_mode(logits, input_sharded=False)  # its output is gathered anyway: 10 units need not split
    'row'
    >>> sharded_mode(conv, input_sharded=False, shards=3), sharded_mode(logits, input_sharded=False, shards=4)
    ('whole', 'whole')
    """
    if type(layer).__name__ in CONVOLUTIONS:  # split batch (no "batch" axis) takes any layout
        mode = "row" if input_sharded and batch_axis else "column"
    else:
        mode = "row" if input_sharded or model_output or mixes_channels(layer) else "column"
    kernel = layer.pointwise_kernel if hasattr(layer, "pointwise_kernel") else layer.kernel
    return mode if kernel.shape[-1 if mode == "column" else -2] % shards == 0 else "whole"


def _mode(layer, first, batch_axis, model_output, shards):
    """:func:`sharded_mode` of a Conv2D, SeparableConv2D or Dense ``layer`` whose first input is ``first`` (a
    :class:`_Tensor`: split over the batch counts as sharded); None for any other layer."""
    if graph.is_operation(layer) or type(layer).__name__ not in (*CONVOLUTIONS, "Dense"):
        return None
    return sharded_mode(layer, first.sharded or first.batch_split, batch_axis, model_output, shards)


def output_tensor(layer, inputs, batch_axis=False, model_output=False, folds=False, shards=2):
    """What is known of ``layer``'s output (a :class:`_Tensor`) given what is known of its ``inputs``: the layout
    rule of the module docstring, without a mesh (``batch_axis``: whether the mesh has a ``"batch"`` axis;
    ``model_output``: whether it is the model's output; ``folds``: whether only Dense layers read it, see
    :func:`folded_flattens`; ``shards``: the mesh's model shards). A Conv2D on a mesh without ``"batch"`` leaves
    its output split over the batch; a Dense, or a Conv2D on a mesh with ``"batch"``, in column mode shards its
    output's channels, in row and whole mode returns them whole; a ``Conv2DTranspose`` of sharded channels shards
    its output's where the shards divide its filters; a merge or ``Concatenate`` is split over the batch if any
    input is, else a merge is sharded if any input is."""
    rule = LayoutRule(batch_axis, model_output, folds, shards)
    if graph.is_operation(layer):
        return _merge_layout(layer, inputs, rule)
    return KINDS.get(type(layer).__name__, PASS_THROUGH).layout(layer, inputs, rule)


class LayoutRule(typing.NamedTuple):
    """Where a layer's layout is decided: on a mesh with a ``"batch"`` axis or not, as the model's output or
    not, whether only Dense layers read its output (``folds``), over how many model ``shards``."""

    batch_axis: bool
    model_output: bool
    folds: bool
    shards: int


def _differentiable(inputs):
    return any(t.differentiable for t in inputs)


def _merge_layout(layer, inputs, rule):
    """A merge or an operation on tensors: split over the batch if any input is, else sharded if any input is."""
    batch_split = any(t.batch_split for t in inputs)
    return _Tensor(not batch_split and any(t.sharded for t in inputs), None, _differentiable(inputs), batch_split)


def _kernel_layout(layer, inputs, rule):
    """A Conv2D on a mesh without ``"batch"``: split over the batch; a Dense, or a Conv2D on a mesh with it: in
    column mode its output's channels sharded, in row and whole mode whole."""
    if type(layer).__name__ in CONVOLUTIONS and not rule.batch_axis:
        return _Tensor(False, None, True, batch_split=True)
    column = _mode(layer, inputs[0], rule.batch_axis, rule.model_output, rule.shards) == "column"
    return _Tensor(column and not mixes_channels(layer), None, True)


def _transpose_layout(layer, inputs, rule):
    """A ``Conv2DTranspose`` of sharded channels shards its output's where the shards divide its filters."""
    first = inputs[0]
    sharded = first.sharded and not mixes_channels(layer) and layer.filters % rule.shards == 0
    return _Tensor(sharded, None, True, first.batch_split)


def _per_channel_layout(layer, inputs, rule):
    """A layer with per-channel weights keeps its input's layout."""
    first = inputs[0]
    return _Tensor(first.sharded and not mixes_channels(layer), None, True, first.batch_split)


def _whole_channels_layout(layer, inputs, rule):
    """A layer that computes on whole channels (``GroupNormalization``) returns them whole."""
    return _Tensor(False, None, True, inputs[0].batch_split)


def _concatenate_layout(layer, inputs, rule):
    return _Tensor(False, None, _differentiable(inputs), any(t.batch_split for t in inputs))


def _flatten_layout(layer, inputs, rule):
    """A Flatten of sharded channels folds into the Dense layers that alone read it, else gathers them."""
    if not inputs[0].sharded:
        return _pass_through_layout(layer, inputs, rule)
    if rule.folds:
        return _Tensor(True, tuple(layer.input.shape[1:]), _differentiable(inputs))
    return _Tensor(False, None, _differentiable(inputs))


def _pass_through_layout(layer, inputs, rule):
    """A layer without weights keeps its input's layout (unless it mixes the channels)."""
    first = inputs[0]
    return _Tensor(first.sharded and not mixes_channels(layer), first.folded, _differentiable(inputs),
                   first.batch_split)


class ChannelLayout(typing.NamedTuple):
    """A layer's place under channel sharding: whether the channels of its first input and of its output are
    sharded, whether a gradient flows into its first input (something before it has weights), whether its
    first input and its output are split over the batch, and the mode of a Conv2D, SeparableConv2D or Dense
    (:func:`sharded_mode`; None for other layers)."""

    input_sharded: bool
    output_sharded: bool
    input_gradient: bool
    input_batch_split: bool = False
    output_batch_split: bool = False
    mode: str | None = None


def channel_layouts(model, batch_axis=False, shards=2):
    """``{layer name: ChannelLayout}`` for every layer of ``model``: the layouts :class:`ShardedModel` gives on a
    mesh with a ``"batch"`` axis or not (``batch_axis``) and ``shards`` model shards, without a mesh.

    >>> from keras_cnnpar import models
    >>> layouts = channel_layouts(models.cnn("2+2"))  # conv, pool, conv, pool, flatten, dense, dropout, dense
    >>> [layout.output_batch_split for layout in layouts.values()]
    [True, True, True, True, True, False, False, False]
    >>> [layout.output_sharded for layout in channel_layouts(models.cnn("2+2"), batch_axis=True).values()]
    [True, True, False, False, False, True, True, False]
    >>> [layout.input_gradient for layout in layouts.values()][:3]  # the first convolution reads the images
    [False, True, True]
    >>> [layout.mode for layout in channel_layouts(models.cnn("2+2"), shards=3).values() if layout.mode]
    ['whole', 'whole', 'whole', 'whole']
    """
    input_key, calls, output_key = layer_graph(model)
    tensors, layouts, folded = {input_key: _Tensor(False, None, False)}, {}, folded_flattens(calls, output_key)
    for layer, inputs, output in calls:
        tensors[output] = output_tensor(layer, [tensors[key] for key in inputs], batch_axis, output == output_key,
                                        output in folded, shards)
        first, out = tensors[inputs[0]], tensors[output]
        mode = _mode(layer, first, batch_axis, output == output_key, shards)
        layouts[layer.name] = ChannelLayout(first.sharded, out.sharded, first.differentiable, first.batch_split,
                                            out.batch_split, mode)
    return layouts


def folded_flattens(calls, output_key):
    """The output keys of the ``Flatten`` calls among ``calls`` whose output only Dense layers read, directly or
    through dropout and activations that keep the channels apart: a Flatten of sharded channels there is folded
    into those Dense layers (their kernels held as ``(h, w, c, units)``).

    >>> inputs = keras.Input((4, 4, 8))
    >>> features = keras.layers.Flatten(name="into_dense")(inputs)
    >>> head = keras.layers.Dense(10)(keras.layers.Dropout(0.5)(features))
    >>> logits = keras.layers.Flatten(name="at_the_output")(keras.layers.Reshape((1, 1, 10))(head))
    >>> read = layer_graph(keras.Model(inputs, logits))
    >>> [call.layer.name for call in read.calls if call.output in folded_flattens(read.calls, read.output)]
    ['into_dense']
    """
    readers = collections.defaultdict(list)
    for call in calls:
        for key in call.inputs:
            readers[key].append(call)

    def only_dense_reads(key):
        return key != output_key and bool(readers[key]) and all(
            type(call.layer).__name__ == "Dense" or (
                type(call.layer).__name__ in ("Dropout", *ELEMENTWISE) and not graph.is_operation(call.layer)
                and not mixes_channels(call.layer) and only_dense_reads(call.output))
            for call in readers[key])

    return {call.output for call in calls if type(call.layer).__name__ == "Flatten" and only_dense_reads(call.output)}


def host_prefix(calls, input_key):
    """How many of a graph's first ``calls`` run on the host, before the mesh: the chain from the input
    (``input_key``) of weightless layers, each the only reader of the tensor before it, up to the last one that
    channel sharding cannot convert (augmentation such as ``RandomFlip``); 0 where there is none.

    >>> model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.RandomFlip(), keras.layers.Rescaling(0.5),
    ...                           keras.layers.Conv2D(2, 3)])
    >>> read = layer_graph(model)
    >>> host_prefix(read.calls, read.input)  # Rescaling, which the mesh runs, stays there
    1
    """
    readers = collections.Counter(key for call in calls for key in call.inputs)
    key, count = input_key, 0
    for index, call in enumerate(calls, 1):
        if call.inputs != (key,) or readers[key] > 1 or getattr(call.layer, "weights", ()):
            break
        if not runs_on_the_mesh(call.layer):
            count = index
        key = call.output
    return count


def runs_on_the_mesh(layer):
    """Whether channel sharding converts ``layer``: a kind it supports, and a ``Reshape`` that keeps the layout.

    >>> model = keras.Sequential([keras.Input((784,)), keras.layers.Reshape((28, 28, 1)), keras.layers.Flatten()])
    >>> [runs_on_the_mesh(layer) for layer in model.layers]  # the Reshape runs on the host
    [False, True]
    """
    kind = type(layer).__name__
    if graph.is_operation(layer):
        return kind in OPERATIONS
    return kind in SUPPORTED and (kind != "Reshape" or Reshape.keeps_the_layout(layer))


def layer_graph(model):
    """The :class:`graph.Graph` of ``model`` that channel sharding can convert; a ``TypeError`` says why not.

    >>> inputs = keras.Input((4,))
    >>> hidden = keras.layers.Dense(3, name="hidden")(inputs)
    >>> [call.layer.name for call in layer_graph(keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))).calls]
    ['hidden', 'out']
    """
    if not graph.is_graph(model):  # a subclassed model: no graph to read
        raise TypeError("channel sharding rebuilds a model's graph of layers: a keras.Sequential or a functional "
                        f"model. Received: model of type {type(model).__name__}")
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise TypeError(f"channel sharding rebuilds a model with one input and one output. Received: model "
                        f"{model.name!r} with {len(model.inputs)} inputs and {len(model.outputs)} outputs")
    read = graph.read(model)
    for call in read.calls:
        if graph.is_operation(call.layer) and type(call.layer).__name__ not in OPERATIONS:
            raise TypeError(f"channel sharding converts layers, and element-wise operations on tensors "
                            f"({', '.join(OPERATIONS)}); the model calls the operation {type(call.layer).__name__} "
                            f"({call.layer.name!r}) on tensors: use a layer instead, for example "
                            f"keras.layers.GlobalAveragePooling2D() for keras.ops.mean(x, axis=(1, 2)). Received: "
                            f"operation {call.layer.name!r}")
    if read.shared_layers():
        raise TypeError(f"channel sharding converts each layer once; the model calls {read.shared_layers()} more "
                        f"than once (shared weights). Received: model {model.name!r}")
    return read


class ShardedModel(tf.Module):
    """A Keras CNN (``Sequential`` or functional) on ``mesh``; its weights are DVariables, taken from the model.

    Args:
        model: a built ``keras.Sequential`` or functional model of the layers in ``SUPPORTED``.
        mesh: a DTensor mesh with a ``"model"`` axis, and optionally ``"batch"``.
        compute_dtype: None (each layer computes in its Keras layer's dtype), or
            ``"bfloat16"`` for mixed precision: every sharded layer but the
            last one, which makes the output, computes in it.
        sync_batchnorm: BatchNormalization statistics over the global batch
            (True) or over each ``"batch"`` replica's slice of it.
    """

    def __init__(self, model, mesh, compute_dtype=None, sync_batchnorm=True):
        super().__init__(name=module_name(model.name))
        self.mesh, self.sync_batchnorm = mesh, sync_batchnorm
        self.step = dtensor.DVariable(to_mesh(np.int64(0), dtensor.Layout.replicated(mesh, 0)), name="step")
        self.input_key, calls, self.output_key = layer_graph(model)
        on_host = host_prefix(calls, self.input_key)
        #: The weightless layers at the model's input that the mesh cannot run (augmentation such as
        #: ``RandomFlip``): :meth:`preprocess` runs them on the host, Keras's own layers with their seeds.
        self.preprocessing = [call.layer for call in calls[:on_host]]
        if on_host:
            self.input_key, calls = calls[on_host - 1].output, calls[on_host:]
        self._preprocess = {training: tf.function(functools.partial(self._run_preprocessing, training=training),
                                                 autograph=False)
                            for training in (False, True)}
        tensors, folded = {self.input_key: _Tensor(False, None, False)}, folded_flattens(calls, self.output_key)
        self.nodes, converted = [], {}
        for index, (layer, inputs, output) in enumerate(calls):
            op, tensors[output] = self._convert(layer, index, [tensors[key] for key in inputs], output,
                                                output in folded)
            self.nodes.append(_Node(op, inputs, output, tensors[output], getattr(layer, "activity_regularizer", None)))
            converted[id(layer)] = op
        #: The modules with weights, in the Keras model's weight order.
        self.weighted = [converted[id(layer)] for layer in graph.weight_order(model)
                         if isinstance(converted.get(id(layer)), WeightedModule)
                         and converted[id(layer)].variables_in_order]
        output_layer = self.sharded_layers[-1:]
        for module in self.weighted if compute_dtype else ():
            if hasattr(module, "compute_dtype") and module not in output_layer:
                module.compute_dtype = tf.as_dtype(compute_dtype)

    def _convert(self, layer, index, inputs, output_key, folds):
        """The module that runs ``layer`` on tensors like ``inputs``, and what is known of its output (``folds``:
        a Flatten that only Dense layers read)."""
        kind, batch_axis, shards = type(layer).__name__, "batch" in self.mesh.dim_names, self.mesh.dim_size("model")
        if graph.is_operation(layer):  # an element-wise one (layer_graph checked)
            output = output_tensor(layer, inputs, batch_axis)
            return _merge(layer, Conversion(self.mesh, self.step, self.sync_batchnorm, index, inputs, output)), output
        if kind not in SUPPORTED:
            raise ValueError(f"channel sharding cannot convert layer {layer.name!r} of type {kind}; the supported "
                             f"layers are {', '.join(SUPPORTED)}, and at the model's input, before them, any layer "
                             f"without weights (augmentation such as RandomFlip, which runs on the host). "
                             f"Received: layer={layer.name!r} ({kind})")
        model_output = output_key == self.output_key
        output = output_tensor(layer, inputs, batch_axis, model_output, folds, shards)
        conversion = Conversion(self.mesh, self.step, self.sync_batchnorm, index, inputs, output,
                                _mode(layer, inputs[0], batch_axis, model_output, shards))
        return KINDS[kind].convert(layer, conversion), output

    @property
    def sharded_layers(self):
        """The sharded Conv2D and Dense layers, in the model's layer order."""
        return [layer for layer in self.weighted if isinstance(layer, ShardedLayer)]

    @property
    def weights(self):
        """All DVariables in the Keras model's weight order (``model.weights``)."""
        return [v for layer in self.weighted for v in layer.variables_in_order]

    @property
    def trainable_weights(self):
        """The trainable DVariables in the Keras model's order (``model.trainable_weights``)."""
        return [v for layer in self.weighted for v in layer.trainable_in_order]

    @property
    def constrained(self):
        """Whether any weight has a Keras constraint."""
        return any(c is not None for layer in self.weighted for c in layer.constraints)

    def apply_constraints(self):
        """Project every weight with its Keras constraint (``kernel_constraint`` and kin), as Keras's optimizer does
        after each update."""
        for layer in self.weighted:
            layer.apply_constraints()

    def get_weights(self):
        """Numpy weights in the Keras model's order and shapes."""
        return [w for layer in self.weighted for w in layer.get_weights()]

    def set_weights(self, weights):
        """Load weights given in the Keras model's order and shapes."""
        weights = list(weights)
        for layer in self.weighted:
            count = len(layer.variables_in_order)
            layer.set_weights(weights[:count])
            weights = weights[count:]

    def preprocess(self, x, training=False):
        """A batch of images (local, not on the mesh) through :attr:`preprocessing`, on the host: what the mesh
        takes. The random layers draw from their Keras seed generators, once per training batch, as in
        Keras's ``fit``."""
        return self._preprocess[training](x) if self.preprocessing else x

    def _run_preprocessing(self, x, training):
        for layer in self.preprocessing:  # an operation on tensors (``x / 255.0``) among them takes no training
            x = graph.call_operation(layer, [x]) if graph.is_operation(layer) else layer(x, training=training)
        return x

    def __call__(self, x, training=False):
        """Preprocessed images in (:meth:`preprocess`), probabilities out; the batch is split over ``"batch"`` when
        it splits evenly."""
        return self.call_with_losses(x, training)[0]

    def call_with_losses(self, x, training=False):
        """What ``__call__`` returns, and the Keras model's ``losses`` of this call: its weight regularizers and
        its layers' activity regularizers (each divided by the batch size, as Keras does)."""
        losses = [loss for layer in self.weighted for loss in layer.regularization_losses()]
        values = {self.input_key: dtensor.relayout(x, activation_layout(self.mesh, x.shape))}
        for node in self.nodes:
            inputs = [values[key] for key in node.inputs]
            if node.op is None:
                y = inputs[0]
            else:
                y = node.op(*inputs, training=training)
                y = relayout_keeping_logits(y, activation_layout(self.mesh, y.shape, node.tensor.sharded,
                                                                 node.tensor.batch_split))
            values[node.output] = y
            if node.activity_regularizer is not None:
                losses.append(node.activity_regularizer(y) / y.shape[0])
        if training:
            self.step.assign_add(1)
        y = values[self.output_key]
        return relayout_keeping_logits(y, activation_layout(self.mesh, y.shape)), losses

    def forward(self, x):
        """The model on numpy images (inference), as numpy probabilities."""
        x = self.preprocess(x)
        on_mesh = to_mesh(x, dtensor.Layout.replicated(self.mesh, np.ndim(x)))
        return to_numpy(tf.function(self.__call__, autograph=False)(on_mesh))

    def report(self):
        """A table of each layer with weights: its mode, weight layout and parameter bytes per device."""
        width = max([14, *(len(layer.name) + 2 for layer in self.weighted)])
        lines = [f"mesh {dict(zip(self.mesh.dim_names, self.mesh.shape()))} over {self.mesh.num_local_devices()} "
                 f"devices: {', '.join(self.mesh.local_devices())}",
                 f"{'layer':<{width}}{'mode':<9}{'kernel shape':<20}{'kernel layout (- whole)':<26}"
                 f"{'bytes/device':>13}"]
        for layer in self.weighted:
            first = layer.variables_in_order[0]
            layout = "(" + ", ".join("-" if axis == dtensor.UNSHARDED else axis
                                     for axis in dtensor.fetch_layout(first).sharding_specs) + ")"
            lines.append(f"{layer.name:<{width}}{layer.mode:<9}{tuple(first.shape)!s:<20}{layout:<26}"
                         f"{sum(bytes_per_device(v) for v in layer.variables_in_order):>13,}")
        total = sum(4 * math.prod(v.shape) for v in self.weights)
        per_device = sum(map(bytes_per_device, self.weights))
        lines.append(f"parameters: {total:,} bytes in all, {per_device:,} bytes per device")
        return "\n".join(lines)


#: The old name of ``ShardedModel``, from when it took only ``keras.Sequential`` models.
ShardedSequential = ShardedModel


def relayout_keeping_logits(y, layout):
    """``dtensor.relayout(y, layout)`` that keeps the logits Keras's softmax and sigmoid attach to their output.

    Keras's crossentropy losses compute from those logits (``_keras_logits``) where the probabilities came from a
    softmax or sigmoid: exact where probabilities round to 0 or 1. A relayout of the probabilities alone loses them;
    the loss then clips the probabilities to ``[1e-7, 1 - 1e-7]``, which changes the loss and zeroes the gradient of
    every example past the clip (inputs left unscaled, or a confident wrong prediction late in training).
    """
    moved = dtensor.relayout(y, layout)
    logits = getattr(y, "_keras_logits", None)
    if logits is not None:
        moved._keras_logits = dtensor.relayout(logits, layout)
    return moved


def bytes_per_device(variable):
    """Bytes of ``variable``'s shard on one device."""
    layout = dtensor.fetch_layout(variable)
    shards = math.prod(layout.mesh.dim_size(s) for s in layout.sharding_specs if s != dtensor.UNSHARDED)
    return variable.dtype.size * math.prod(variable.shape) // shards


class Conversion(typing.NamedTuple):
    """What a layer kind's converter knows of the layer's place: the mesh, the model's step counter (for
    dropout), whether BatchNormalization syncs its statistics, the layer's index, what is known of its
    inputs and output, and the mode of a Conv2D, SeparableConv2D or Dense."""

    mesh: object
    step: object
    sync_batchnorm: bool
    index: int
    inputs: list
    output: _Tensor
    mode: str | None = None

    @property
    def first(self):
        return self.inputs[0]


def _convolution(layer, c):
    if type(layer).__name__ == "Conv2D":
        op = ChannelShardedConv2D(layer, c.mesh, c.mode)
    else:
        op = ShardedSeparableConv2D(layer, c.mesh, c.mode, c.first.sharded)
    op.input_gradient = _differentiable(c.inputs)
    op.batch_split_output = c.output.batch_split
    return op


def _merge(layer, c):
    return Merge(layer, c.mesh, c.output.sharded, c.output.batch_split)


class LayerKind(typing.NamedTuple):
    """One kind of Keras layer under channel sharding, its two rules side by side: ``layout(layer, inputs,
    rule)``, what is known of its output (a :class:`_Tensor`) from its inputs' (:func:`output_tensor`), and
    ``convert(layer, conversion)``, the module that runs it on the mesh (None: folded into what reads it)."""

    layout: typing.Callable
    convert: typing.Callable


#: A layer without weights that keeps its input's layout (element-wise ones).
PASS_THROUGH = LayerKind(_pass_through_layout, lambda layer, c: Elementwise(layer, c.mesh, c.first.batch_split))
_PER_CHANNEL = {
    "BatchNormalization":
        lambda layer, c: ShardedBatchNormalization(layer, c.mesh, c.first.sharded, c.sync_batchnorm),
    "LayerNormalization": lambda layer, c: ShardedLayerNormalization(layer, c.mesh, c.first.sharded),
    "RMSNormalization": lambda layer, c: ShardedLayerNormalization(layer, c.mesh, c.first.sharded),
}
_KEEPING_LAYOUT = {
    "MaxPooling2D": lambda layer, c: Pooling(layer, c.mesh, c.first.sharded),
    "AveragePooling2D": lambda layer, c: Pooling(layer, c.mesh, c.first.sharded),
    "GlobalAveragePooling2D": lambda layer, c: GlobalPooling(layer),
    "GlobalMaxPooling2D": lambda layer, c: GlobalPooling(layer),
    "ZeroPadding2D": lambda layer, c: Padding(layer),
    "Cropping2D": lambda layer, c: Cropping(layer),
    "UpSampling2D": lambda layer, c: UpSampling(layer),
}
#: Every layer kind channel sharding converts, by Keras class name: its layout rule and its converter.
KINDS = {
    "Conv2D": LayerKind(_kernel_layout, _convolution),
    "Dense": LayerKind(_kernel_layout,
                       lambda layer, c: ShardedDense(layer, c.mesh, c.mode, input_shape=c.first.folded)),
    **{kind: LayerKind(_per_channel_layout, convert) for kind, convert in _PER_CHANNEL.items()},
    "GroupNormalization": LayerKind(_whole_channels_layout,
                                    lambda layer, c: ShardedGroupNormalization(layer, c.mesh, c.first.batch_split)),
    "DepthwiseConv2D": LayerKind(_per_channel_layout,
                                 lambda layer, c: ShardedDepthwiseConv2D(layer, c.mesh, c.first.sharded)),
    "SeparableConv2D": LayerKind(_kernel_layout, _convolution),
    "Conv2DTranspose": LayerKind(_transpose_layout, lambda layer, c: ShardedConv2DTranspose(
        layer, c.mesh, c.first.sharded, c.first.batch_split, c.output.sharded)),
    "Normalization": LayerKind(_per_channel_layout,
                               lambda layer, c: ShardedNormalization(layer, c.mesh, c.first.sharded)),
    **{kind: LayerKind(_pass_through_layout, convert) for kind, convert in _KEEPING_LAYOUT.items()},
    "Flatten": LayerKind(_flatten_layout, lambda layer, c: None if c.output.folded is not None
                         else Flatten(layer, c.mesh, c.first.sharded)),
    "Reshape": LayerKind(_pass_through_layout, lambda layer, c: Reshape(layer)),
    "Dropout": LayerKind(_pass_through_layout, lambda layer, c: Dropout(layer, c.step, c.index)),
    "SpatialDropout2D": LayerKind(_pass_through_layout, lambda layer, c: Dropout(layer, c.step, c.index)),
    **dict.fromkeys(ELEMENTWISE, PASS_THROUGH),
    **{kind: LayerKind(_merge_layout, _merge) for kind in ("Add", "Subtract", "Multiply", "Average", "Maximum",
                                                         "Minimum")},
    "Concatenate": LayerKind(_concatenate_layout, lambda layer, c: Concatenate(layer, c.mesh, c.output.batch_split)),
}
SUPPORTED = tuple(KINDS)
