"""Channel-sharded Conv2D and Dense on a DTensor mesh, and the layers that pass layouts through.

Activations are channels-last. Their first axis is sharded over the mesh axis
``"batch"`` when the mesh has one; their last axis (the channels or features)
is either whole or sharded over the mesh axis ``"model"``; on a mesh without
``"batch"`` a convolution's output may instead keep the batch split over
``"model"`` (``activation_layout``'s ``batch_split``). A sharded layer in
``"column"`` mode shards its kernel on output channels: it takes whole
channels and returns sharded ones. In ``"row"`` mode it shards its kernel on
input channels: it takes sharded channels, each device computes a partial
sum, and DTensor all-reduces them into whole channels. Alternating the two,
as Megatron pairs its layers, needs no all-gather between layers.

DTensor's own convolution refuses a sharded filter; it accepts a replicated
filter with a sharded batch, and so do its gradient ops. A sharded
convolution therefore runs in one of three forms (``ChannelShardedConv2D.
formulation``): TensorFlow's convolution on each device's slice of the batch
with the kernel gathered for the step (``conv_on_split_batch``), the kernel
gradient op with the roles of batch and channels swapped
(``conv_as_filter_gradient``), or a matmul over the stacked kernel windows
(im2col, ``conv_as_matmul``), which works on any layout.

These are ``tf.Module``s, not Keras layers: Keras 3 cannot hold DTensor
variables. Each one is built from its Keras twin, whose weights it takes, and
gives them back in Keras's shapes with ``get_weights()``.

Example:

>>> import keras, numpy as np
>>> from tensorflow.experimental import dtensor
>>> from keras_cnnpar import devices
>>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
>>> conv = keras.layers.Conv2D(4, 3, padding="same")
>>> x = np.random.default_rng(0).random((2, 8, 8, 3), dtype="float32")
>>> reference = conv(x).numpy()
>>> sharded = ChannelShardedConv2D(conv, mesh, mode="column")
>>> sharded.kernel_layout
('unsharded', 'unsharded', 'unsharded', 'model')
>>> bool(np.allclose(sharded.forward(x), reference, atol=1e-5))
True
"""

import math
import re

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

UNSHARDED = dtensor.UNSHARDED
#: Column mode shards the output channels, row mode the input channels; ``"whole"`` keeps the kernel whole on every
#: device, for a layer whose channels the shards do not divide (``sharded.model.sharded_mode``).
MODES = ("column", "row", "whole")
#: Activations that mix the channels, so they run on whole channels.
CHANNEL_MIXING = {"softmax", "log_softmax"}


def activation_layout(mesh, shape, channels_sharded=False, batch_split=False):
    """The layout of an activation of ``shape``: channels whole or sharded over ``"model"``, and the batch
    over ``"batch"`` when the mesh has that axis and the batch splits evenly (else every replica computes all).
    ``batch_split`` (a mesh without ``"batch"``): the batch over ``"model"`` with whole channels, where the
    shards divide the batch; else the whole tensor on every device."""
    if batch_split:
        split = "model" if shape[0] % mesh.dim_size("model") == 0 else UNSHARDED
        return dtensor.Layout([split, *[UNSHARDED] * (len(shape) - 1)], mesh)
    batches = mesh.dim_size("batch") if "batch" in mesh.dim_names else 0
    batch = "batch" if batches and shape[0] % batches == 0 else UNSHARDED
    rest = [UNSHARDED] * (len(shape) - 1)
    if channels_sharded:
        rest[-1] = "model"
    return dtensor.Layout([batch, *rest], mesh)


def mixes_channels(layer):
    """Whether ``layer`` computes across the channels (a softmax, a unit normalization), so it runs on whole
    channels.

    >>> mixes_channels(keras.layers.Dense(10, activation="softmax")), mixes_channels(keras.layers.ReLU())
    (True, False)
    """
    name = keras.activations.serialize(layer.activation) if hasattr(layer, "activation") else None
    return (isinstance(layer, keras.layers.Softmax | keras.layers.UnitNormalization)
            or (isinstance(name, str) and name in CHANNEL_MIXING))


def to_mesh(value, layout):
    """A DTensor of ``value`` (numpy or a local tensor) laid out as ``layout``."""
    whole = dtensor.copy_to_mesh(tf.convert_to_tensor(value), dtensor.Layout.replicated(layout.mesh, layout.rank))
    return whole if layout.is_fully_replicated() else dtensor.relayout(whole, layout)


def to_numpy(value):
    """The whole value of a DTensor (any layout) as numpy."""
    layout = dtensor.fetch_layout(value)
    return dtensor.unpack(dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank)))[0].numpy()


def divisors(n):
    """The positive divisors of ``n``.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def module_name(keras_name):
    """A ``tf.Module`` name for a Keras layer's or model's name, which may hold characters (a dot, a dash) that
    a module's may not (``keras.applications.MobileNetV2`` names itself ``mobilenetv2_1.00_224``).

    >>> module_name("mobilenetv2_1.00_224"), module_name("2nd-conv"), module_name("conv")
    ('mobilenetv2_1_00_224', '_2nd_conv', 'conv')
    """
    name = re.sub(r"\W", "_", keras_name)
    return name if name.isidentifier() else f"_{name}"


def require_settings(layer, converter, **wanted):
    """Raise a ``ValueError`` naming ``layer`` and the setting of its config that is not the one ``wanted``, the
    only one ``converter`` supports.

    >>> dilated = keras.layers.Conv2D(4, 3, dilation_rate=2, name="dilated")
    >>> require_settings(dilated, "ChannelShardedConv2D", dilation_rate=(1, 1))
    Traceback (most recent call last):
    ...
    ValueError: ChannelShardedConv2D supports dilation_rate=(1, 1) only; layer 'dilated' has dilation_rate=(2, 2). \
