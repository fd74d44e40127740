"""Tensor parallel on DTensor meshes: sharded layers against their Keras twins, parity, errors, the run log."""

import gc
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.runtime import devices
from keras_cnnpar.strategies.tensor_parallel import ChannelShardedConv2D, ShardedDense, ShardedModel
from keras_cnnpar.strategies.tensor_parallel import strategy as tensor_parallel
from keras_cnnpar.strategies.tensor_parallel.layers import activation_layout, to_mesh, to_numpy
from tests.helpers import (
    SYNCHRONIZED_STEP_TOLERANCE,
    assert_same_step,
    build_residual_cnn,
    build_small_cnn,
    max_difference,
    max_weight_difference,
)

TWINS = {
    "conv same": (lambda: keras.layers.Conv2D(4, 5, padding="same", activation="relu"), (3, 9, 9, 6)),
    "conv valid strided": (lambda: keras.layers.Conv2D(6, 3, strides=2), (3, 9, 9, 4)),
    "dense": (lambda: keras.layers.Dense(8, activation="relu"), (3, 12)),
}


def mesh_of(shape=(2,), axes=("model",)):
    return dtensor.create_mesh(list(zip(axes, shape)), devices=devices.configure(int(np.prod(shape))))


def relative_error(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def keras_forward_and_gradients(layer, x, upstream):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        total = tf.reduce_sum(y * upstream)
    return [y.numpy(), *(g.numpy() for g in tape.gradient(total, [x, *layer.trainable_weights]))]


def sharded_forward_and_gradients(sharded, x, upstream):
    mesh = sharded.mesh
    x = to_mesh(x, activation_layout(mesh, x.shape, sharded.mode == "row"))
    upstream = to_mesh(upstream, dtensor.Layout.replicated(mesh, upstream.ndim))

    @tf.function
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = sharded(x)
            total = tf.reduce_sum(y * upstream)
        return y, tape.gradient(total, [x, *sharded.variables_in_order])

    y, gradients = run(x)
    kernel_shape = sharded.keras_shapes[0]
    return [to_numpy(y), to_numpy(gradients[0]), to_numpy(gradients[1]).reshape(kernel_shape),
            *map(to_numpy, gradients[2:])]


@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("twin", TWINS)
def test_a_sharded_layer_matches_its_keras_twin_forward_and_backward(twin, mode):
    make, shape = TWINS[twin]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype("float32")
    layer = make()
    y = layer(x)
    upstream = rng.standard_normal(y.shape).astype("float32")
    sharded_class = ChannelShardedConv2D if isinstance(layer, keras.layers.Conv2D) else ShardedDense
    sharded = sharded_class(layer, mesh_of(), mode=mode)
    expected = keras_forward_and_gradients(layer, x, upstream)
    got = sharded_forward_and_gradients(sharded, x, upstream)
    for name, a, b in zip(["output", "input gradient", "kernel gradient", "bias gradient"], got, expected):
        assert relative_error(a, b) < 1e-5, name


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
def test_a_saturated_softmax_gets_keras_s_loss_and_gradient_from_its_logits(strategy, batch):
    """Images left at 0-255 saturate the softmax. Keras computes the crossentropy from the softmax's logits; from
    the probabilities, clipped to [1e-7, 1 - 1e-7], the loss had read at most -log(1e-7) = 16.1 a digit (12.8
    against Single's 31.8 here) and the clipped digits had no gradient."""
    def trained(strategy):
        model = build_small_cnn(learning_rate=1e-4)
        history = cnnpar.fit(model, batch[0] * 255, batch[1], strategy=strategy, batch_size=32, epochs=1,
                             shuffle=False, verbose=0, results_dir=None)
        return model, history.history["loss"][0]

    (single, single_loss), (sharded, sharded_loss) = trained("single"), trained(strategy)
    assert single_loss > 20
    assert sharded_loss == pytest.approx(single_loss, rel=1e-5)
    assert_same_step(single, sharded, 1e-4, before=build_small_cnn())


@pytest.mark.parametrize("loss", ["binary_crossentropy", "crossentropy"])
def test_a_binary_classifier_with_labels_of_shape_n_takes_single_s_step(loss, batch):
    """Keras's compile wraps a loss function so that labels of shape (n,) meet predictions of (n, 1), and reads
    "crossentropy" by the shapes; the mesh step called the function itself and failed on the ranks."""
    def trained(strategy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                                  keras.layers.Flatten(), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        history = cnnpar.fit(model, batch[0], (batch[1] % 2).astype("float32"), strategy=strategy, batch_size=32,
                             shuffle=False, verbose=0, results_dir=None)
        return model, history.history["loss"][0]

    (single, single_loss), (sharded, sharded_loss) = trained("single"), trained(cnnpar.ChannelSharded(2))
    assert sharded_loss == pytest.approx(single_loss, rel=1e-5)
    assert max_weight_difference(single, sharded) < 1e-5


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
def test_an_autoencoder_whose_output_is_a_one_channel_image_takes_single_s_step(strategy, batch):
    """A convolutional autoencoder as Keras's examples write it: its last convolution has 1 output channel, which
    no shard count divides, so it runs whole on every device, and the model's output is an image. The mesh
    refused that convolution ("has 1 output channels, which do not split over 2 model shards"), and its step
    returned the predictions laid out as a matrix ("requires matching rank for layout and input")."""
    def trained(strategy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2DTranspose(8, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        initial = model.get_weights()
        history = cnnpar.fit(model, batch[0], batch[0], strategy=strategy, batch_size=32, shuffle=False, verbose=0,
                             results_dir=None)
        return initial, model.get_weights(), history.history

    initial, single, single_logs = trained("single")
    _, sharded, sharded_logs = trained(strategy)
    assert sharded_logs["loss"][0] == pytest.approx(single_logs["loss"][0], rel=1e-5)
    assert sharded_logs["mae"][0] == pytest.approx(single_logs["mae"][0], rel=1e-5)
    assert_same_step(single, sharded, 1e-5, before=initial)


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
@pytest.mark.parametrize("optimizer", ["sgd", "nesterov", "adam", "adam with a schedule", "adamw", "sgd with decay",
                                       "rmsprop", "rmsprop centered with momentum", "adagrad", "adamax", "lion",
                                       "momentum clipped by norm", "nesterov clipped by global norm",
                                       "momentum clipped by value"])
def test_two_steps_match_single_within_1e_4(strategy, optimizer, few_digits):
    """The schedule halves the rate at every step; the mesh optimizer had taken the epoch's rate (1e-2) for both
    steps. AdamW (its decay not on the biases), SGD with weight decay and RMSprop were refused before 2026-12-04;
    RMSprop's slots are ordered by kind, not by variable; Adagrad (from an initial accumulator value of its own),
    Adamax and Lion (with weight decay) were refused until later that day, and Keras's clipping (each setting
    binds: unclipped, Single's weights end 1.8 to 2.0 away) until 2026-12-04's next stop."""
    halved = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)
    optimizers = {"sgd": lambda: keras.optimizers.SGD(0.1),
                  "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                  "adam": lambda: keras.optimizers.Adam(1e-3),
                  "adam with a schedule": lambda: keras.optimizers.Adam(halved),
                  "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.5),
                  "sgd with decay": lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.5),
                  "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
                  "rmsprop centered with momentum": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9, centered=True),
                  "adagrad": lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.5),
                  "adamax": lambda: keras.optimizers.Adamax(2e-3),
                  "lion": lambda: keras.optimizers.Lion(1e-3, weight_decay=0.5),
                  "momentum clipped by norm": lambda: keras.optimizers.SGD(1.0, momentum=0.5, clipnorm=0.01),
                  "nesterov clipped by global norm": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True,
                                                                                   global_clipnorm=0.05),
                  "momentum clipped by value": lambda: keras.optimizers.SGD(1.0, momentum=0.5, clipvalue=1e-3)}

    def trained(strategy):
        model = build_small_cnn()
        model.compile(optimizer=optimizers[optimizer](), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.optimizer.exclude_from_weight_decay(var_names=["bias"])
        cnnpar.fit(model, few_digits[0][:64], few_digits[1][:64], strategy=strategy, batch_size=32, epochs=1,
                   shuffle=False, verbose=0, results_dir=None)
        return model

    single, sharded = trained("single"), trained(strategy)
    assert_same_step(single, sharded, 1e-4, before=build_small_cnn())
    assert int(sharded.optimizer.iterations.numpy()) == 2
    slots = [rebuild.optimizer_state(model.optimizer)[1:] for model in (single, sharded)]
    if optimizer != "sgd":  # plain SGD has no slots; the others have one or two per variable
        assert max_difference(*slots) < 1e-4  # the slots came back (an empty list fails the helper)


def test_convolutions_leave_the_batch_split_dense_layers_alternate_and_every_kernel_is_sharded():
    sharded = ShardedModel(cnnpar.models.cnn("3+3"), mesh_of())
    column, row = ("column", ("unsharded", "model")), ("row", ("model", "unsharded"))
    assert [(layer.mode, layer.kernel_layout[-2:]) for layer in sharded.sharded_layers] == [
        column, column, column, row, column, row]
    # From the first convolution to the Flatten every tensor is split over the batch (the padding of the images
    # before it is whole); the Dense after it takes the flattened features sharded (its kernel's rows).
    assert [node.tensor.batch_split for node in sharded.nodes] == [False] + [True] * 8 + [False] * 5
    assert sharded.sharded_layers[3].kernel.shape == (1568, 128)
    report = sharded.report()
    assert "mesh {'model': 2} over 2 devices" in report
    assert "parameters: 986,728 bytes in all, 493,640 bytes per device" in report


def normalized_stack(seed=0):
    """Three convolutions, each followed by BatchNormalization and a ReLU, global pooling and Dense logits."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((28, 28, 1))
    x = inputs
    for _ in range(3):
        x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class PeakMemory(keras.callbacks.Callback):
    """The most the CPU allocator held above an epoch's start, over the epochs after the first (which traces the
    step): what a step allocates and frees (activations, gradients and their temporaries), after collecting the
    garbage of earlier tests. The allocator's own peak counted whatever earlier tests had left (its "current" read
    0 at the start): ChannelSharded over DataParallel(2) read above 1.1x after other tests, 1.00-1.06x alone;
    measured this way, 0.98-1.02x either way and beside two busy processes."""

    def on_train_begin(self, logs=None):
        self.bytes = 0

    def on_epoch_begin(self, epoch, logs=None):
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        self.base = tf.config.experimental.get_memory_info("CPU:0")["current"]

    def on_epoch_end(self, epoch, logs=None):
        if epoch:
            self.bytes = max(self.bytes, tf.config.experimental.get_memory_info("CPU:0")["peak"] - self.base)


@pytest.mark.parametrize("strategy, reference, bound", [(cnnpar.ChannelSharded(2), cnnpar.DataParallel(2), 1.1),
                                                       (cnnpar.Hybrid(data=2, model=2), cnnpar.Single(), 2.5)],
                         ids=repr)
def test_a_normalized_cnn_holds_about_what_its_share_of_the_batch_needs(strategy, reference, bound, few_digits):
    # ChannelSharded(2) holds half a batch of activations per device, as DataParallel(2) does: each
    # normalization's centred input, which TensorFlow's gradient of tf.nn.moments computed in the forward pass
    # under DTensor and kept, made it 1.28x. Hybrid(2, 2)'s four devices hold half a batch each, with channels
    # whole or halved: at most twice what Single holds for the whole batch, 1.3-1.6x measured; im2col's stacked
    # windows made it about 5x. Single is the reference there because one device's step holds the whole batch
    # however the cores are shared; DataParallel(4)'s peak depends on how far its replicas' steps overlap, and
    # read 17.5 MB under CI's load against 23-25 MB otherwise.
    x, y = few_digits[0][:128], few_digits[1][:128]
    peaks = {}
    for candidate in (reference, strategy):
        peaks[candidate.alias] = PeakMemory()
        cnnpar.fit(normalized_stack(), x, y, strategy=candidate, epochs=4, batch_size=64, verbose=0,
                   callbacks=[peaks[candidate.alias]], results_dir=None)
    assert peaks[strategy.alias].bytes < bound * peaks[reference.alias].bytes


def test_on_a_mesh_with_a_batch_axis_every_layer_alternates_column_and_row():
    sharded = ShardedModel(cnnpar.models.cnn("3+3"), mesh_of((2, 2), ("batch", "model")))
    assert [layer.mode for layer in sharded.sharded_layers] == ["column", "row"] * 3


def test_a_logits_layer_runs_in_row_mode_so_ten_classes_need_not_split_over_four_shards(few_digits):
    model = cnnpar.models.cnn("2+2")
    sharded = ShardedModel(model, mesh_of((4,)))
    assert [layer.mode for layer in sharded.sharded_layers] == ["column", "column", "row", "row"]
    x = few_digits[0][:8]
    assert max_difference(sharded.forward(x), model.predict(x, verbose=0)) < 1e-5


def test_a_layer_whose_channels_the_shards_do_not_divide_runs_whole_on_every_device():
    """LeNet's 6 channels over 4 shards: the convolution keeps its kernel whole (its output split over the batch,
    as every convolution's on this mesh); the Dense layers after it shard their input features (row mode)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(16), keras.layers.Dense(10)])
    sharded = ShardedModel(model, mesh_of((4,)))
    assert [layer.mode for layer in sharded.sharded_layers] == ["whole", "row", "row"]
    assert dtensor.fetch_layout(sharded.sharded_layers[0].kernel).is_fully_replicated()
    x = np.random.default_rng(0).random((8, 8, 8, 1), dtype="float32")
    assert max_difference(sharded.forward(x), model.predict(x, verbose=0)) < 1e-5


