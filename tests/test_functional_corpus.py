"""Tensor parallel on functional CNNs it was not written for: a corpus of graphs, one step each against Single.

Each graph puts the supported layers in other positions: BatchNormalization on
the images, after a convolution with or without bias, after a Dense; merges of
sharded and whole tensors (``Add`` of three, ``Average``, ``Subtract``,
``Multiply``, ``Maximum``); pooling after a merge; strided and 1x1
convolutions; depthwise convolutions in MobileNetV2's blocks; EfficientNet's
blocks (Normalization, squeeze and excitation); separable convolutions;
ConvNeXt's LayerNormalization; GroupNormalization, UnitNormalization and
ActivityRegularization; element-wise operations called on tensors (``a + b``,
``keras.ops.relu``); global pooling with and without ``keepdims``;
Dense layers on every pixel's channels; Dense logits without a softmax, and
1x1 convolutions as logits, flattened (MobileNetV3's head); channel counts the
shards do not divide; weight and activity regularizers (in float32); weight
constraints. One SGD step under
``ChannelSharded(2)`` and ``Hybrid(2, 2)`` must give Single's weights,
BatchNormalization's moving statistics included: within 1e-9 in float64 (the
same arithmetic, summed in another order) and 1e-4 in float32.
"""

import functools

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import rebuild
from tests.helpers import assert_same_step, max_difference

L = keras.layers
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


def residual_strided(x):
    """BN after a convolution without bias, a residual Add of a sharded and a whole tensor, a strided convolution,
    global average pooling, Dense logits (the graph of the issue that found the BN moments crash); a kernel, a
    gamma and an activity regularizer."""
    x = L.Conv2D(8, 3, padding="same", use_bias=False, kernel_regularizer=keras.regularizers.L2(0.01))(x)
    x = L.ReLU()(L.BatchNormalization(gamma_regularizer="l2")(x))
    residual = L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(x))
    x = L.ReLU()(L.Add()([x, residual]))
    x = L.MaxPooling2D()(x)
    x = L.Conv2D(16, 3, strides=2, padding="same")(x)
    x = L.Activation("relu")(L.BatchNormalization()(x))
    return L.Dense(10, activity_regularizer="l2")(L.GlobalAveragePooling2D()(x))


def branches_averaged(x):
    """Two concatenated branches, BN, average pooling, an ``Average`` of a whole and a sharded tensor, Flatten and
    a Dense head with kernel and bias regularizers (its kernel is held folded where the Flatten's channels are
    sharded)."""
    a = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    b = L.Conv2D(8, 5, padding="same", activation="relu")(x)
    x = L.AveragePooling2D(2)(L.BatchNormalization()(L.Concatenate()([a, b])))
    x = L.Average()([x, L.Conv2D(16, 3, padding="same")(x)])
    dense = L.Dense(10, kernel_regularizer=keras.regularizers.L1L2(l1=1e-3, l2=1e-2), bias_regularizer="l2")
    return dense(L.Flatten()(x))


def normalized_images(x):
    """BN on the images, padding, a strided valid convolution, 1x1 convolutions, a ``Multiply`` and a ``Maximum``
    merge, same-padded pooling after a merge, BN without center, global max pooling, BN after a Dense, dropout."""
    x = L.ZeroPadding2D(1)(L.BatchNormalization()(x))
    x = L.Conv2D(8, 3, strides=2, activation="relu")(x)
    gate = L.Conv2D(8, 1, activation="relu")(L.Conv2D(8, 1)(x))
    x = L.MaxPooling2D(2, padding="same")(L.Multiply()([x, gate]))
    x = L.BatchNormalization(center=False)(x)
    x = L.GlobalMaxPooling2D()(L.Maximum()([x, L.Conv2D(8, 3, padding="same")(x)]))
    x = L.Dropout(0.0)(L.BatchNormalization()(L.Dense(32)(x)))
    return L.Dense(10)(x)