Received: dilation_rate=(2, 2)
    """
    config = layer.get_config()
    for key, value in wanted.items():
        if tuple(np.atleast_1d(config[key])) != tuple(np.atleast_1d(value)):
            raise ValueError(f"{converter} supports {key}={value!r} only; layer {layer.name!r} has "
                             f"{key}={config[key]!r}. Received: {key}={config[key]!r}")


def in_shape(variable, shape):
    """``variable``'s value in ``shape`` (its Keras twin's), reshaped only where the two differ."""
    return variable.read_value() if tuple(variable.shape) == tuple(shape) else tf.reshape(variable, shape)


class WeightedModule(tf.Module):
    """A module whose weights are DVariables that mirror a Keras layer's: its order, shapes and trainable flags."""

    #: The DVariables in the Keras twin's weight order.
    variables_in_order = ()

    def __init__(self, layer):
        super().__init__(name=module_name(layer.name))
        self._train_as(layer)

    def _train_as(self, layer):
        """Take the Keras ``layer``'s training settings: which weights train, their regularizers and constraints."""
        #: How many of ``variables_in_order`` (the first) the optimizer updates: the Keras layer's trainable
        #: weights, none where the layer is frozen (``layer.trainable = False``), as Keras's ``fit`` leaves them.
        self.trainable_count = len(layer.trainable_weights)
        #: The weights' regularizers and constraints (``kernel_regularizer``, ``kernel_constraint`` and kin) in the
        #: Keras weight order; None where a weight has none or does not train (Keras applies them to those only).
        self.regularizers, self.constraints = ([getattr(w, name) if w.trainable else None for w in layer.weights]
                                               for name in ("regularizer", "constraint"))

    def regularization_losses(self):
        """The Keras twin's weight regularizers applied to the DVariables in its shapes, as ``layer.losses`` are."""
        return [regularizer(in_shape(v, shape))
                for v, shape, regularizer in zip(self.variables_in_order, self.keras_shapes, self.regularizers)
                if regularizer is not None]

    def apply_constraints(self):
        """Project the weights with the Keras twin's constraints, in its shapes, as Keras's optimizer does after
        every update."""
        for v, shape, constraint in zip(self.variables_in_order, self.keras_shapes, self.constraints):
            if constraint is not None:
                projected = tf.reshape(constraint(in_shape(v, shape)), v.shape)
                v.assign(dtensor.relayout(projected, v.layout))

    @property
    def trainable_in_order(self):
        """The trainable DVariables, in Keras's order (the ones the optimizer updates)."""
        return list(self.variables_in_order[:self.trainable_count])

    def get_weights(self):
        """The weights as numpy arrays in the Keras twin's shapes."""
        return [to_numpy(v).reshape(shape) for v, shape in zip(self.variables_in_order, self.keras_shapes)]

    def set_weights(self, weights):
        """Load weights given in the Keras twin's shapes."""
        for variable, value in zip(self.variables_in_order, weights):
            variable.assign(to_mesh(np.reshape(value, variable.shape), dtensor.fetch_layout(variable)))

    def takes_sharded_channels(self):
        """Whether this module's input has its channels sharded over ``"model"`` (else whole)."""
        return self.sharded

    def forward(self, x, training=False):
        """This layer alone on numpy or local input, laid out as it takes it: for tests and examples (a
        ``tf.function`` of one call)."""
        layout = activation_layout(self.mesh, np.shape(x), self.takes_sharded_channels())
        return to_numpy(tf.function(lambda x: self(x, training=training), autograph=False)(to_mesh(x, layout)))


class LayoutKeeping(WeightedModule):
    """A module with weights that keeps its input's layout (channels ``sharded`` over ``"model"``, or whole; the
    batch as it comes): BatchNormalization, LayerNormalization, Normalization, DepthwiseConv2D."""

    sharded = False

    @property
    def mode(self):
        """The layout the report names: ``"sharded"`` or ``"whole"`` channels."""
        return "sharded" if self.sharded else "whole"

    def _mirror_weights(self, layer, channels_sharded):
        """Set ``variables_in_order`` to a DVariable per weight of ``layer`` (its order, shapes and values): a
        vector laid out like the channels (sharded over ``"model"`` or whole), anything else whole on every
        device. Returns them by Keras's weight name (``"gamma"``, ``"moving_mean"``, ...)."""
        channel = "model" if channels_sharded else UNSHARDED
        self.keras_shapes = [tuple(w.shape) for w in layer.weights]
        self.variables_in_order = [
            dtensor.DVariable(to_mesh(np.zeros(w.shape, w.dtype),
                                      dtensor.Layout([channel] if w.ndim == 1 else [UNSHARDED] * w.ndim, self.mesh)),
                              name=module_name(w.name)) for w in layer.weights]
        self.set_weights(layer.get_weights())
        return dict(zip((w.name for w in layer.weights), self.variables_in_order))


class ShardedLayer(WeightedModule):
    """What ``ChannelShardedConv2D`` and ``ShardedDense`` share: mode, weights as DVariables, Keras-shaped I/O."""

    def __init__(self, layer, mesh, mode, kernel_shape):
        super().__init__(layer)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}. Received: mode={mode!r}")
        self.mesh, self.mode = mesh, mode
        self.mixing = mixes_channels(layer)
        self.activation = layer.activation
        self.use_bias = layer.use_bias
        self._check_divisible(layer.name, kernel_shape)
        sharded_axis = {"column": len(kernel_shape) - 1, "row": len(kernel_shape) - 2}.get(mode)
        self.kernel_layout = tuple("model" if axis == sharded_axis else UNSHARDED for axis in range(len(kernel_shape)))
        self.keras_shapes = [tuple(w.shape) for w in layer.get_weights()]
        dtype = layer.variable_dtype
        self.kernel = dtensor.DVariable(to_mesh(np.zeros(kernel_shape, dtype),
                                                dtensor.Layout(self.kernel_layout, mesh)), name="kernel")
        bias_layout = dtensor.Layout(["model" if mode == "column" else UNSHARDED], mesh)
        self.bias = dtensor.DVariable(to_mesh(np.zeros(kernel_shape[-1:], dtype), bias_layout), name="bias") \
            if self.use_bias else None
        self.variables_in_order = [self.kernel] + ([self.bias] if self.use_bias else [])
        self.set_weights(layer.get_weights())
        #: The dtype of the layer's arithmetic: its input, kernel and bias are cast to it (weights keep theirs).
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)
        #: Whether the output stays split over the batch (``activation_layout``'s ``batch_split``), as a column-mode
        #: convolution's on a split batch can; else its channels are laid out by the mode.
        self.batch_split_output = False

    def _check_divisible(self, name, kernel_shape):
        if self.mode == "whole":
            return
        shards = self.mesh.dim_size("model")
        channels = kernel_shape[-1] if self.mode == "column" else kernel_shape[-2]
        if channels % shards:
            side = "output" if self.mode == "column" else "input"
            raise ValueError(
                f"layer {name!r} ({self.mode} mode) has {channels} {side} channels, which do not split over "
                f"{shards} model shards; shard counts that divide {channels}: {divisors(channels)}, or "
                f"mode='whole'. Received: model shards={shards}")

    def _mode_input(self, x):
        """``x`` with the channels this layer's mode takes: whole in column mode, sharded in row mode (cutting
        whole channels into shards needs no communication)."""
        return dtensor.relayout(x, activation_layout(self.mesh, x.shape, self.mode == "row"))

    def _output_layout(self, y):
        """The layout of this layer's output ``y``: split over the batch, or its channels as the mode says."""
        split = self.batch_split_output
        return activation_layout(self.mesh, y.shape, self.mode == "column" and not split, split)

    def _finish(self, y):
        """Add the bias, fix the output layout and apply the activation."""
        if self.use_bias:
            bias = tf.cast(self.bias, self.compute_dtype)
            if self.batch_split_output:  # the sharded bias gathered, as the kernel is for a split batch
                bias = dtensor.relayout(bias, dtensor.Layout.replicated(self.mesh, 1))
            y = y + bias
        if self.mode == "column" and not self.batch_split_output and self.mixing:
            y = dtensor.relayout(y, activation_layout(self.mesh, y.shape))
        return self.activation(y)

    def takes_sharded_channels(self):
        return self.mode == "row"


