"""A Keras ``Sequential`` CNN rebuilt on a DTensor mesh: sharded Conv2D/Dense, and the layers between them.

Sharded layers alternate between column and row mode, starting with column:
a layer whose input channels are sharded runs in row mode, else in column
mode. Pooling, padding, dropout and activations keep the layout they get. A
``Flatten`` of sharded channels is folded into the ``Dense`` after it, which
then holds its kernel as ``(h, w, c, units)`` sharded on ``c``. The output of
the model always has whole channels.

Example:

>>> import keras, numpy as np
>>> from tensorflow.experimental import dtensor
>>> from keras_cnnpar import devices, models
>>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
>>> model = models.cnn("2+2")
>>> sharded = ShardedSequential(model, mesh)
>>> [(type(layer).__name__, layer.mode) for layer in sharded.sharded_layers]  # doctest: +NORMALIZE_WHITESPACE
[('ChannelShardedConv2D', 'column'), ('ChannelShardedConv2D', 'row'),
 ('ShardedDense', 'column'), ('ShardedDense', 'row')]
>>> x = np.random.default_rng(0).random((2, 28, 28, 1), dtype="float32")
>>> bool(np.allclose(sharded.forward(x), model.predict(x, verbose=0), atol=1e-5))
True
"""

import math

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_cnnpar.sharded.layers import (
    CHANNEL_MIXING,
    ChannelShardedConv2D,
    ShardedDense,
    ShardedLayer,
    activation_layout,
    same_padding,
    to_mesh,
    to_numpy,
    windows,
)

SUPPORTED = ("Conv2D", "Dense", "MaxPooling2D", "AveragePooling2D", "ZeroPadding2D", "Flatten", "Dropout",
             "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax")


class Pooling(tf.Module):
    """``MaxPooling2D`` or ``AveragePooling2D`` as the maximum or mean of the window's strided slices."""

    def __init__(self, layer):
        super().__init__(name=layer.name)
        self.window, self.strides = tuple(layer.pool_size), tuple(layer.strides)
        self.padding = layer.padding
        if self.padding != "valid" and not isinstance(layer, keras.layers.MaxPooling2D):
            raise ValueError(f"channel sharding supports AveragePooling2D with padding='valid' only; layer "
                             f"{layer.name!r} has padding={layer.padding!r}. Received: padding={layer.padding!r}")
        self.reduce = tf.math.maximum if isinstance(layer, keras.layers.MaxPooling2D) else tf.math.add
        self.mean = not isinstance(layer, keras.layers.MaxPooling2D)

    def __call__(self, x, training=False):
        pads = same_padding(x.shape[1:3], self.window, self.strides, self.padding)
        if any(p for pair in pads for p in pair):
            x = tf.pad(x, [[0, 0], *pads, [0, 0]], constant_values=-np.inf)
        slices = windows(x, self.window, self.strides)
        out = slices[0]
        for piece in slices[1:]:
            out = self.reduce(out, piece)
        return out / len(slices) if self.mean else out


class Padding(tf.Module):
    """``ZeroPadding2D``."""

    def __init__(self, layer):
        super().__init__(name=layer.name)
        self.padding = [[0, 0], *map(list, layer.padding), [0, 0]]

    def __call__(self, x, training=False):
        return tf.pad(x, self.padding)


class Flatten(tf.Module):
    """``Flatten`` of whole channels (a reshape); a ``Flatten`` of sharded channels is folded into the next Dense."""

    def __init__(self, layer):
        super().__init__(name=layer.name)

    def __call__(self, x, training=False):
        return tf.reshape(x, [-1, math.prod(x.shape[1:])])


class Dropout(tf.Module):
    """``Dropout`` with a stateless random mask, seeded by the training step and the layer's position."""

    def __init__(self, layer, step, index):
        super().__init__(name=layer.name)
        self.rate, self.step, self.index = layer.rate, step, index

    def __call__(self, x, training=False):
        if not training or self.rate == 0:
            return x
        seed = tf.stack([self.step.read_value(), tf.constant(self.index, tf.int64)])
        keep = tf.random.stateless_uniform(tf.shape(x), seed) >= self.rate
        return tf.where(keep, x / (1.0 - self.rate), tf.zeros_like(x))


