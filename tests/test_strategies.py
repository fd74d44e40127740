import inspect
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar import strategies
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.plan import checks
from keras_cnnpar.runtime import devices
from keras_cnnpar.strategies import memory, registry
from tests.helpers import (
    IN_PROCESS,
    assert_same_step,
    build_small_cnn,
    max_difference,
    max_weight_difference,
    one_sgd_step,
    two_inputs_two_outputs,
)

#: The aliases of the public API: a new strategy may join them, none may go.
NAMES_OF_THE_API = ["async-ps", "channels", "hybrid", "layers", "mirrored", "multi-worker", "single"]
#: AsyncPS trains in a coordinator process and a cluster of its own: left out of the quick tier.
ASYNC_PS = pytest.param("async-ps", marks=pytest.mark.slow)


def test_every_registered_alias_names_a_strategy_class_that_declares_it():
    assert set(NAMES_OF_THE_API) <= set(strategies.names())
    for entry in registry.entries():
        cls = entry.load()
        assert issubclass(cls, strategies.Strategy) and cls.alias == entry.alias
        assert entry.description and entry.description == cls.description
        assert (entry.min_devices, entry.max_devices, entry.device_multiple, entry.device_option,
                entry.keeps_checkpoints, entry.needs_cluster) == (
            cls.min_devices, cls.max_devices, cls.device_multiple, cls.device_option, cls.keeps_checkpoints,
            cls.needs_cluster)
        assert set(entry.options) == set(inspect.signature(cls).parameters)


def test_aliases_resolve_to_strategy_objects():
    assert repr(strategies.resolve("single")) == "<Single devices=1>"
    assert repr(strategies.resolve("mirrored")) == "<DataParallel devices=2 scale_lr=None>"
    strategy = cnnpar.DataParallel(devices=2)
    assert strategies.resolve(strategy) is strategy


def test_unknown_alias_lists_the_valid_names():
    with pytest.raises(ValueError) as raised:
        strategies.resolve("horovod")
    assert str(raised.value) == \
        f"unknown strategy 'horovod'; valid names are {strategies.names()}. Received: strategy='horovod'"


def test_strategy_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError) as raised:
        strategies.resolve(2)
    assert str(raised.value) == \
        f"strategy must be a cnnpar strategy object or one of {strategies.names()}. Received: strategy=2 of type int"


@pytest.mark.parametrize("kwargs, error, message", [
    ({"devices": 0}, ValueError, "devices must be at least 1. Received: devices=0"),
    ({"devices": "two"}, TypeError, "devices must be an int or a list of device names. Received: devices='two'"),
    ({"scale_lr": "cubic"}, ValueError, "scale_lr must be 'linear', 'sqrt' or None. Received: scale_lr='cubic'"),
])
def test_data_parallel_validates_its_arguments(kwargs, error, message):
    with pytest.raises(error) as raised:
        cnnpar.DataParallel(**kwargs)
    assert str(raised.value) == message


def test_create_rejects_options_a_strategy_does_not_take():
    with pytest.raises(ValueError, match=r"^strategy 'single' takes no devices. Received: devices=2$"):
        strategies.create("single", devices=2)
    assert repr(strategies.create("mirrored", devices=2, scale_lr="sqrt")) == \
        "<DataParallel devices=2 scale_lr=sqrt>"


def test_configure_after_the_runtime_started_says_what_to_do():
    with pytest.raises(RuntimeError) as raised:
        devices.configure(8, kind="CPU")
    assert str(raised.value) == (
        "8 CPU devices are needed, but TensorFlow's runtime already started with 4: "
        "['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']. Logical devices can only be "
        "created before the runtime starts: call cnnpar.devices.configure(8) at the top of your program, "
        "before building any model "
        "or tensor (the `cnnpar` CLI does this for you).")
    assert devices.configure(2, kind="CPU") == ["/device:CPU:0", "/device:CPU:1"]


def test_device_names_are_checked():
    assert devices.resolve(["/cpu:1", "/CPU:0"]) == ["/device:CPU:1", "/device:CPU:0"]
    with pytest.raises(ValueError, match=r"^unknown device names \['/gpu:3'\]; TensorFlow has "
                                         r"\['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3'\]. "
                                         r"Received: devices=\['/gpu:3'\]$"):
        devices.resolve(["/gpu:3"])


@pytest.mark.parametrize("strategy", [
    cnnpar.DataParallel(devices=2),
    cnnpar.DataParallel(devices=["/cpu:0", "/cpu:1"]),
], ids=repr)
def test_one_sgd_step_matches_single_within_1e_5(small_cnn, digits, strategy):
    x, y = digits.x[::78][:64], digits.y[::78][:64]
    single, parallel = small_cnn(seed=1), small_cnn(seed=1)
    assert max_weight_difference(single, parallel) == 0.0
    one_sgd_step(single, "single", (x, y))
    one_sgd_step(parallel, strategy, (x, y))
    assert_same_step(single, parallel, 1e-5, before=small_cnn(seed=1))