class ChannelShardedConv2D(ShardedLayer):
    """A ``keras.layers.Conv2D`` whose kernel is sharded over the mesh's ``"model"`` axis.

    ``mode="column"`` shards the output channels (input channels whole, or
    any layout where the convolution runs on a split batch; output sharded,
    or left split over the batch: ``batch_split_output``);
    ``mode="row"`` shards the input channels (input sharded, whole output
    channels); ``mode="whole"`` keeps the kernel whole (channels the shards
    do not divide), and its output channels whole, or split over the batch as
    column mode's. The kernel stays sharded between steps; how a step
    computes the convolution is ``formulation``'s choice.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> conv = keras.layers.Conv2D(6, 5, activation="relu")
    >>> x = np.random.default_rng(0).random((2, 12, 12, 4), dtype="float32")
    >>> reference = conv(x).numpy()
    >>> bool(np.allclose(ChannelShardedConv2D(conv, mesh, mode="row").forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.Conv2D`` to copy (channels-last,
            no dilation, no groups).
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        mode: ``"column"``, ``"row"`` or ``"whole"``.
    """

    def __init__(self, layer, mesh, mode="column"):
        require_settings(layer, "ChannelShardedConv2D", data_format="channels_last", dilation_rate=(1, 1), groups=1)
        self.strides = tuple(layer.strides)
        self.padding = layer.padding
        #: False for a first layer, whose input (the images) needs no gradient.
        self.input_gradient = True
        super().__init__(layer, mesh, mode, tuple(layer.kernel.shape))

    def formulation(self, padded_shape):
        """How the convolution of a padded input of ``padded_shape`` runs: :func:`formulation`'s rule."""
        return formulation(self.mode, self.kernel.shape[:2], self.strides, padded_shape, self.mesh.dim_size("model"),
                           "batch" in self.mesh.dim_names)

    def __call__(self, x, training=False):
        pads = [[0, 0], *same_padding(x.shape[1:3], self.kernel.shape[:2], self.strides, self.padding), [0, 0]]
        x = tf.cast(x, self.compute_dtype)
        kernel = tf.cast(self.kernel.read_value(), self.compute_dtype)
        form = self.formulation([n + sum(pad) for n, pad in zip(x.shape, pads)])
        if form != "split batch":  # which takes any layout
            x = self._mode_input(x)
        if form == "split batch":
            # Keras's "same" is TensorFlow's SAME: the op pads inside, without a padded copy kept for the gradient.
            y = conv_on_split_batch(x, kernel, self.mesh, self.strides, "SAME" if self.padding == "same" else pads)
        elif form == "filter gradient":
            y = conv_as_filter_gradient(tf.pad(x, pads), kernel)
        else:
            y = conv_as_matmul(tf.pad(x, pads), kernel, self.strides, self.input_gradient)
        return self._finish(dtensor.relayout(y, self._output_layout(y)))


class ShardedSeparableConv2D(ChannelShardedConv2D):
    """A ``keras.layers.SeparableConv2D``: its depthwise part as :class:`ShardedDepthwiseConv2D` (kernels whole,
    on the input's layout), then its pointwise part, a 1x1 :class:`ChannelShardedConv2D` in ``mode`` with the
    bias and the activation. The weights are Keras's: depthwise kernel, pointwise kernel, bias.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> separable = keras.layers.SeparableConv2D(4, 3, strides=2, padding="same", activation="relu")
    >>> x = np.random.default_rng(0).random((2, 9, 9, 6), dtype="float32")
    >>> reference = separable(x).numpy()
    >>> bool(np.allclose(ShardedSeparableConv2D(separable, mesh).forward(x), reference, atol=1e-5))
    True
    """

    def __init__(self, layer, mesh, mode="column", channels_sharded=False):
        require_settings(layer, "ShardedSeparableConv2D", data_format="channels_last", dilation_rate=(1, 1))
        kh, kw, channels, multiplier = layer.depthwise_kernel.shape
        twin = {"dtype": layer.dtype_policy, "name": layer.name}
        depthwise = keras.layers.DepthwiseConv2D((kh, kw), layer.strides, layer.padding, multiplier, use_bias=False,
                                                 **twin)
        depthwise.build((None, None, None, channels))
        depthwise.set_weights([layer.depthwise_kernel.numpy()])
        pointwise = keras.layers.Conv2D(layer.filters, 1, activation=layer.activation, use_bias=layer.use_bias, **twin)
        pointwise.build((None, None, None, channels * multiplier))
        pointwise.set_weights([w.numpy() for w in layer.weights[1:]])
        super().__init__(pointwise, mesh, mode)
        self.depthwise = ShardedDepthwiseConv2D(depthwise, mesh, channels_sharded)
        self._train_as(layer)  # the user's layer, not its pointwise twin
        self.keras_shapes = [tuple(w.shape) for w in layer.weights]
        self.variables_in_order = [*self.depthwise.variables_in_order, *self.variables_in_order]

    @property
    def input_gradient(self):
        """Always: the depthwise kernel's gradient flows through the pointwise part's input, a first layer's too."""
        return True

    @input_gradient.setter
    def input_gradient(self, value):
        pass

    def __call__(self, x, training=False):
        self.depthwise.compute_dtype = self.compute_dtype  # the depthwise part computes as the layer does
        return super().__call__(self.depthwise(x))