def subtracted(x):
    """A strided 5x5 convolution, BN without scale, a ``Subtract`` of a 1x1 convolution, same-padded average
    pooling after the merge (a 3x3 window with stride 2: the windows on the edge hold 6 of the image's values),
    a valid convolution, LeakyReLU, uneven cropping, Flatten into two Dense layers."""
    x = L.Conv2D(16, 5, strides=2, padding="same", activation="relu")(x)
    x = L.BatchNormalization(scale=False)(L.Conv2D(16, 3, padding="same", use_bias=False)(x))
    x = L.AveragePooling2D(3, strides=2, padding="same")(L.Subtract()([x, L.Conv2D(16, 1, use_bias=False)(x)]))
    x = L.Cropping2D(((1, 0), (0, 1)))(L.LeakyReLU()(L.Conv2D(8, 3)(x)))
    return L.Dense(10)(L.Dense(16, activation="relu")(L.Flatten()(x)))


def dense_block(x):
    """A densely connected block: an ``Add`` of three tensors of both layouts, BN, a concatenation, pooling, a
    strided 1x1 convolution, global pooling with ``keepdims`` and a Flatten."""
    a = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    b = L.Conv2D(8, 3, padding="same", activation="relu")(a)
    c = L.Conv2D(8, 3, padding="same", activation="relu")(b)
    x = L.BatchNormalization()(L.Add()([a, b, c]))
    x = L.MaxPooling2D(2)(L.Concatenate()([x, b]))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 1, strides=2)(x)))
    return L.Dense(10)(L.Flatten()(L.GlobalAveragePooling2D(keepdims=True)(x)))


def inverted_residuals(x):
    """MobileNetV2's blocks: 1x1 expansions, depthwise convolutions without bias and with (same and valid
    padding, stride 2, a depth multiplier of 2, a regularizer), ReLU6, a residual Add around a depthwise block,
    global average pooling, Dense logits."""
    x = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(x)))
    block = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(16, 1, use_bias=False)(x)))
    block = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same", use_bias=False)(block)))
    x = L.Add()([x, L.BatchNormalization()(L.Conv2D(8, 1, use_bias=False)(block))])
    x = L.DepthwiseConv2D(3, strides=2, depth_multiplier=2, activation="relu")(x)
    x = L.DepthwiseConv2D(3, padding="same", depthwise_regularizer="l2")(L.Conv2D(16, 1)(x))
    return L.Dense(10)(L.GlobalAveragePooling2D()(x))


def squeeze_excited(x):
    """EfficientNet's blocks: a Normalization adapted to the images and one given its statistics (on sharded
    channels under Hybrid), swish, a depthwise convolution, squeeze and excitation (global pooling, a Reshape to
    ``(1, 1, c)``, two 1x1 convolutions, a broadcasting ``Multiply``), dropout with a noise shape, a residual Add."""
    adapted = L.Normalization()
    adapted.adapt(batch()[0])
    x = L.Conv2D(16, 3, strides=2, padding="same", use_bias=False)(adapted(x))
    x = L.Activation("swish")(L.BatchNormalization()(x))
    block = L.Activation("swish")(L.DepthwiseConv2D(3, padding="same")(x))
    squeezed = L.Reshape((1, 1, 16))(L.GlobalAveragePooling2D()(block))
    block = L.Multiply()([block, L.Conv2D(16, 1, activation="sigmoid")(L.Conv2D(4, 1, activation="swish")(squeezed))])
    given = L.Normalization(mean=np.linspace(-0.1, 0.1, 16), variance=np.linspace(0.5, 2.0, 16))
    x = L.Add()([x, L.Dropout(0.0, noise_shape=(None, 1, 1, 1))(given(L.Conv2D(16, 1)(block)))])
    return L.Dense(10)(L.Flatten()(L.GlobalAveragePooling2D(keepdims=True)(x)))