def doubled_cross_entropy(y_true, y_pred):
    """A plain function as the loss: Keras finds one by name only when it is registered."""
    return 2.0 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)


@pytest.mark.parametrize("strategy", ["single", "layers", "channels"])
def test_a_plain_function_as_the_loss_and_loss_weights_give_keras_s_own_step(few_digits, strategy):
    """Every in-process strategy trains a copy compiled from the model's config, which named the function
    without finding it (a TypeError, under Single too, as ``keras.models.clone_model`` of the model raises); the
    tensor-parallel loss left ``loss_weights`` out (twice Keras's loss). Mirrored copies the model as Single
    does, Hybrid computes the loss as ChannelSharded does."""
    x, y = few_digits[0][:64], few_digits[1][:64]
    keras_model, model = (build_small_cnn() for _ in range(2))
    for each in (keras_model, model):
        each.compile(optimizer=keras.optimizers.SGD(0.1), loss=doubled_cross_entropy, loss_weights=0.5)
    expected = keras_model.fit(x, y, batch_size=64, shuffle=False, verbose=0).history["loss"]
    history = one_sgd_step(model, strategy, (x, y)).history
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert max_weight_difference(model, keras_model) < 1e-4


WEIGHTS = {"sample_weight": {"sample_weight": np.linspace(0.2, 1.8, 64, dtype=np.float32)},
           "class_weight": {"class_weight": {c: 0.5 + c / 5 for c in range(10)}}}


@pytest.mark.parametrize("strategy, weights", [
    *[(strategy, weights) for strategy in ("single", "mirrored", "layers", "channels", "hybrid")
      for weights in sorted(WEIGHTS)],
    pytest.param("async-ps", "class_weight", marks=pytest.mark.slow)])  # one run (the weights reach it alike)
def test_sample_and_class_weights_give_keras_s_own_step(few_digits, strategy, weights):
    """They went to Keras's ``fit`` beside the dataset made of the arrays, which Keras refuses for sample weights
    (under Single too) and cannot map for class weights on MirroredStrategy's distributed dataset; the loops of
    AsyncPS and the mesh refused them. (One step of AsyncPS falls in its warm-up, where nothing is stale.)"""
    x, y = few_digits[0][:64], few_digits[1][:64]
    keras_model, model = build_small_cnn(), build_small_cnn()
    expected = keras_model.fit(x, y, batch_size=64, shuffle=False, verbose=0, **WEIGHTS[weights]).history["loss"]
    history = cnnpar.fit(model, x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0, results_dir=None,
                         **WEIGHTS[weights])
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert_same_step(keras_model, model, 1e-5, before=build_small_cnn())


class Batches(keras.utils.PyDataset):
    """The first 64 digits in batches of 16, counting its passes."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.passes = x, y, 0

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return self.x[16 * index:16 * (index + 1)], self.y[16 * index:16 * (index + 1)]

    def on_epoch_end(self):
        self.passes += 1


@pytest.mark.parametrize("strategy", ["single", "mirrored", "channels", "layers"])
def test_a_py_dataset_and_a_generator_train_as_their_arrays_do(few_digits, strategy):
    """Both failed before reaching any strategy (``len()`` of a generator; numpy of a PyDataset); a PyDataset is
    validation data too, as in Keras. Until 2026-12-04's last stop, LayerPlacement's look at the first batch (to
    time its stages) took it from the generator, and training began at the second (weights 0.64 off)."""
    x, y = few_digits[0][:64], few_digits[1][:64]
    from_arrays, from_batches, from_generator = build_small_cnn(), build_small_cnn(), build_small_cnn()
    expected = cnnpar.fit(from_arrays, x, y, strategy=strategy, batch_size=16, epochs=2, shuffle=False, verbose=0,
                          validation_data=(x, y), results_dir=None).history
    batches = Batches(x, y)
    history = cnnpar.fit(from_batches, batches, strategy=strategy, epochs=2, verbose=0, results_dir=None,
                         validation_data=Batches(x, y)).history
    assert (len(history["loss"]), batches.passes) == (2, 2)  # on_epoch_end after each pass, as in Keras
    assert history["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    endless = (batches[index % 4] for index in itertools.count())
    cnnpar.fit(from_generator, endless, strategy=strategy, epochs=2, steps_per_epoch=4, verbose=0, results_dir=None)
    assert max_weight_difference(from_batches, from_arrays) < 1e-5
    assert max_weight_difference(from_generator, from_arrays) < 1e-5


SPLIT_BATCH = {"accumulate=2": lambda: cnnpar.Single(accumulate=2),
               "microbatches=2": lambda: cnnpar.LayerPlacement(2, microbatches=2)}


@pytest.mark.parametrize("inputs", ["list", "dict"])
@pytest.mark.parametrize("strategy", ["single", "mirrored", "layers", *SPLIT_BATCH])
def test_several_inputs_and_outputs_as_arrays_give_keras_s_own_step(few_digits, strategy, inputs):
    """numpy made one ragged array of the list (and ``len()`` failed on the dict) under every strategy; the
    batch's split into micro-batches took the first tensor alone, and accumulation's epoch loss read 0.0 and named
    each output's loss after its function (``mse_loss``)."""
    strategy = SPLIT_BATCH[strategy]() if strategy in SPLIT_BATCH else strategy
    x, y = few_digits[0][:64], few_digits[1][:64]
    features = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    x = [x, features] if inputs == "list" else {"image": x, "features": features}
    y = [y, (y % 2).astype(np.float32)]
    keras_model, model = two_inputs_two_outputs(), two_inputs_two_outputs()
    expected = keras_model.fit(x, y, batch_size=64, shuffle=False, verbose=0, validation_split=0.25).history
    history = cnnpar.fit(model, x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0, results_dir=None,
                         validation_split=0.25).history  # 48 examples trained, the last 16 validated
    for name in ("loss", "digit_loss", "parity_loss", "val_loss"):
        assert history[name] == pytest.approx(expected[name], rel=1e-5), name
    assert_same_step(keras_model, model, 1e-5, before=two_inputs_two_outputs())