def test_a_sharded_layer_built_with_channels_its_shards_do_not_divide_names_them_and_the_divisors():
    conv = keras.layers.Conv2D(6, 3, name="conv")
    conv.build((None, 8, 8, 1))
    with pytest.raises(ValueError) as raised:
        ChannelShardedConv2D(conv, mesh_of((4,)), mode="column")
    assert str(raised.value) == ("layer 'conv' (column mode) has 6 output channels, which do not split over 4 "
                                 "model shards; shard counts that divide 6: [1, 2, 3, 6], or mode='whole'. "
                                 "Received: model shards=4")


def test_an_unsupported_layer_is_named_with_the_supported_ones():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3), keras.layers.PReLU(name="act"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    with pytest.raises(ValueError) as raised:
        ShardedModel(model, mesh_of())
    assert str(raised.value) == (
        "channel sharding cannot convert layer 'act' of type PReLU; the supported layers are Conv2D, "
        "Dense, BatchNormalization, LayerNormalization, RMSNormalization, GroupNormalization, DepthwiseConv2D, "
        "SeparableConv2D, Conv2DTranspose, Normalization, MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D, "
        "GlobalMaxPooling2D, ZeroPadding2D, Cropping2D, UpSampling2D, Flatten, Reshape, Dropout, SpatialDropout2D, "
        "Activation, ReLU, LeakyReLU, ELU, Softmax, "
        "Rescaling, Identity, UnitNormalization, ActivityRegularization, "
        "Add, Subtract, Multiply, Average, Maximum, Minimum, Concatenate, and at the model's input, before them, any "
        "layer without weights (augmentation such as RandomFlip, which runs on the host). Received: layer='act' "
        "(PReLU)")


def test_a_reshape_other_than_adding_or_removing_unit_axes_is_refused_after_the_input():
    layers = keras.layers
    model = keras.Sequential([keras.Input((4, 4, 2)), layers.Conv2D(2, 1), layers.Reshape((8, 4), name="fold"),
                              layers.Flatten(), layers.Dense(10)])
    with pytest.raises(ValueError) as raised:
        ShardedModel(model, mesh_of())
    assert str(raised.value) == (
        "channel sharding converts a Reshape that only adds or removes axes of size 1 before the channels (a "
        "squeeze-and-excitation block's), or one in the chain of weightless layers at the model's input (which "
        "runs on the host); layer 'fold' reshapes (4, 4, 2) to (8, 4). Received: target_shape=(8, 4)")


@pytest.mark.parametrize("dropout, kept_whole", [
    (keras.layers.Dropout(0.5, noise_shape=(None, 1, 1, 1)), (1, 2, 3)),  # EfficientNet's drop-connect: an example
    (keras.layers.SpatialDropout2D(0.5), (1, 2)),  # a channel of an example
], ids=["noise_shape", "spatial"])
def test_dropout_keeps_keras_s_noise_shape(dropout, kept_whole):
    model = keras.Sequential([keras.Input((4, 4, 2)), dropout])
    sharded = ShardedModel(model, mesh_of())
    x = to_mesh(np.ones((32, 4, 4, 2), "float32"), dtensor.Layout.replicated(sharded.mesh, 4))
    y = to_numpy(tf.function(lambda x: sharded(x, training=True))(x))
    assert (y.min(axis=kept_whole) == y.max(axis=kept_whole)).all()  # one mask value where Keras's noise shape is 1
    assert set(np.unique(y)) == {0.0, 2.0} and 0.2 < float(np.mean(y == 0)) < 0.8


def test_a_mesh_larger_than_the_devices_lists_them():
    with pytest.raises(ValueError) as raised:
        cnnpar.Hybrid(data=4, model=2).mesh()
    assert str(raised.value) == (
        "a mesh of 4 x 2 needs 8 devices, but TensorFlow has 4: ['/device:CPU:0', '/device:CPU:1', "
        "'/device:CPU:2', '/device:CPU:3']. Call cnnpar.devices.configure(8) before TensorFlow starts, or use "
        "fewer devices. Received: <Hybrid data=4 model=2>")


@pytest.mark.parametrize("users_value", [None, "yes"])
def test_the_mesh_has_dtensor_gather_with_collective_gather_unless_the_user_chose(monkeypatch, users_value):
    # DTensor's default all-gather on CPU keeps a constant zero tensor of every gathered activation's shape on
    # every device (41.5 of the resnet's 139 MiB, docs/measurements/2026-12-02-zen5.md); the switch is read at
    # compile time.
    if users_value is None:
        monkeypatch.delenv(tensor_parallel.GATHER_SWITCH, raising=False)
    else:
        monkeypatch.setenv(tensor_parallel.GATHER_SWITCH, users_value)
    cnnpar.ChannelSharded(2).mesh()
    assert os.environ[tensor_parallel.GATHER_SWITCH] == (users_value or "1")


@pytest.mark.parametrize("kwargs, message", [
    ({"data": 0}, "data must be a positive int. Received: data=0"),
    ({"model": "2"}, "model must be a positive int. Received: model='2'"),
])
def test_hybrid_validates_its_arguments(kwargs, message):
    with pytest.raises(ValueError) as raised:
        cnnpar.Hybrid(**kwargs)
    assert str(raised.value) == message


def functional_chain(seed=0):
    """``build_small_cnn`` written with the functional API, as the TensorFlow tutorials write CNNs."""
    sequential = build_small_cnn(seed=seed)
    inputs = keras.Input((28, 28, 1))
    outputs = inputs
    for layer in sequential.layers:
        outputs = layer(outputs)
    model = keras.Model(inputs, outputs, name="functional_cnn")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
def test_a_functional_chain_is_sharded_like_its_sequential_twin(strategy, few_digits):
    x, y = few_digits[0][:64], few_digits[1][:64]
    single, sharded = functional_chain(), functional_chain()
    cnnpar.fit(single, x, y, strategy="single", batch_size=64, shuffle=False, verbose=0, results_dir=None)
    cnnpar.fit(sharded, x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0, results_dir=None)
    assert_same_step(single, sharded, 1e-4, before=functional_chain())


def flat_pixels_cnn():
    """A Kaggle CSV's rows as they come, 784 pixels, reshaped to images inside the model."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((784,)), keras.layers.Rescaling(1 / 255), keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
def test_a_model_that_reshapes_flat_pixels_to_images_reshapes_them_on_the_host(strategy, few_digits):
    """A Reshape of the pixels to images is no reshape of channels the mesh can shard: it was refused ("only adds
    or removes axes of size 1"). At the input, with the Rescaling before it, it runs on the host."""
    x, y = few_digits[0][:128].reshape(128, 784), few_digits[1][:128]
    settings = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (x[:64], y[:64])}
    expected, sharded = flat_pixels_cnn(), flat_pixels_cnn()
    history = expected.fit(x, y, **settings).history
    got = cnnpar.fit(sharded, x, y, strategy=strategy, results_dir=None, **settings).history
    assert {key: got[key] for key in history} == {key: pytest.approx(value, abs=1e-5) for key, value in history.items()}
    assert max_weight_difference(sharded, expected) < 1e-5


def dotted_cnn():
    """Names that are no Python identifiers, as Keras allows: ``keras.applications.MobileNetV2`` names itself
    ``mobilenetv2_1.00_224`` (sharding it failed on that name before naming its DepthwiseConv2D)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(8, 3, activation="relu", name="conv.1")(inputs)
    x = keras.layers.MaxPooling2D(name="2-pool")(x)
    x = keras.layers.Flatten(name="flat-10")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="out.v1")(x)
    model = keras.Model(inputs, outputs, name="cnn_1.00_28")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def test_layers_and_models_named_as_keras_allows_are_sharded(few_digits):
    x, y = few_digits[0][:64], few_digits[1][:64]
    single, sharded = dotted_cnn(), dotted_cnn()
    cnnpar.fit(single, x, y, strategy="single", batch_size=64, shuffle=False, verbose=0, results_dir=None)
    cnnpar.fit(sharded, x, y, strategy="channels", batch_size=64, shuffle=False, verbose=0, results_dir=None)
    assert_same_step(single, sharded, 1e-4, before=dotted_cnn())


def branching_cnn(seed=0):
    """A functional CNN with the other graph layers: rescaling, a strided 1x1 convolution, a concatenation, a
    subtraction of a whole tensor from a sharded one, global average pooling (no batch statistics). The comments
    give the layouts on ChannelSharded's 1-D mesh, then on Hybrid's 2-D mesh."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Rescaling(2.0, offset=-1.0)(inputs)
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="a")(x)  # column: sharded
    b = keras.layers.Conv2D(8, 1, strides=2, name="b")(a)  # column: sharded; row: whole
    c = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu", name="c")(a)  # column; row
    d = keras.layers.Conv2D(8, 3, padding="same", name="d")(c)  # column: sharded; column: sharded
    joined = keras.layers.Concatenate(name="joined")([b, d])  # gathered: whole
    e = keras.layers.Conv2D(16, 3, padding="same", name="e")(joined)  # column: sharded
    difference = keras.layers.Subtract(name="difference")([e, joined])  # sharded - whole: joined cut into shards
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(difference)
    outputs = keras.layers.Dense(10, activation="softmax", name="out")(pooled)
    model = keras.Model(inputs, outputs, name="branching_cnn")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("builder", [branching_cnn, build_residual_cnn])