class ShardedDense(ShardedLayer):
    """A ``keras.layers.Dense`` whose kernel is sharded over the mesh's ``"model"`` axis.

    ``mode="column"`` shards the units, ``mode="row"`` the input features
    (partial sums all-reduced), ``mode="whole"`` neither (units the shards do
    not divide: kernel, input and output whole on every device). Its input may keep the spatial axes of a
    ``Flatten`` it absorbed (``input_shape=(h, w, c)``): the kernel is then held
    as ``(h, w, c, units)`` and sharded on ``c``, so channels sharded by the
    convolution before need no gather. ``get_weights`` returns Keras's
    ``(h*w*c, units)`` kernel, in ``Flatten``'s order. An input with more axes
    than the kernel reads (a Dense on every pixel's channels) keeps the others,
    as Keras's Dense does.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> dense = keras.layers.Dense(8, activation="relu")
    >>> x = np.random.default_rng(0).random((4, 6), dtype="float32")
    >>> reference = dense(x).numpy()
    >>> bool(np.allclose(ShardedDense(dense, mesh, mode="column").forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.Dense`` to copy.
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        mode: ``"column"``, ``"row"`` or ``"whole"``.
        input_shape: the shape of one example's input, when it is not the
            layer's own (a ``Flatten`` folded in).
    """

    def __init__(self, layer, mesh, mode="column", input_shape=None):
        input_shape = tuple(input_shape or layer.kernel.shape[:1])
        if math.prod(input_shape) != layer.kernel.shape[0]:
            raise ValueError(f"input_shape {input_shape} does not hold the {layer.kernel.shape[0]} input features of "
                             f"layer {layer.name!r}. Received: input_shape={input_shape}")
        super().__init__(layer, mesh, mode, (*input_shape, layer.units))

    def __call__(self, x, training=False):
        # The kernel's input axes (one, or a folded Flatten's three) meet x's last ones; the axes before them (the
        # batch, and the spatial axes of an input that was not flattened) stay, as Keras's Dense keeps them.
        axes = "hwc"[-(self.kernel.shape.rank - 1):]
        kept = "bij"[:x.shape.rank - len(axes)]
        x = self._mode_input(x)
        y = tf.einsum(f"{kept}{axes},{axes}o->{kept}o", tf.cast(x, self.compute_dtype),
                      tf.cast(self.kernel, self.compute_dtype))
        return self._finish(dtensor.relayout(y, self._output_layout(y)))


def moments(x, axes, keepdims=False):
    """``tf.nn.moments`` of ``x`` over ``axes``, with a gradient whose full-size ops read the incoming gradient.

    TensorFlow's gradient of ``tf.nn.moments`` computes ``x - mean`` under a
    control dependency on the incoming gradient. DTensor's expansion of the
    step drops that dependency, so every normalization's ``x - mean`` ran in
    the forward pass and stayed alive until its gradient: one more activation
    per layer, 8 MiB per device of the channel-sharded resnet's 24.7 at batch 64
    (docs/measurements/2026-12-04-zen4.md). Here the input's gradient is ``x * a + b`` with ``a`` and
    ``b`` made of the incoming gradient, so it waits for it.

    >>> x = tf.random.normal((4, 3, 3, 2), dtype=tf.float64)
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     tape.watch(x)
    ...     ours, theirs = moments(x, [0, 1, 2]), tf.nn.moments(x, [0, 1, 2])
    ...     ours, theirs = ours[0] * 3 + ours[1] ** 2, theirs[0] * 3 + theirs[1] ** 2
    >>> bool(np.allclose(tape.gradient(ours, x), tape.gradient(theirs, x), atol=1e-12))
    True
    """
    count = math.prod(x.shape[axis] for axis in axes)

    @tf.custom_gradient
    def statistics(x):
        mean, variance = tf.nn.moments(x, axes, keepdims=True)

        def gradient(d_mean, d_variance):
            d_mean, d_variance = (tf.reshape(d, mean.shape) for d in (d_mean, d_variance))
            scale = d_variance * (2.0 / count)  # d variance / d x = 2 (x - mean) / count
            return x * scale + (d_mean / count - scale * mean)

        return (mean, variance) if keepdims else (tf.squeeze(mean, axes), tf.squeeze(variance, axes)), gradient

    return statistics(x)