@pytest.mark.parametrize("strategy, reason", [
    ("mirrored", "its replicas are logical devices of one CPU, and XLA compiles a step for one device (a variable of "
                 "another replica is an error there)"),
    ("layers", "its stages run on different devices, and XLA compiles a step for one device")])
def test_jit_compile_where_xla_cannot_compile_the_step_is_turned_off_with_a_warning(few_digits, strategy, reason):
    """XLA failed the first step ("Trying to access resource ... located in device CPU:1 from device CPU:0")."""
    x, y = few_digits[0][:64], few_digits[1][:64]
    single, parallel = (build_small_cnn() for _ in range(2))
    for model in (single, parallel):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", jit_compile=True)
    one_sgd_step(single, "single", (x, y))  # XLA compiles Single's step
    with pytest.warns(UserWarning) as warned:
        one_sgd_step(parallel, strategy, (x, y))
    name = type(strategies.resolve(strategy)).__name__
    assert f"{name} trains with jit_compile=False: {reason}" in [str(w.message) for w in warned]
    assert max_weight_difference(single, parallel) < 1e-5
    assert parallel.jit_compile is True  # the user's model keeps its setting


class TrainedState(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        self.model_trained, self.weights = self.model, self.model.get_weights()
        self.slots = [v.numpy() for v in rebuild.optimizer_state(self.model.optimizer)]


def test_trained_weights_and_optimizer_state_land_in_the_users_model(small_cnn, few_digits, tmp_path):
    (x, y), trained = few_digits, TrainedState()
    model = small_cnn(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    history = model.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0, callbacks=[trained],
                        strategy=cnnpar.DataParallel(2), results_dir=None)
    assert trained.model_trained is model  # callbacks see the user's model, at the end with ...
    assert max_difference(trained.weights, model.get_weights()) == 0.0  # ... the weights the copy trained,
    user_slots = [v.numpy() for v in rebuild.optimizer_state(model.optimizer)]
    assert len(user_slots) == 1 + len(model.trainable_variables)  # iterations, one momentum per variable
    assert max_difference(trained.slots, user_slots) == 0.0  # ... with its optimizer state
    assert max(float(np.abs(slot).max()) for slot in user_slots[1:]) > 1e-4  # (momentum really accumulated)
    assert isinstance(history, keras.callbacks.History) and history.model is model and model.history is history
    assert int(model.optimizer.iterations.numpy()) == 8
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0, strategy="single", results_dir=None)
    assert int(model.optimizer.iterations.numpy()) == 12
    model.export(str(tmp_path / "export"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(loaded.serve(x[:16]).numpy(), model.predict(x[:16], verbose=0), atol=1e-5)


@pytest.mark.parametrize("scale_lr, factor", [("linear", 2.0), ("sqrt", 2 ** 0.5), (None, 1.0)])
def test_scale_lr_scales_the_rate_while_training_only(small_cnn, few_digits, scale_lr, factor):
    model, strategy = small_cnn(learning_rate=0.1), cnnpar.DataParallel(2, scale_lr=scale_lr)
    assert float(strategy.prepare(model).model.optimizer.learning_rate.numpy()) == pytest.approx(0.1 * factor)
    model.fit(*few_digits, batch_size=64, verbose=0, results_dir=None, strategy=strategy)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.1)


def test_scale_lr_refuses_a_schedule(digits):
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
                  loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"^scale_lr needs an optimizer with a constant learning rate; "
                                         r"pass scale_lr=None to keep a schedule. Received: learning_rate="):
        cnnpar.fit(model, digits.x[:64], digits.y[:64], strategy=cnnpar.DataParallel(2, scale_lr="linear"),
                   results_dir=None)