@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(data=2, model=2)], ids=repr)
def test_a_graph_with_branches_takes_single_s_step(builder, strategy, few_digits):
    x, y = few_digits[0][:64], few_digits[1][:64]
    single, sharded = builder(), builder()
    cnnpar.fit(single, x, y, strategy="single", batch_size=64, shuffle=False, verbose=0, results_dir=None)
    cnnpar.fit(sharded, x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0, results_dir=None)
    # the residual CNN's BatchNormalization gradient rounds as tests/helpers.py explains: on sharded channels, or
    # with Hybrid's split batch, it is summed in another order (in float64 both strategies are within 3e-9)
    assert_same_step(single, sharded, SYNCHRONIZED_STEP_TOLERANCE if builder is build_residual_cnn else 1e-4,
                     before=builder())


def test_each_layer_of_a_graph_takes_its_mode_from_its_input_s_layout_and_the_mesh():
    modes = [{layer.name: layer.mode for layer in ShardedModel(branching_cnn(), mesh).sharded_layers}
             for mesh in (mesh_of(), mesh_of((2, 2), ("batch", "model")))]
    assert modes == [
        {"a": "column", "b": "column", "c": "column", "d": "column", "e": "column", "out": "row"},
        {"a": "column", "b": "row", "c": "row", "d": "column", "e": "column", "out": "row"}]