def separable(x):
    """Xception's entry: separable convolutions (on the images, strided, a depth multiplier, regularizers) after
    a whole and after a sharded input, a residual 1x1 strided convolution, global max pooling."""
    x = L.SeparableConv2D(8, 3, padding="same", activation="relu")(x)
    residual = L.Conv2D(16, 1, strides=2)(x)
    x = L.SeparableConv2D(16, 3, padding="same", depth_multiplier=2, depthwise_regularizer="l2",
                          pointwise_regularizer="l2")(x)
    x = L.SeparableConv2D(16, 3, strides=2, padding="same", activation="relu")(L.BatchNormalization()(x))
    x = L.SeparableConv2D(16, 3, use_bias=False)(L.Add()([x, residual]))
    return L.Dense(10)(L.GlobalMaxPooling2D()(x))


def layer_normalized(x):
    """ConvNeXt's block: a strided patch convolution, LayerNormalization (one with RMS scaling, one without
    center) around a 7x7 depthwise convolution, 1x1 convolutions with GELU and an RMSNormalization of sharded
    channels between them, a residual Add, global pooling and a LayerNormalization of the features."""
    x = L.LayerNormalization(epsilon=1e-6)(L.Conv2D(16, 2, strides=2)(x))
    block = L.LayerNormalization(rms_scaling=True)(L.DepthwiseConv2D(7, padding="same")(x))
    block = L.Conv2D(16, 1)(L.RMSNormalization()(L.Conv2D(32, 1, activation="gelu")(block)))
    x = L.LayerNormalization(center=False)(L.Add()([x, block]))
    return L.Dense(10)(L.LayerNormalization()(L.GlobalAveragePooling2D()(x)))


def per_pixel_dense(x):
    """Dense layers on every pixel's channels (a 1x1 convolution written as Dense, MLP-Mixer's channel MLP): two
    between convolutions (column, then row), a residual Add, pooling, a third before global pooling, Dense logits.
    The sharded Dense took only a 2-D input (or a folded Flatten's) and failed on the first step."""
    x = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    mixed = L.Dense(8)(L.Dense(16, activation="gelu")(x))
    x = L.MaxPooling2D()(L.Add()([x, mixed]))
    return L.Dense(10)(L.GlobalAveragePooling2D()(L.Dense(12, activation="relu")(x)))


def constrained(x):
    """Weight constraints, which Keras's optimizer applies after every update: MaxNorm on a convolution's kernel,
    NonNeg on the next one's, MinMaxNorm on BN's gamma (a norm over channels that may be sharded), UnitNorm on a
    Dense kernel held in another shape (a folded Flatten's) and NonNeg on its bias. The mesh's optimizer left them
    out (its steps unconstrained); applied inside the step function, they undid the update."""
    x = L.Conv2D(8, 3, padding="same", activation="relu",
                 kernel_constraint=keras.constraints.MaxNorm(0.1, [0, 1, 2]))(x)
    x = L.Conv2D(8, 3, padding="same", kernel_constraint="non_neg")(x)
    x = L.BatchNormalization(gamma_constraint=keras.constraints.MinMaxNorm(0.5, 1.0))(x)
    x = L.MaxPooling2D()(L.ReLU()(x))
    return L.Dense(10, kernel_constraint=keras.constraints.UnitNorm(0), bias_constraint="non_neg")(L.Flatten()(x))


def augmented(x):
    """Augmentation at the input (a nested block of RandomFlip and RandomRotation, then RandomTranslation), which
    runs on the host with Keras's layers and seeds and so draws what Single draws; Rescaling after it; a nested
    block with weights (Conv2D, BatchNormalization, ReLU), read in place as its layers."""
    augment = keras.Sequential([L.RandomFlip("horizontal"), L.RandomRotation(0.1)], name="augment")
    x = L.Rescaling(2.0)(L.RandomTranslation(0.1, 0.1)(augment(x)))
    block = keras.Sequential([L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU()], name="block")
    x = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(L.MaxPooling2D()(block(x)))
    return L.Dense(10)(L.Flatten()(x))