def test_user_callbacks_and_validation_run_every_epoch(small_cnn, few_digits):
    seen = []
    logger = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, sorted(logs))))
    small_cnn().fit(few_digits[0][:128], few_digits[1][:128], batch_size=32, epochs=3, validation_split=0.25, verbose=0,
                    callbacks=[logger], strategy="mirrored", results_dir=None)
    assert seen == [(e, ["accuracy", "loss", "val_accuracy", "val_loss"]) for e in range(3)]


def test_uncompiled_model_is_refused_before_anything_runs(digits):
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    with pytest.raises(ValueError, match=r"^model 'sequential(_\d+)?' is not compiled; call model.compile"):
        cnnpar.fit(model, digits.x[:8], digits.y[:8], results_dir=None)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
@pytest.mark.parametrize("samples, batch_size", [(130, 64), (128, 16)])  # 3 and 8 steps per epoch
def test_every_epoch_runs_exactly_one_pass_over_the_data(small_cnn, few_digits, strategy, samples, batch_size):
    model = small_cnn()
    x, y = few_digits[0][:samples], few_digits[1][:samples]
    model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, validation_data=(x, y), strategy=strategy,
              results_dir=None)
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-samples // batch_size)


def test_resume_is_for_strategies_that_keep_a_checkpoint(small_cnn, digits):
    with pytest.raises(ValueError, match=r"^strategy 'single' keeps no checkpoint to resume; resume is for "
                                         r"\['async-ps', 'local-steps', 'multi-worker'\]. Received: resume=True$"):
        cnnpar.fit(small_cnn(), digits.x[:64], digits.y[:64], strategy="single", resume=True, results_dir=None)


@pytest.mark.parametrize("alias", IN_PROCESS)  # the others: tests/test_any_order.py
def test_fit_leaves_the_strategy_as_it_was_and_a_second_fit_owes_nothing_to_the_first(alias, batch):
    strategy = strategies.resolve(alias)
    configuration = dict(vars(strategy))
    first = one_sgd_step(build_small_cnn(seed=3), strategy, batch, precision="mixed_bfloat16")
    second = one_sgd_step(build_small_cnn(seed=3), strategy, batch)
    fresh = one_sgd_step(build_small_cnn(seed=3), strategies.resolve(alias), batch)
    assert vars(strategy) == configuration
    assert max_weight_difference(first, fresh) > 1e-5  # the first step computed in bfloat16 ...
    assert max_weight_difference(second, fresh) == 0.0  # ... and the second in float32, as a fresh strategy does
    with pytest.raises(AttributeError, match=r"^<.*> is a configuration: it does not change after it is created; "
                                             r"create another strategy, or use strategy.replace\(accumulate=...\). "
                                             r"Received: accumulate=2$"):
        strategy.accumulate = 2


@pytest.mark.parametrize("alias", ["channels", "hybrid", ASYNC_PS])  # the others train with Keras's own fit
def test_validation_freq_and_batch_size_validate_as_keras_validates(alias, few_digits, tmp_path):
    """The loops of the mesh and of AsyncPS refused ``validation_freq``, and ``validation_batch_size`` too."""
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras_model, model = build_small_cnn(), build_small_cnn()
    settings = {"batch_size": 64, "epochs": 3, "shuffle": False, "verbose": 0, "validation_data": (x[:64], y[:64]),
                "validation_freq": [1, 3], "validation_batch_size": 32}
    expected = keras_model.fit(x, y, **settings).history
    history = model.fit(x, y, strategy=alias, results_dir=tmp_path, **settings).history
    assert len(history["loss"]) == 3
    assert history["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert len(history["val_loss"]) == 2


@pytest.mark.parametrize("alias", ["single", "mirrored", "layers", ASYNC_PS])  # the mesh refuses unknown layers
def test_a_users_model_with_a_lambda_grouped_convolution_own_layer_and_loss_trains_as_in_keras(alias, few_digits):
    """Every strategy clones the model, and Keras's safe mode refused the Lambda's Python function; the AsyncPS
    coordinator process loaded a model naming a layer class and a loss that it had never seen ("Could not
    locate class 'Scale'"). Defined here, inside the test, as in a user's script: they reach it by value. Keras
    computes a grouped convolution in an XLA function, which under AsyncPS failed every step: XLA cannot read a
    kernel held on a parameter server."""
    class Scale(keras.layers.Layer):
        def __init__(self, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(self.factor))

        def call(self, inputs):
            return inputs * self.scale

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    def halved_crossentropy(y_true, y_pred):
        return 0.5 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    def users_cnn():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Lambda(lambda images: images / 255.0),
            keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.Conv2D(8, 3, groups=2), Scale(1.5),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.SGD(0.1), halved_crossentropy)
        return model

    x, y = few_digits[0][:128], few_digits[1][:128]
    settings = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0}
    expected = users_cnn().fit(x, y, **settings).history["loss"]
    model = users_cnn()
    history = cnnpar.fit(model, x, y, strategy=alias, results_dir=None, **settings).history
    assert history["loss"] == pytest.approx(expected, rel=1e-5)
    assert float(model.layers[3].scale.numpy()) != 1.5  # the user's layer trained, and came back