class Elementwise(tf.Module):
    """An activation layer; ``Softmax`` gathers the channels first."""

    def __init__(self, layer, mesh):
        super().__init__(name=layer.name)
        self.layer, self.mesh = layer, mesh
        self.mixing = isinstance(layer, keras.layers.Softmax) or (
            isinstance(layer, keras.layers.Activation)
            and keras.activations.serialize(layer.activation) in CHANNEL_MIXING)

    def __call__(self, x, training=False):
        if self.mixing:
            x = dtensor.relayout(x, activation_layout(self.mesh, x.shape))
        return self.layer.call(x)


def chain_layers(model):
    """The layers of ``model`` in order, if it is a chain: a ``keras.Sequential``, or a functional model in
    which every layer takes the previous layer's output; else a ``TypeError`` that names the first branch.

    >>> inputs = keras.Input((4,))
    >>> hidden = keras.layers.Dense(3, name="hidden")(inputs)
    >>> [layer.name for layer in chain_layers(keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden)))]
    ['hidden', 'out']
    """
    if isinstance(model, keras.Sequential):
        return list(model.layers)
    if not hasattr(model, "_operations"):  # a subclassed model: no graph to read
        raise TypeError("channel sharding rebuilds a chain of layers: a keras.Sequential, or a functional model "
                        f"without branches. Received: model of type {type(model).__name__}")
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    previous = None
    for layer in layers:
        sources = [tensor._keras_history.operation for node in layer._inbound_nodes
                   for tensor in keras.tree.flatten(node.input_tensors)]
        expected = [previous] if previous is not None else None
        if len(sources) != 1 or (expected is not None and sources != expected) or \
                (expected is None and not isinstance(sources[0], keras.layers.InputLayer)):
            raise TypeError(f"channel sharding rebuilds a chain of layers (a keras.Sequential, or a functional model "
                            f"without branches); layer {layer.name!r} takes "
                            f"{[source.name for source in sources]}, not only the layer before it. "
                            f"Received: model {model.name!r} of type {type(model).__name__}")
        previous = layer
    if len(model.outputs) != 1 or model.outputs[0]._keras_history.operation is not previous:
        raise TypeError(f"channel sharding rebuilds a chain of layers whose last layer makes the model's one output. "
                        f"Received: model {model.name!r} with outputs {[t.name for t in model.outputs]}")
    return layers