@pytest.mark.parametrize("build, message", [
    (lambda x: keras.ops.mean(keras.layers.Dense(4)(x), axis=(1, 2)),  # Keras names it 'mean', or 'mean_N'
     "channel sharding converts layers, and element-wise operations on tensors (Add, Subtract, Multiply, Divide, "
     "TrueDivide, Maximum, Minimum, Negative, Abs, Square, Sqrt, Exp, Relu, Relu6, ReLU, Gelu, Silu, Sigmoid, "
     "HardSigmoid, HardSilu, Tanh, LeakyRelu, Elu, Selu, Softplus, Softsign); the model calls the operation Mean "
     "('{operation}') on tensors: use a layer instead, for example keras.layers.GlobalAveragePooling2D() for "
     "keras.ops.mean(x, axis=(1, 2)). Received: operation '{operation}'"),
    (lambda x: keras.layers.Add()([x, SHARED(SHARED(x))]),
     "channel sharding converts each layer once; the model calls ['shared'] more than once (shared weights). "
     "Received: model 'graph'"),
    (lambda x: keras.layers.BatchNormalization(axis=1, name="norm")(x),
     "channel sharding supports BatchNormalization over the last axis without renorm; layer 'norm' has axis=1, "
     "renorm=False. Received: axis=1, renorm=False"),
    (lambda x: keras.layers.Concatenate(axis=1, name="rows")([x, x]),
     "channel sharding concatenates on the channel (last) axis only; layer 'rows' has axis=1. Received: axis=1"),
])
def test_a_graph_that_cannot_be_sharded_is_refused_with_the_reason(build, message):
    inputs = keras.Input((4, 4, 2))
    model = keras.Model(inputs, build(inputs), name="graph")
    with pytest.raises((TypeError, ValueError)) as raised:
        ShardedModel(model, mesh_of())
    operations = [op.name for op in model.operations if not isinstance(op, keras.layers.Layer)]
    assert str(raised.value) == message.format(operation=operations[0] if operations else None)


SHARED = keras.layers.Dense(2, name="shared")