def test_a_batch_the_replicas_split_unevenly_trains_and_validates_as_single(few_digits):
    """Keras's ``fit`` under MirroredStrategy averaged the replicas' parts of the first batch to build the model,
    and failed on 32 and 31 examples ("Inputs to operation AddN of type AddN must have the same size and
    shape"), with Keras's own ``fit`` too. And Keras's step weighs each replica's mean loss alike, so an example
    of the 31 weighed 1/62 and one of the 32 weighed 1/64: the losses ended 6e-4 apart, relative."""
    x, y = few_digits[0][:126], few_digits[1][:126]
    settings = {"batch_size": 63, "epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (x[:63], y[:63]),
                "results_dir": None}
    expected = build_small_cnn().fit(x, y, strategy="single", **settings).history
    history = build_small_cnn().fit(x, y, strategy=cnnpar.DataParallel(2), **settings).history
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert history["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


@pytest.mark.parametrize("clipping", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.002}], ids=str)
def test_data_parallel_clips_the_whole_batchs_gradient_as_single_does(clipping, batch):
    """Keras 3 clips each replica's part of the gradient before the all-reduce sums them: DataParallel(2) stepped
    up to twice as far as Single (a clipvalue run's loss 2.29658 where Single's was 2.29536)."""
    def clipped_cnn():
        return build_small_cnn(optimizer=keras.optimizers.SGD(0.5, **clipping))

    single = one_sgd_step(clipped_cnn(), "single", batch)
    unclipped = one_sgd_step(build_small_cnn(learning_rate=0.5), "single", batch)
    mirrored = one_sgd_step(clipped_cnn(), cnnpar.DataParallel(2), batch)
    assert_same_step(single, mirrored, 1e-6, before=unclipped)  # the clipping acted, and alike


@pytest.mark.parametrize("alias", ["single", "mirrored", "layers", ASYNC_PS])  # the mesh refuses use_ema
def test_an_optimizer_with_use_ema_leaves_the_moving_averages_in_the_model_as_kerass_fit_does(alias, few_digits):
    """Keras's ``fit`` ends by writing the optimizer's moving averages into the weights; AsyncPS's loop did not,
    and its model kept the last step's weights (|w| 145.85 where Keras's was 145.44)."""
    def averaging_cnn(use_ema):
        return build_small_cnn(optimizer=keras.optimizers.Adam(0.01, use_ema=use_ema, ema_momentum=0.5))

    assert_the_option_trains_as_in_keras(averaging_cnn, alias, few_digits)


@pytest.mark.parametrize("alias", ["single", "mirrored", "layers", ASYNC_PS])  # the mesh refuses weight decay
def test_variables_excluded_from_weight_decay_stay_excluded(alias, few_digits):
    """Keras keeps ``exclude_from_weight_decay`` out of the optimizer's config, so the strategy's copy (and the
    coordinator's saved and loaded model) decayed every variable: a loss of 2.2950 where Keras's was 2.2949."""
    def decayed_cnn(excluded):
        model = build_small_cnn(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5))
        if excluded:
            model.optimizer.exclude_from_weight_decay(var_list=[model.layers[0].kernel], var_names=["bias"])
        return model

    assert_the_option_trains_as_in_keras(decayed_cnn, alias, few_digits)


@pytest.mark.parametrize("alias", ["single", "layers", ASYNC_PS])
def test_dropout_drops_the_units_kerass_fit_drops_from_the_same_seed(alias, few_digits):
    """Keras's clone and saved model leave a Dropout's seed generator out, so a strategy's copy drew new seeds
    from Python's ``random``: every strategy dropped other units than Keras's ``fit`` from the same seed, and
    AsyncPS's coordinator process others in every run (weights 0.06 apart after 8 steps). (DataParallel's
    replicas draw masks of their own, see the next test, and the mesh draws its own.)"""
    def dropping_cnn(dropout):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 5, activation="relu"), keras.layers.MaxPooling2D(4),
            keras.layers.Flatten(), keras.layers.Dropout(0.5 if dropout else 0.0),
            keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        return cnnpar.parallel(model)

    assert_the_option_trains_as_in_keras(dropping_cnn, alias, few_digits)