class ShardedBatchNormalization(LayoutKeeping):
    """A ``keras.layers.BatchNormalization`` over the channels (last axis), on channels whole or sharded.

    Gamma, beta and the moving mean and variance are laid out like the
    channels: with sharded channels each device normalizes its own channels
    over the whole batch, which needs no communication over ``"model"``. The
    batch statistics are taken over the global batch: on a mesh with a
    ``"batch"`` axis DTensor all-reduces them over it (synchronized, as
    ``BatchNormalization(synchronized=True)`` under tf.distribute). With
    ``synchronized=False`` each ``"batch"`` replica normalizes its slice with
    its slice's statistics, and the moving statistics take the mean of the
    replicas' (Keras's per-replica BatchNormalization under ``MirroredStrategy``
    lets each replica keep its own). The arithmetic is float32 (float64 for
    float64 input), as in Keras.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> norm = keras.layers.BatchNormalization()
    >>> x = np.random.default_rng(0).random((4, 3, 3, 6), dtype="float32")
    >>> reference = norm(x, training=True).numpy()
    >>> sharded = ShardedBatchNormalization(norm, mesh, channels_sharded=True)
    >>> bool(np.allclose(sharded.forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.BatchNormalization`` to copy (``axis=-1``, no renorm).
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        channels_sharded: whether its input's channels are sharded over ``"model"``.
        synchronized: batch statistics over the global batch (True) or per ``"batch"`` replica.
    """

    def __init__(self, layer, mesh, channels_sharded=False, synchronized=True):
        super().__init__(layer)
        if not layer.built:
            raise ValueError(f"layer {layer.name!r} must be built (a model with a known input shape). "
                             f"Received: an unbuilt {type(layer).__name__}")
        rank = layer.input_spec.ndim
        if [axis % rank for axis in np.atleast_1d(layer.axis)] != [rank - 1] or layer.renorm:
            raise ValueError(f"channel sharding supports BatchNormalization over the last axis without renorm; "
                             f"layer {layer.name!r} has axis={layer.axis!r}, renorm={layer.renorm!r}. "
                             f"Received: axis={layer.axis!r}, renorm={layer.renorm!r}")
        self.mesh, self.sharded = mesh, channels_sharded
        self.synchronized = synchronized
        self.momentum, self.epsilon = layer.momentum, layer.epsilon
        variables = self._mirror_weights(layer, channels_sharded)
        self.gamma, self.beta = variables.get("gamma"), variables.get("beta")
        self.moving_mean, self.moving_variance = variables["moving_mean"], variables["moving_variance"]
        #: A frozen BatchNormalization normalizes with its moving statistics and keeps them, as in Keras.
        self.trainable = layer.trainable

    def __call__(self, x, training=False):
        dtype = x.dtype
        x = tf.cast(x, tf.float64 if dtype == tf.float64 else tf.float32)
        if training and self.trainable:
            mean, variance = self._moments(x)
            self.moving_mean.assign(self.moving_mean * self.momentum + self._replica_mean(mean) * (1 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum
                                        + self._replica_mean(variance) * (1 - self.momentum))
        else:
            mean, variance = self.moving_mean.read_value(), self.moving_variance.read_value()
        y = tf.nn.batch_normalization(self._per_replica(x), mean, variance, self.beta, self.gamma, self.epsilon)
        return tf.cast(tf.reshape(y, x.shape) if self._replicas(x) > 1 else y, dtype)

    def forward(self, x, training=True):
        """This layer alone, in training mode unless told: for tests and examples."""
        return super().forward(x, training)

    def _replicas(self, x):
        """How many slices of the batch are normalized separately: the ``"batch"`` replicas when unsynchronized."""
        if self.synchronized or "batch" not in self.mesh.dim_names:
            return 1
        replicas = self.mesh.dim_size("batch")
        return replicas if x.shape[0] % replicas == 0 else 1  # an undivided batch: every replica has all of it

    def _per_replica(self, x):
        replicas = self._replicas(x)
        return x if replicas == 1 else tf.reshape(x, [replicas, x.shape[0] // replicas, *x.shape[1:]])

    def _moments(self, x):
        sliced = self._per_replica(x)
        axes = list(range(sliced.shape.rank - 1))[-(x.shape.rank - 1):]  # all but the channels (and the replica)
        return moments(sliced, axes, keepdims=sliced.shape.rank != x.shape.rank)

    def _replica_mean(self, statistic):
        return tf.reshape(tf.reduce_mean(statistic, axis=0), [-1]) if statistic.shape.rank > 1 else statistic


class ShardedDepthwiseConv2D(LayoutKeeping):
    """A ``keras.layers.DepthwiseConv2D`` (channels-last, no dilation) on channels whole, sharded, or split over
    the batch.

    Each channel is convolved with kernels of its own, which are few: they stay
    whole on every device, and the convolution (:func:`depthwise_conv`) runs on
    whole channels with the batch split as the input's is (sharded channels are
    gathered first and cut again after, as a ``Softmax`` gathers them).

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> depthwise = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2)
    >>> x = np.random.default_rng(0).random((2, 9, 9, 4), dtype="float32")
    >>> reference = depthwise(x).numpy()
    >>> sharded = ShardedDepthwiseConv2D(depthwise, mesh, channels_sharded=True)
    >>> bool(np.allclose(sharded.forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.DepthwiseConv2D`` to copy.
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        channels_sharded: whether its input's channels are sharded over ``"model"``.
    """

    def __init__(self, layer, mesh, channels_sharded=False):
        super().__init__(layer)
        require_settings(layer, "ShardedDepthwiseConv2D", data_format="channels_last", dilation_rate=(1, 1))
        self.mesh, self.sharded = mesh, channels_sharded
        self.window, self.strides, self.padding = tuple(layer.kernel_size), tuple(layer.strides), layer.padding
        self.activation = layer.activation
        self._mirror_weights(layer, channels_sharded=False)  # the kernels and the bias whole: few, and computed whole
        #: The dtype of the layer's arithmetic, as a sharded layer's (``ShardedModel`` sets it for mixed precision).
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)

    def __call__(self, x, training=False):
        kernel, *bias = (tf.cast(v, self.compute_dtype) for v in self.variables_in_order)
        x = tf.cast(x, self.compute_dtype)
        if self.sharded:  # gathered, and the output pinned whole: DTensor would carry the sharding back to the op
            x = dtensor.relayout(x, activation_layout(self.mesh, x.shape))
            y = depthwise_conv(x, kernel, self.strides, self.padding)
            y = dtensor.relayout(y, activation_layout(self.mesh, y.shape))
        else:
            y = depthwise_conv(x, kernel, self.strides, self.padding)
        if bias:
            y = y + bias[0]
        y = self.activation(y)
        return dtensor.relayout(y, activation_layout(self.mesh, y.shape, self.sharded and not mixes_channels(self)))


class ShardedConv2DTranspose(LayoutKeeping):
    """A ``keras.layers.Conv2DTranspose`` (channels-last, no dilation) on channels whole, sharded, or split over
    the batch: Keras's own transposed convolution with the kernel whole, on the batch as the input splits it.

    DTensor runs ``Conv2DBackpropInput`` (the op of a transposed convolution)
    and the two ops of its gradient on a batch-parallel layout with a whole
    filter, so sharded channels are gathered first (and its output's are cut
    again where ``output_sharded``), as
    :class:`ShardedDepthwiseConv2D` does, and a batch split over ``"model"``
    (``batch_split``) stays split; its kernel and bias stay whole on every
    device.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> transposed = keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same")
    >>> x = np.random.default_rng(0).random((2, 5, 5, 6), dtype="float32")
    >>> reference = transposed(x).numpy()
    >>> sharded = ShardedConv2DTranspose(transposed, mesh, channels_sharded=True)
    >>> bool(np.allclose(sharded.forward(x), reference, atol=1e-5))
    True
    """

    def __init__(self, layer, mesh, channels_sharded=False, batch_split=False, output_sharded=False):
        super().__init__(layer)
        require_settings(layer, "ShardedConv2DTranspose", data_format="channels_last", dilation_rate=(1, 1))
        self.mesh, self.sharded, self.batch_split = mesh, channels_sharded, batch_split
        #: Whether its output's channels are sharded (``sharded.model.output_tensor``'s rule), else whole.
        self.output_sharded = output_sharded
        self.strides, self.padding, self.output_padding = layer.strides, layer.padding, layer.output_padding
        self.activation = layer.activation
        self._mirror_weights(layer, channels_sharded=False)  # the kernel and the bias whole, as the op takes them
        #: The dtype of the layer's arithmetic, as a sharded layer's (``ShardedModel`` sets it for mixed precision).
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)

    def __call__(self, x, training=False):
        kernel, *bias = (tf.cast(v, self.compute_dtype) for v in self.variables_in_order)
        x = dtensor.relayout(tf.cast(x, self.compute_dtype), activation_layout(self.mesh, x.shape,
                                                                              batch_split=self.batch_split))
        y = keras.ops.conv_transpose(x, kernel, self.strides, self.padding, self.output_padding)
        # Pinned at once, as the input: DTensor would carry a sharded layout back to the op, which refuses it.
        y = dtensor.relayout(y, activation_layout(self.mesh, y.shape, batch_split=self.batch_split))
        if bias:
            y = y + bias[0]
        y = self.activation(y)
        return dtensor.relayout(y, activation_layout(self.mesh, y.shape, self.output_sharded))


class ShardedNormalization(LayoutKeeping):
    """A ``keras.layers.Normalization`` over the channels (last axis): its mean and variance (adapted, or given)
    laid out like the channels, whole or sharded; nothing trains them, and its weights are handed back as
    they came.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> x = np.random.default_rng(0).random((4, 3, 3, 6), dtype="float32")
    >>> norm = keras.layers.Normalization()
    >>> norm.adapt(x)
    >>> bool(np.allclose(ShardedNormalization(norm, mesh, channels_sharded=True).forward(x), norm(x), atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.Normalization`` to copy (``axis=-1``).
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        channels_sharded: whether its input's channels are sharded over ``"model"``.
    """

    def __init__(self, layer, mesh, channels_sharded=False):
        super().__init__(layer)
        if layer.mean is None or any(n != 1 for n in layer.mean.shape[:-1]):  # Keras's broadcast shape
            raise ValueError(f"channel sharding supports Normalization over the last axis; layer {layer.name!r} has "
                             f"axis={layer.axis!r}. Received: axis={layer.axis!r}")
        self.mesh, self.sharded, self.invert = mesh, channels_sharded, layer.invert
        channels = dtensor.Layout(["model" if channels_sharded else UNSHARDED], mesh)
        # What Keras's call reads: the statistics given to the layer, or those adapted when it was built (a
        # Keras snapshot of its weights, which set_weights leaves as it was; adapt() and loading renew it).
        self.mean, self.variance = (to_mesh(np.reshape(np.asarray(value), [-1]), channels)
                                    for value in (layer.mean, layer.variance))
        # The weights (mean, variance and count; none where the statistics were given), kept to be handed back.
        self._mirror_weights(layer, channels_sharded)
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)

    def __call__(self, x, training=False):
        x = tf.cast(x, self.compute_dtype)
        mean, variance = (tf.cast(v, self.compute_dtype) for v in (self.mean, self.variance))
        scale = tf.maximum(tf.sqrt(variance), keras.config.epsilon())
        return mean + x * scale if self.invert else (x - mean) / scale