def upsampled(x):
    """A U-Net's decoder step: UpSampling2D of sharded channels (column mode before it), concatenated with the
    skip connection's whole ones, cropped, and a 2x3 upsampling of a split batch."""
    skip = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    down = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(L.MaxPooling2D()(skip))
    x = L.Concatenate()([L.UpSampling2D(4)(down), skip])
    x = L.UpSampling2D((2, 3))(L.Conv2D(8, 3, strides=2)(L.Cropping2D(1)(x)))
    return L.Dense(10)(L.GlobalAveragePooling2D()(x))


def transposed(x):
    """Transposed convolutions: a strided "same" one after a strided convolution (on a split batch), one with an
    output padding after a Dense on every pixel (sharded channels), BN after them, an Add with the skip."""
    skip = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = L.Conv2DTranspose(8, 3, strides=2, padding="same")(L.Conv2D(16, 3, strides=2, padding="same")(skip))
    x = L.ReLU()(L.BatchNormalization()(x))
    x = L.Dense(8)(L.Add()([x, skip]))
    x = L.Conv2DTranspose(4, 2, strides=2, output_padding=1, use_bias=False)(L.MaxPooling2D()(x))
    return L.Dense(10)(L.Flatten()(L.BatchNormalization()(x)))


def group_normalized(x):
    """GroupNormalization after a convolution (groups of 2 channels) and twice after a strided one (without
    center, then a group per channel without scale, as instance normalization does), an ActivityRegularization
    layer, global max pooling, a UnitNormalization of the features and Dense logits. The mesh refused the three
    layers by name. (Global average pooling of a group per channel would be its beta alone, whatever the input.)"""
    x = L.ReLU()(L.GroupNormalization(groups=4)(L.Conv2D(8, 3, padding="same")(x)))
    x = L.Conv2D(16, 3, strides=2, padding="same", use_bias=False)(L.Dense(8)(x))
    x = L.GroupNormalization(groups=2, center=False)(x)
    x = L.ActivityRegularization(l1=1e-3, l2=1e-2)(L.GroupNormalization(groups=16, scale=False)(x))
    return L.Dense(10)(L.UnitNormalization()(L.GlobalMaxPooling2D()(x)))


def operations_on_tensors(x):
    """Element-wise operations called on tensors where a user writes them instead of layers: the images divided
    by a number (on the host, before a RandomFlip), a residual ``a + b``, ``keras.ops.relu``, ``gelu`` and
    ``sigmoid``, a product with a number and a difference of a sharded and a whole tensor, squeeze and excitation
    by ``*``, ``keras.activations.relu`` after BatchNormalization, and a number added to the logits. The mesh
    refused them by name."""
    x = L.RandomFlip("horizontal")(x / 2.0)
    a = L.Conv2D(8, 3, padding="same")(x)
    residual = L.Conv2D(8, 1)(keras.ops.relu(a))
    x = keras.ops.gelu(a + residual) * 0.5 - keras.ops.sigmoid(L.Dense(8)(x))
    x = L.MaxPooling2D()(x)
    gate = keras.ops.sigmoid(L.Conv2D(8, 1)(L.GlobalAveragePooling2D(keepdims=True)(x)))
    x = keras.activations.relu(L.BatchNormalization()(L.Conv2D(16, 3, strides=2)(x * gate)))
    return L.Dense(10)(L.GlobalAveragePooling2D()(x)) + 1.0


def convolutional_head(x):
    """MobileNetV3's head: global pooling with ``keepdims``, 1x1 convolutions as the classifier, and a Flatten of
    the logits' 1x1 map (sharded channels under Hybrid) with no Dense after it, then a linear Activation. The
    mesh folded that Flatten into a Dense that never came: the model's output kept its 1x1 map, and Keras's
    loss refused the step (``Argument `output` must have rank (ndim) `target.ndim - 1```)."""
    x = L.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
    x = L.Activation("hard_swish")(L.Conv2D(16, 1)(L.GlobalAveragePooling2D(keepdims=True)(x)))
    x = L.Conv2D(10, 1)(L.Dropout(0.0)(x))
    return L.Activation("linear")(L.Flatten()(x))