def test_each_replica_of_data_parallel_drops_its_own_units():
    """Every replica drew the same seed from the Dropout's mirrored seed state (under Keras's own
    MirroredStrategy too), so the two halves of a batch lost the same units. Two examples of ones, one per
    replica, through Dropout(0.5) into one linear unit: a kernel weight moves where either example kept its
    input, three quarters of them with two masks (Single: 0.713 of 1,000), half with one (0.483 before)."""
    def dropped_linear_unit():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1000,)), keras.layers.Dropout(0.5),
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
        model.compile(keras.optimizers.SGD(1e-4), "mse")
        return cnnpar.parallel(model)

    model = dropped_linear_unit()
    model.fit(np.ones((2, 1000), "float32"), np.zeros((2, 1), "float32"), batch_size=2, shuffle=False, verbose=0,
              strategy=cnnpar.DataParallel(2), results_dir=None)
    assert np.mean(model.get_weights()[0] != 1.0) > 0.65


@pytest.mark.parametrize("reduction, strategy, batch_size", [
    ("sum", cnnpar.Single(accumulate=2), 32), ("sum", cnnpar.DataParallel(2), 63),
    ("mean_with_sample_weight", cnnpar.Single(accumulate=2), 32),
    ("mean_with_sample_weight", cnnpar.DataParallel(2), 64),
    ("mean_with_sample_weight ignoring class 1", cnnpar.DataParallel(4), 64),
    ("sum_over_batch_size ignoring class 1", cnnpar.DataParallel(4), 64),
    ("sum_over_batch_size ignoring class 1", cnnpar.Single(accumulate=2), 32)], ids=str)
def test_a_step_is_kerass_step_on_the_whole_batch_whatever_the_losss_reduction(reduction, strategy, batch_size,
                                                                                  few_digits):
    """The parts of a batch (micro-batches, replicas) were weighed by their examples whatever the loss reduced
    by: with ``reduction="sum"`` two micro-batches stepped half as far as Keras on the whole batch, and under
    ``"mean_with_sample_weight"`` each replica divided by its own weights (loss 2.28867 where Single's was
    2.28792 after 2 epochs). Keras's mean leaves out the examples of a loss's ``ignore_class``, which the parts
    counted until 2026-12-04's last stop (4 replicas' gradient 2.1e-3 from Single's, the parity check's FAIL).
    In float64: on an AVX2 CPU, oneDNN's float32 filter gradient of the first convolution sums a part's 25,088
    products in an order that depends on its threads: two micro-batches ended 3.9e-5 from the float64 step after
    one epoch here, as far as Keras's own ``fit`` with one intra-op thread (2026-12-05)."""
    def reduced_by(reduction):
        reduction, _, ignored = reduction.partition(" ignoring class ")
        model = build_small_cnn(dtype="float64")
        loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction,
                                                          ignore_class=int(ignored) if ignored else None)
        model.compile(keras.optimizers.SGD(0.002 if reduction == "sum" else 0.1), loss)
        return model

    x, y = few_digits[0][:126], few_digits[1][:126]
    weights = np.random.default_rng(0).uniform(0.1, 2.0, len(x)).astype("float32")
    settings = {"sample_weight": weights, "epochs": 1, "shuffle": False, "verbose": 0}
    expected = reduced_by(reduction)
    expected.fit(x, y, batch_size=batch_size * strategy.accumulate, **settings)
    model = reduced_by(reduction)
    model.fit(x, y, batch_size=batch_size, strategy=strategy, results_dir=None, **settings)
    assert max_weight_difference(model, expected) < 1e-7


def assert_the_option_trains_as_in_keras(build, alias, few_digits):
    """Assert that an option moves Keras's trained weights (more than 1e-3) and that ``alias`` trains to Keras's
    weights with it (within 1e-5): 2 epochs of 128 digits of ``build(True)`` (the option on) and ``build(False)``
    under Keras's ``fit``, and of ``build(True)`` under ``alias``."""
    x, y = few_digits[0][:128], few_digits[1][:128]
    settings = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0}
    expected, without = build(True), build(False)
    expected.fit(x, y, **settings)
    without.fit(x, y, **settings)
    model = build(True)
    model.fit(x, y, strategy=alias, results_dir=None, **settings)
    assert_same_step(expected, model, 1e-5, before=without)