class ShardedSequential(tf.Module):
    """A ``keras.Sequential`` CNN on ``mesh``; its weights are DVariables, taken from the Keras model.

    Args:
        model: a built ``keras.Sequential``, or functional chain, of the layers in ``SUPPORTED``.
        mesh: a DTensor mesh with a ``"model"`` axis, and optionally ``"batch"``.
        compute_dtype: the dtype of the sharded layers' arithmetic, ``"float32"`` or
            ``"bfloat16"`` (mixed precision); the last one, which makes the
            output, always computes in float32.
    """

    def __init__(self, model, mesh, compute_dtype="float32"):
        super().__init__(name=model.name)
        chain = chain_layers(model)
        self.mesh = mesh
        self.step = dtensor.DVariable(to_mesh(np.int64(0), dtensor.Layout.replicated(mesh, 0)), name="step")
        self.layers = []
        sharded, folded = False, None
        for index, layer in enumerate(chain):
            op = self._convert(layer, index, sharded, folded)
            if isinstance(layer, keras.layers.Flatten) and sharded:
                folded = tuple(layer.input.shape[1:])
            if isinstance(op, ShardedLayer):
                sharded, folded = op.output_sharded(), None
            elif isinstance(op, Elementwise) and op.mixing:
                sharded = False
            if op is not None:
                self.layers.append(op)
        if self.sharded_layers and isinstance(self.sharded_layers[0], ChannelShardedConv2D):
            self.sharded_layers[0].input_gradient = False  # nothing before it has weights
        for layer in self.sharded_layers[:-1]:
            layer.compute_dtype = tf.as_dtype(compute_dtype)

    def _convert(self, layer, index, sharded, folded):
        mode = "row" if sharded else "column"
        kind = type(layer).__name__
        if kind not in SUPPORTED:
            raise ValueError(f"channel sharding cannot convert layer {layer.name!r} of type {kind}; the supported "
                             f"layers are {', '.join(SUPPORTED)}. Received: layer={layer.name!r} ({kind})")
        if kind == "Conv2D":
            return ChannelShardedConv2D(layer, self.mesh, mode)
        if kind == "Dense":
            return ShardedDense(layer, self.mesh, mode, input_shape=folded)
        if kind in ("MaxPooling2D", "AveragePooling2D"):
            return Pooling(layer)
        if kind == "ZeroPadding2D":
            return Padding(layer)
        if kind == "Flatten":
            return None if sharded else Flatten(layer)
        if kind == "Dropout":
            return Dropout(layer, self.step, index)
        return Elementwise(layer, self.mesh)

    @property
    def sharded_layers(self):
        return [layer for layer in self.layers if isinstance(layer, ShardedLayer)]

    @property
    def weights(self):
        """The DVariables in the Keras model's weight order."""
        return [v for layer in self.sharded_layers for v in layer.variables_in_order]

    def get_weights(self):
        """Numpy weights in the Keras model's order and shapes."""
        return [w for layer in self.sharded_layers for w in layer.get_weights()]

    def set_weights(self, weights):
        """Load weights given in the Keras model's order and shapes."""
        weights = list(weights)
        for layer in self.sharded_layers:
            count = len(layer.variables_in_order)
            layer.set_weights(weights[:count])
            weights = weights[count:]

    def __call__(self, x, training=False):
        """Images in, probabilities out; the batch is split over ``"batch"`` when it splits evenly."""
        x = dtensor.relayout(x, activation_layout(self.mesh, x.shape))
        for layer in self.layers:
            x = layer(x, training=training)
        if training:
            self.step.assign_add(1)
        return dtensor.relayout(x, activation_layout(self.mesh, x.shape))

    def forward(self, x):
        """The model on numpy images (inference), as numpy probabilities."""
        return to_numpy(tf.function(self.__call__)(to_mesh(x, dtensor.Layout.replicated(self.mesh, np.ndim(x)))))

    def report(self):
        """A table of each sharded layer's mode, kernel layout and parameter bytes per device."""
        lines = [f"mesh {dict(zip(self.mesh.dim_names, self.mesh.shape()))} over {self.mesh.num_local_devices()} "
                 f"devices: {', '.join(self.mesh.local_devices())}",
                 f"{'layer':<14}{'mode':<8}{'kernel shape':<20}{'kernel layout (- whole)':<26}{'bytes/device':>13}"]
        for layer in self.sharded_layers:
            layout = "(" + ", ".join("-" if axis == dtensor.UNSHARDED else axis for axis in layer.kernel_layout) + ")"
            lines.append(f"{layer.name:<14}{layer.mode:<8}{tuple(layer.kernel.shape)!s:<20}{layout:<26}"
                         f"{sum(bytes_per_device(v) for v in layer.variables_in_order):>13,}")
        total = sum(4 * math.prod(v.shape) for v in self.weights)
        per_device = sum(map(bytes_per_device, self.weights))
        lines.append(f"parameters: {total:,} bytes in all, {per_device:,} bytes per device")
        return "\n".join(lines)


def bytes_per_device(variable):
    """Bytes of ``variable``'s shard on one device."""
    layout = dtensor.fetch_layout(variable)
    shards = math.prod(layout.mesh.dim_size(s) for s in layout.sharding_specs if s != dtensor.UNSHARDED)
    return variable.dtype.size * math.prod(variable.shape) // shards