def odd_channels(x):
    """Channel counts two shards do not divide (NASNetMobile's separable convolutions of 11 channels, an
    autoencoder's last convolution of 1 or 3): each such layer runs whole on every device. A transposed
    convolution from sharded channels to 3, BN on them, a strided separable convolution to 11, an ``Add`` of two
    convolutions to 5, a 1x1 convolution to 6 (sharded again under Hybrid) and one to 7 from them, a Dense of 15
    units and the logits after it. The mesh refused the separable convolution ("has 11 output channels, which do
    not split over 2 model shards")."""
    x = L.Conv2DTranspose(3, 3, padding="same")(L.Conv2D(8, 3, padding="same", activation="relu")(x))
    x = L.SeparableConv2D(11, 3, strides=2, padding="same", activation="relu")(L.BatchNormalization()(x))
    x = L.Add()([L.Conv2D(5, 3, padding="same")(x), L.Conv2D(5, 1)(x)])
    x = L.Conv2D(7, 3, activation="relu")(L.Conv2D(6, 1, activation="relu")(x))
    return L.Dense(10)(L.Dense(15, activation="relu")(L.Flatten()(x)))


CORPUS = [residual_strided, branches_averaged, normalized_images, subtracted, dense_block, inverted_residuals,
          squeeze_excited, separable, layer_normalized, per_pixel_dense, constrained, augmented, upsampled,
          transposed, group_normalized, operations_on_tensors, convolutional_head, odd_channels]


@functools.cache
def model_of(build):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 1))
    return keras.Model(inputs, build(inputs), name=build.__name__)


@functools.cache
def batch():
    """Eight images whose pixels are float32 values, so a float64 model's float32 ``Input`` loses nothing."""
    rng = np.random.default_rng(0)
    return rng.random((8, 16, 16, 1), dtype="float32"), rng.integers(0, 10, 8)


def after_one_step(build, strategy, dtype, images=8):
    """The weights of ``build``'s model, copied in ``dtype``, after one SGD step on the first ``images`` of
    ``batch()`` under ``strategy``."""
    original = model_of(build)
    model = rebuild.clone_with(original, functools.partial(in_dtype, dtype))
    model.set_weights([w.astype(dtype) for w in original.get_weights()])
    rebuild.set_random_states(model, [state.numpy() for state in rebuild.random_states(original)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = (part[:images] for part in batch())
    cnnpar.fit(model, x.astype(dtype), y, strategy=strategy, batch_size=len(x), shuffle=False, verbose=0,
               results_dir=None)
    return model.get_weights()


def in_dtype(dtype, layer, config):
    """A layer's ``config`` computing in ``dtype``; without regularizers in float64 (an ``ActivityRegularization``
    made an ``Identity``), where Keras cannot add their float64 terms to its float32 loss (a ``TypeError`` under
    Single)."""
    if not isinstance(layer, L.Layer):  # an operation on tensors computes in theirs
        return None
    config.update(dtype=dtype)
    if dtype == "float64":
        config.update({key: None for key in config if key.endswith("_regularizer")})
        if isinstance(layer, L.ActivityRegularization):
            return L.Identity(name=layer.name, dtype=dtype)


@functools.cache
def single_step(build, dtype):
    return after_one_step(build, "single", dtype)


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
@pytest.mark.parametrize("build", CORPUS, ids=lambda build: build.__name__)
def test_one_step_of_a_functional_cnn_is_single_s(build, strategy, dtype):
    assert_same_step(single_step(build, dtype), after_one_step(build, strategy, dtype), TOLERANCE[dtype],
                     before=model_of(build).get_weights())


@pytest.mark.parametrize("build", [residual_strided, branches_averaged, inverted_residuals],
                         ids=lambda build: build.__name__)
def test_a_batch_the_shards_do_not_divide_takes_single_s_step_too(build):
    """Seven images on two shards: what is split over the batch elsewhere is whole on both devices, and the
    convolutions run as im2col (an epoch's last batch meets this)."""
    expected = after_one_step(build, "single", "float64", images=7)
    assert max_difference(after_one_step(build, cnnpar.ChannelSharded(2), "float64", images=7), expected) \
        < TOLERANCE["float64"]