class ShardedLayerNormalization(LayoutKeeping):
    """A ``keras.layers.LayerNormalization`` or ``RMSNormalization`` over the channels (last axis), on channels
    whole, sharded, or split over the batch: each example's statistics over its channels (DTensor all-reduces
    them where the channels are sharded), gamma and beta (RMSNormalization's scale) laid out like the channels.
    The arithmetic is float32 (float64 for float64 input), as Keras's.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> norm = keras.layers.LayerNormalization()
    >>> model = keras.Sequential([keras.Input((3, 3, 6)), norm])  # a layer of a model, as channel sharding meets it
    >>> x = np.random.default_rng(0).random((4, 3, 3, 6), dtype="float32")
    >>> reference = norm(x).numpy()
    >>> bool(np.allclose(ShardedLayerNormalization(norm, mesh, channels_sharded=True).forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the ``keras.layers.LayerNormalization`` or ``RMSNormalization`` of a model to copy (``axis=-1``).
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        channels_sharded: whether its input's channels are sharded over ``"model"``.
    """

    def __init__(self, layer, mesh, channels_sharded=False):
        super().__init__(layer)
        if list(np.atleast_1d(layer.axis)) not in ([-1], [len(layer.input.shape) - 1]):
            raise ValueError(f"channel sharding supports {type(layer).__name__} over the last axis; layer "
                             f"{layer.name!r} has axis={layer.axis!r}. Received: axis={layer.axis!r}")
        self.mesh, self.sharded = mesh, channels_sharded
        #: RMSNormalization's root mean square (LayerNormalization's ``rms_scaling`` divides by the deviation).
        self.mean_square = isinstance(layer, keras.layers.RMSNormalization)
        self.epsilon, self.rms_scaling = layer.epsilon, getattr(layer, "rms_scaling", False)
        variables = self._mirror_weights(layer, channels_sharded)
        self.gamma, self.beta = variables.get("gamma", variables.get("scale")), variables.get("beta")
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)

    def __call__(self, x, training=False):
        x = tf.cast(x, tf.float64 if x.dtype == tf.float64 else tf.float32)
        gamma, beta = (None if v is None else tf.cast(v, x.dtype) for v in (self.gamma, self.beta))
        if self.mean_square:
            return tf.cast(x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), [-1], keepdims=True) + self.epsilon)
                           * gamma, self.compute_dtype)
        if self.rms_scaling:
            y = x * tf.math.rsqrt(moments(x, [-1], keepdims=True)[1] + self.epsilon)
            y = y if gamma is None else y * gamma
        else:  # Keras's order of operations
            mean, variance = moments(x, [-1], keepdims=True)
            inverse = tf.math.rsqrt(variance + self.epsilon)
            inverse = inverse if gamma is None else inverse * gamma
            shift = -mean * inverse
            y = x * inverse + (shift if beta is None else shift + beta)
        return tf.cast(y, self.compute_dtype)