@pytest.mark.parametrize("alias", ["mirrored", "channels", "hybrid"])
def test_validation_batch_size_sets_the_size_of_the_validation_batches(alias, few_digits):
    """The strategies that train with Keras's ``fit`` batched numpy validation data by ``batch_size`` and passed
    ``validation_batch_size`` on to Keras, which ignores it for a dataset: the option changed nothing. The mesh's
    validation called no test batch hooks (Keras's ``fit`` calls them through ``evaluate``)."""
    seen = []

    class ValidationBatches(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen.append(batch)

    x, y = few_digits[0][:128], few_digits[1][:128]
    build_small_cnn().fit(x, y, batch_size=64, epochs=1, verbose=0, validation_data=(x[:64], y[:64]),
                          validation_batch_size=16, callbacks=[ValidationBatches()], strategy=alias, results_dir=None)
    assert seen == [0, 1, 2, 3]  # 64 validation digits in 4 batches of 16


@pytest.mark.parametrize("alias", ["channels", "hybrid"])  # the others train with Keras's own fit
def test_a_dict_of_the_named_input_trains_as_the_array_does(alias, few_digits):
    """The mesh's loop read the batch's x as one tensor and failed on ``{"image": x}`` with an AttributeError."""
    def named_input_cnn():
        keras.utils.set_random_seed(0)
        image = keras.Input((28, 28, 1), name="image")
        features = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 3, activation="relu")(image))
        model = keras.Model(image, keras.layers.Dense(10, activation="softmax")(features))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    x, y = few_digits[0][:128], few_digits[1][:128]
    settings = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0, "strategy": alias, "results_dir": None}
    expected = cnnpar.fit(named_input_cnn(), x, y, validation_data=(x, y), **settings).history
    history = cnnpar.fit(named_input_cnn(), {"image": x}, y, validation_data=({"image": x}, y), **settings).history
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert history["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)


@pytest.mark.parametrize("strategy", [cnnpar.DataParallel(2), cnnpar.Single(accumulate=2),
                                      cnnpar.LayerPlacement(2, microbatches=2)], ids=repr)
def test_a_last_batch_too_small_to_split_is_left_out_with_a_warning(strategy, few_digits):
    """129 digits at batch 64: the last batch of 1 gave one replica (or micro-batch) nothing, and TensorFlow's
    oneDNN gradients failed on it (the process aborted in ``MklMaxPoolingGradOp``), under Keras's own fit too.
    (LayerPlacement's micro-batches compute BatchNormalization apart, but the small CNN has none.)"""
    x, y = few_digits[0][:129], few_digits[1][:129]
    batch = 64 // strategy.accumulate
    keras_model, model = build_small_cnn(), build_small_cnn()
    expected = keras_model.fit(x[:128], y[:128], batch_size=64, shuffle=False, verbose=0).history["loss"]
    with pytest.warns(UserWarning, match=r"^129 examples at a batch of 64 leave a last batch of 1, which the strategy "
                                         r"cannot cut into its 2 pieces .* each epoch leaves out 1 example\(s\)"):
        history = model.fit(x, y, strategy=strategy, batch_size=batch, shuffle=False, verbose=0, results_dir=None)
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_batch_smaller_than_the_replicas_is_refused(few_digits):
    with pytest.raises(ValueError, match=r"^<DataParallel devices=2 scale_lr=None> cuts every batch into 2 pieces "
                                         r"\(replicas or micro-batches\), so a batch needs at least 2 examples "
                                         r"\(TensorFlow fails on an empty piece\). Received: batch_size=1$"):
        build_small_cnn().fit(*few_digits, strategy="mirrored", batch_size=1, verbose=0, results_dir=None)


def frozen_cnn():
    """A CNN whose first convolution and BatchNormalization are frozen, as for fine-tuning, compiled with Adam."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu", name="frozen_conv"),
        keras.layers.BatchNormalization(name="frozen_norm"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    for name in ("frozen_conv", "frozen_norm"):
        model.get_layer(name).trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    return cnnpar.parallel(model)


@pytest.mark.parametrize("alias", [*IN_PROCESS, ASYNC_PS])
def test_frozen_layers_keep_their_weights_and_the_rest_trains_as_keras_trains_it(alias, few_digits):
    """Fine-tuning. Channels and hybrid counted a frozen layer's weights as trainable (the optimizer's state did not
    fit them: "cannot reshape array of size 8 into shape (3,3,1,8)"), and their BatchNormalization normalized a
    frozen layer with the batch's statistics; AsyncPS's precise BN recomputed a frozen layer's moving statistics
    (moved by 1.0). Keras leaves a frozen layer's weights and statistics as they are. (AsyncPS's two steps fall in
    its warm-up, where nothing is stale.)"""
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras_model, model = frozen_cnn(), frozen_cnn()
    frozen = [w.copy() for name in ("frozen_conv", "frozen_norm") for w in model.get_layer(name).get_weights()]
    expected = keras_model.fit(x, y, batch_size=64, shuffle=False, verbose=0).history["loss"]
    history = model.fit(x, y, strategy=alias, batch_size=64, shuffle=False, verbose=0, results_dir=None)
    after = [w for name in ("frozen_conv", "frozen_norm") for w in model.get_layer(name).get_weights()]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(frozen, after)) == 0.0
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert max_weight_difference(model, keras_model) < 1e-4


def normalized_cnn(images):
    """A CNN that starts with a ``Normalization`` adapted to ``images``, as Keras's image tutorials start."""
    keras.utils.set_random_seed(0)
    norm = keras.layers.Normalization()
    norm.adapt(images)
    model = keras.Sequential([keras.Input((28, 28, 1)), norm, keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return cnnpar.parallel(model)


@pytest.mark.parametrize("alias", ["single", "channels"])  # one copies the model, the other also shards it
def test_an_adapted_normalization_normalizes_with_its_adapted_statistics(alias, few_digits):
    """A Normalization computes its mean and variance once from its weights (when adapted, or loaded); the
    strategies' copies took the weights but normalized with the statistics of a new layer (mean 0, variance 1):
    here the first epoch's loss 2.37 against Keras's 2.87, under every strategy, with nothing said."""
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras_model, model = normalized_cnn(x), normalized_cnn(x)
    expected = keras_model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history["loss"]
    history = model.fit(x, y, strategy=alias, batch_size=64, epochs=2, shuffle=False, verbose=0, results_dir=None)
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert max_weight_difference(model, keras_model) < 1e-5


def test_replace_makes_a_changed_copy_and_refuses_options_the_strategy_does_not_take():
    strategy = cnnpar.DataParallel(2, accumulate=2)
    assert (strategy.replace(accumulate=4).accumulate, strategy.accumulate) == (4, 2)
    with pytest.raises(ValueError, match=r"^DataParallel takes no option 'microbatches'. Received: "):
        strategy.replace(microbatches=2)


class PositionedTokens(keras.layers.Layer):
    """A user's layer: the feature map's pixels as tokens, of a length it leaves unknown (as Keras's
    ``extract_patches`` does), plus a learned embedding of each position (an ``Embedding``, whose gradient comes
    as ``tf.IndexedSlices``)."""

    def __init__(self, positions, **kwargs):
        super().__init__(**kwargs)
        self.positions = positions
        self.embedding = keras.layers.Embedding(positions, 8)

    def call(self, x):
        tokens = keras.ops.reshape(x, (keras.ops.shape(x)[0], -1, 8))
        return tokens + self.embedding(keras.ops.arange(self.positions))

    def compute_output_shape(self, input_shape):
        return input_shape[0], None, 8

    def get_config(self):
        return {**super().get_config(), "positions": self.positions}


def build_tokens_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    tokens = PositionedTokens(169)(keras.layers.Conv2D(8, 3, strides=2, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(tokens)))
    model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("strategy", ["mirrored", "layers"])
def test_an_embedding_and_a_length_keras_leaves_unknown_train_as_under_keras(strategy, few_digits):
    """A small ViT as users write one failed under DataParallel (an Embedding's gradient, ``IndexedSlices``,
    could not be divided), under LayerPlacement (its FLOP estimate multiplied the unknown length), and so in
    every trial of ``strategy="auto"`` (the memory estimate did too; the parity check could not read the
    gradient as numpy)."""
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras_model, model = build_tokens_model(), build_tokens_model()
    keras_model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    cnnpar.fit(model, x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0, results_dir=None)
    assert_same_step(keras_model, model, 1e-5, before=build_tokens_model())
    check = checks.GradientParityCheck(build_tokens_model(), strategy, x[:64], y[:64])
    check.on_train_begin()
    assert check.verdict == "pass" and check.difference <= checks.PARITY_TOLERANCE
    # Parameters: the convolution's 3*3*8 + 8 = 80, the embedding's 169*8 = 1,352, the Dense's 8*10 + 10 = 90: 1,522
    # in float32, 6,088 bytes (LayerPlacement: half on each device); SGD keeps no slots. Kept values per example: the
    # images 784, the convolution's ReLU output 13*13*8 = 1,352, the tokens 8 (their unknown length counts as 1),
    # the pooled 8 and the 10 logits, 2,162; plus twice the largest output (1,352): 4,866 values, 4 bytes each, for
    # the 32 examples of a device.
    state = {"mirrored": 6_088, "layers": 6_088 // 2}[strategy]
    assert memory.estimate(build_tokens_model(), strategies.resolve(strategy), 64, "float32") == {
        "weights": state, "gradients": state, "optimizer": 0, "activations": 4_866 * 4 * 32,
        "total": 2 * state + 4_866 * 4 * 32}


@pytest.mark.parametrize("alias, steps", [("single", 8), ("mirrored", 1)])
def test_single_runs_8_steps_per_call_and_data_parallel_one(alias, steps, small_cnn):
    """README and docs/strategies.md: Single is Keras's fit with steps_per_execution=8; DataParallel runs one step
    per call (docs/data_parallel.md: Keras 3 fails under MirroredStrategy with more)."""
    run = strategies.resolve(alias).prepare(small_cnn())
    assert run.model.steps_per_execution == steps