class ShardedGroupNormalization(LayoutKeeping):
    """A ``keras.layers.GroupNormalization`` over the channels (last axis), on whole channels (sharded ones are
    gathered first) and the batch as it comes: each example's statistics over the image and its group's channels,
    gamma and beta whole on every device. The arithmetic is float32 (float64 for float64 input), as Keras's.

    Example:

    >>> import keras, numpy as np
    >>> from tensorflow.experimental import dtensor
    >>> from keras_cnnpar import devices
    >>> mesh = dtensor.create_mesh([("model", 2)], devices=devices.configure(2))
    >>> norm = keras.layers.GroupNormalization(groups=2)
    >>> x = np.random.default_rng(0).random((4, 3, 3, 6), dtype="float32")
    >>> reference = norm(x).numpy()
    >>> bool(np.allclose(ShardedGroupNormalization(norm, mesh).forward(x), reference, atol=1e-5))
    True

    Args:
        layer: the built ``keras.layers.GroupNormalization`` to copy (``axis=-1``).
        mesh: a DTensor mesh with a ``"model"`` axis (and optionally ``"batch"``).
        batch_split: whether its input is split over the batch (whole channels on each device).
    """

    def __init__(self, layer, mesh, batch_split=False):
        super().__init__(layer)
        if layer.axis not in (-1, layer.input_spec.ndim - 1):
            raise ValueError(f"channel sharding supports GroupNormalization over the last axis; layer {layer.name!r} "
                             f"has axis={layer.axis!r}. Received: axis={layer.axis!r}")
        self.mesh, self.batch_split = mesh, batch_split
        self.groups, self.epsilon = layer.groups, layer.epsilon
        variables = self._mirror_weights(layer, channels_sharded=False)
        self.gamma, self.beta = variables.get("gamma"), variables.get("beta")
        self.compute_dtype = tf.as_dtype(layer.compute_dtype)

    def __call__(self, x, training=False):
        x = dtensor.relayout(x, activation_layout(self.mesh, x.shape, batch_split=self.batch_split))
        x = tf.cast(x, tf.float64 if x.dtype == tf.float64 else tf.float32)
        shape = x.shape
        grouped = tf.reshape(x, [*shape[:-1], self.groups, shape[-1] // self.groups])
        mean, variance = moments(grouped, [*range(1, len(shape) - 1), len(shape)], keepdims=True)
        inverse = tf.math.rsqrt(variance + self.epsilon)  # Keras's order of operations
        if self.gamma is not None:
            inverse = inverse * tf.reshape(tf.cast(self.gamma, x.dtype), [self.groups, -1])
        shift = -mean * inverse
        if self.beta is not None:
            shift = shift + tf.reshape(tf.cast(self.beta, x.dtype), [self.groups, -1])
        return tf.cast(tf.reshape(grouped * inverse + shift, shape), self.compute_dtype)


def depthwise_conv(x, kernel, strides, padding):
    """Depthwise convolution of ``x`` (NHWC) with ``kernel`` (kh, kw, channels, multiplier) and Keras's
    ``padding`` ("same" is TensorFlow's SAME): TensorFlow's own op, with its gradient written in ops DTensor
    has layout rules for.

    DTensor runs ``DepthwiseConv2dNative`` on whole channels with the batch
    split or whole, but its two gradient ops have no layout rule ("does not
    implement layout propagation"), whatever the layout. So the input's gradient
    is the same op on the output's gradient, spread to stride 1 with zeros and
    padded, with the kernel turned by 180 degrees (each channel's multiplier
    outputs summed); the kernel's is the products of the input's stride-1 windows
    with that spread gradient, summed over the batch and the image. Forward and
    backward on one device took 2.5-3.2x TensorFlow's own op and gradient ops at
    stride 1, 3.9x at stride 2 (MobileNetV2's shapes at batch 64,
    ``benchmarks/tensor_parallel_throughput.py``); the products of the windows
    forward as well, 20x.

    >>> import numpy as np, tensorflow as tf
    >>> x, k = tf.random.normal((2, 9, 9, 3)), tf.random.normal((3, 3, 3, 2))
    >>> reference = tf.nn.depthwise_conv2d(x, k, [1, 2, 2, 1], "SAME")
    >>> bool(np.allclose(depthwise_conv(x, k, (2, 2), "same"), reference, atol=1e-5))
    True
    """
    (kh, kw, channels, multiplier), (sh, sw) = kernel.shape, strides
    pads = [[0, 0], *same_padding(x.shape[1:3], (kh, kw), strides, padding), [0, 0]]

    @tf.custom_gradient
    def conv(x, kernel):
        y = tf.nn.depthwise_conv2d(x, kernel, [1, sh, sw, 1], padding.upper())  # padded inside: no copy kept

        def gradient(dy):
            padded = tf.pad(x, pads)
            batch, height, width, _ = dy.shape
            spread = tf.pad(tf.reshape(dy, [batch, height, 1, width, 1, -1]),  # a reshape: DTensor slices add no axis
                            [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
            spread = tf.reshape(spread, [batch, height * sh, width * sw, -1])
            spread = spread[:, :padded.shape[1] - kh + 1, :padded.shape[2] - kw + 1]  # the stride-1 output
            turned = tf.reshape(kernel[::-1, ::-1], [kh, kw, channels * multiplier, 1])
            d_padded = tf.nn.depthwise_conv2d(tf.pad(spread, [[0, 0], [kh - 1] * 2, [kw - 1] * 2, [0, 0]]), turned,
                                              [1, 1, 1, 1], "VALID")
            d_padded = tf.reduce_sum(tf.reshape(d_padded, [*d_padded.shape[:3], channels, multiplier]), axis=-1)
            (top, _), (left, _) = pads[1], pads[2]
            d_x = d_padded[:, top:top + x.shape[1], left:left + x.shape[2]]
            d_y = tf.reshape(spread, [*spread.shape[:3], channels, multiplier])  # stride-1 windows: no strided slices
            d_kernel = tf.stack([tf.reduce_sum(view[..., None] * d_y, axis=[0, 1, 2])
                                 for view in windows(padded, (kh, kw), (1, 1))])
            return d_x, tf.reshape(d_kernel, kernel.shape)

        return y, gradient

    return conv(x, kernel)


def formulation(mode, window, strides, padded_shape, shards, batch_axis=False):
    """How a channel-sharded convolution (``mode``, a ``window`` with ``strides``) of a padded input of
    ``padded_shape`` (NHWC, the whole batch and channels) runs over ``shards`` model shards, by the rules
    measured in docs/measurements/2026-12-01-zen4.md. On a mesh with a ``"batch"`` axis (``batch_axis``) always ``"split
    batch"`` (``conv_on_split_batch``, over ``"batch"``: the ``"model"`` devices of a replica compute the same
    convolution; DTensor shards a tensor axis over one mesh axis, so the batch cannot also go over
    ``"model"``); it measured 1.2-1.9x im2col's images/s for the 3+3 and the resnet under ``Hybrid(2, 2)``
    (docs/measurements/2026-12-04-zen4.md).
    Without one: ``"split batch"`` (over ``"model"``) in column (and whole) mode and for row-mode outputs larger than
    14x14 where the shards divide the batch, ``"filter gradient"`` (``conv_as_filter_gradient``) for
    row-mode, stride-1 outputs larger than 7x7 up to 14x14, else ``"im2col"`` (``conv_as_matmul``).

    >>> formulation("row", (3, 3), (1, 1), (64, 16, 16, 32), shards=2)
    'filter gradient'
    >>> formulation("row", (3, 3), (1, 1), (64, 16, 16, 32), shards=2, batch_axis=True)
    'split batch'
    """
    (kh, kw), (sh, sw) = window, strides
    area = ((padded_shape[1] - kh) // sh + 1) * ((padded_shape[2] - kw) // sw + 1)
    if batch_axis:
        return "split batch"
    if padded_shape[0] % shards == 0 and (mode != "row" or area > 14 * 14):
        return "split batch"
    if mode == "row" and tuple(strides) == (1, 1) and area > 7 * 7:
        return "filter gradient"
    return "im2col"


def same_padding(size, window, strides, padding):
    """``[[top, bottom], [left, right]]`` of Keras's ``padding`` ("valid" or "same") for a 2-D window.

    >>> same_padding((28, 28), (5, 5), (1, 1), "same")
    [[2, 2], [2, 2]]
    """
    if padding == "valid":
        return [[0, 0], [0, 0]]
    pads = []
    for n, k, s in zip(size, window, strides):
        total = max((math.ceil(n / s) - 1) * s + k - n, 0)
        pads.append([total // 2, total - total // 2])
    return pads


def windows(x, window, strides):
    """The ``kh*kw`` shifted, strided views of ``x`` (NHWC) that a ``window`` with ``strides`` covers."""
    (kh, kw), (sh, sw) = window, strides
    oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    return [x[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :] for i in range(kh) for j in range(kw)]


def conv_on_split_batch(x, kernel, mesh, strides=(1, 1), padding="VALID"):
    """Convolution of ``x`` (NHWC) with ``kernel`` as TensorFlow's own convolution of each device's slice of
    the batch with the whole kernel; ``padding`` is the op's (``"VALID"`` or ``"SAME"``) or ``tf.pad``'s
    paddings, applied first.

    The kernel (sharded at rest) is gathered for the step, as fully sharded
    data parallel does, and the input's channels too. On a 1-D ``"model"`` mesh
    the batch is laid out over ``"model"``, which DTensor's convolution accepts,
    and the kernel's gradient is all-reduced over it; the caller leaves the
    output split over the batch, or lays it out again (channels sharded or
    whole: an all-to-all of activations, in place of im2col's ``kh*kw`` stacked
    windows). On a mesh with a ``"batch"`` axis the batch stays over
    ``"batch"``: the ``"model"`` devices of a replica compute the same output,
    and the caller keeps each one's shard of its channels. The output's layout
    is fixed here: left to DTensor's layout propagation, a sharded layout
    after it reaches the convolution on the 2-D mesh, whose gradient then
    fails ("output layout of Relayout op after layout propagation does not
    match").
    """
    whole = dtensor.relayout(kernel, dtensor.Layout.replicated(mesh, 4))
    split_over_model = "batch" not in mesh.dim_names
    split = dtensor.relayout(x, activation_layout(mesh, x.shape, batch_split=split_over_model))
    if not isinstance(padding, str):
        split, padding = tf.pad(split, padding), "VALID"
    y = tf.nn.conv2d(split, whole, strides, padding)
    return dtensor.relayout(y, activation_layout(mesh, y.shape, batch_split=split_over_model))


def conv_as_filter_gradient(x, kernel):
    """Valid stride-1 convolution of padded ``x`` (NHWC) with ``kernel``, as TensorFlow's kernel-gradient op with
    the roles swapped: the input channels are its batch, the images' batch its channels.

    ``Conv2DBackpropFilter`` sums over its batch axis. DTensor accepts it with
    that axis sharded and all-reduces the partial sums; with the input
    channels there, that is exactly row mode's reduction, and the op's own
    gradients (a convolution and ``Conv2DBackpropInput``) are batch-parallel
    too. It runs on TensorFlow's convolution kernels instead of im2col.

    >>> import numpy as np, tensorflow as tf
    >>> x, k = tf.random.normal((2, 9, 9, 3)), tf.random.normal((3, 3, 3, 4))
    >>> bool(np.allclose(conv_as_filter_gradient(x, k), tf.nn.conv2d(x, k, 1, "VALID"), atol=1e-4))
    True
    """
    batch, height, width, _ = x.shape
    kh, kw, _, cout = kernel.shape
    y = tf.raw_ops.Conv2DBackpropFilter(
        input=tf.transpose(x, [3, 1, 2, 0]), filter_sizes=[height - kh + 1, width - kw + 1, batch, cout],
        out_backprop=tf.transpose(kernel, [2, 0, 1, 3]), strides=[1, 1, 1, 1], padding="VALID")
    return tf.transpose(y, [2, 0, 1, 3])


def conv_as_matmul(x, kernel, strides=(1, 1), input_gradient=True):
    """Valid convolution of padded ``x`` (NHWC) with ``kernel`` as one matmul of the stacked windows (im2col).

    With stride 1 the gradient is hand-written: the kernel's is a matmul of
    the same windows with the output gradient; the input's (skipped when
    ``input_gradient`` is False, for a first layer) multiplies the output
    gradient by the kernel and adds the ``kh*kw`` shifted pieces back
    (col2im), so no window slice is differentiated; stacking the windows of
    the padded output gradient instead was slower in both modes
    (docs/benchmarks.md).

    >>> import numpy as np, tensorflow as tf
    >>> x, k = tf.random.normal((2, 9, 9, 3)), tf.random.normal((3, 3, 3, 4))
    >>> bool(np.allclose(conv_as_matmul(x, k), tf.nn.conv2d(x, k, 1, "VALID"), atol=1e-4))
    True
    """
    kh, kw, cin, cout = kernel.shape

    def forward(x, kernel):
        stacked = tf.stack(windows(x, (kh, kw), strides), axis=3)  # b, oh, ow, kh*kw, cin
        matrix = tf.reshape(kernel, [kh * kw, cin, cout])
        return tf.einsum("bhwkc,kco->bhwo", stacked, matrix), stacked, matrix

    if strides != (1, 1):
        return forward(x, kernel)[0]

    @tf.custom_gradient
    def conv(x, kernel):
        y, stacked, matrix = forward(x, kernel)

        def gradient(dy):
            d_kernel = tf.reshape(tf.einsum("bhwkc,bhwo->kco", stacked, dy), kernel.shape)
            if not input_gradient:
                return tf.zeros_like(x), d_kernel
            pieces = tf.unstack(tf.einsum("bhwo,kco->bhwkc", dy, matrix), axis=3)
            height, width = x.shape[1] - dy.shape[1], x.shape[2] - dy.shape[2]
            offsets = [(i, j) for i in range(kh) for j in range(kw)]
            d_x = tf.add_n([tf.pad(piece, [[0, 0], [i, height - i], [j, width - j], [0, 0]])
                            for (i, j), piece in zip(offsets, pieces)])
            return d_x, d_kernel

        return y, gradient

    return conv(x, kernel)
