import re

import keras
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.strategies import placement
from tests.helpers import (
    FLOORS,
    assert_same_step,
    build_cnn_with_operations_on_tensors,
    build_residual_cnn,
    max_weight_difference,
    read_rows,
)

DENSE = 5  # index of the 2+2's first Dense layer in model.layers


def test_automatic_placement_balances_contiguous_stages_by_flops():
    model, strategy = cnnpar.models.cnn("2+2"), cnnpar.LayerPlacement(devices=2)
    run = strategy.prepare(model)
    assert [stage.layers for stage in run.stages] == [model.layers[:3], model.layers[3:]]  # conv, pool, conv
    assert [s.params for s in run.stages] == [52_096, 3_222_538]
    assert [s.flops for s in run.stages] == [1_254_400 + 6_272 + 20_070_400,
                                             3_136 + 3_136 + 6_422_528 + 1_024 + 20_480]
    report = run.report().splitlines()
    assert report[1].startswith("0     /device:CPU:0        52,096      208,384      21.33   0.77  conv2d")
    assert report[-1] == ("balance: the largest stage has 77% of the FLOPs (even: 50%); "
                          "expected bubble (p-1)/(m+p-1) = 0.500")


def test_variables_and_ops_sit_on_their_stage_devices():
    model = cnnpar.models.cnn("2+2")
    prepared = cnnpar.LayerPlacement(devices=2, placement={model.layers[DENSE].name: 1}).prepare(model).model
    devices = [w.value.device.split("device:")[-1] for w in prepared.weights]
    assert devices == ["CPU:0"] * 4 + ["CPU:1"] * 4  # conv kernels and biases, then dense ones
    graph = tf.function(prepared).get_concrete_function(tf.TensorSpec([None, 28, 28, 1])).graph
    placed = {(op.type, op.device.split("device:")[-1]) for op in graph.get_operations()
              if op.type in ("Conv2D", "MatMul", "Softmax")}
    assert placed == {("Conv2D", "CPU:0"), ("MatMul", "CPU:1"), ("Softmax", "CPU:1")}


@pytest.mark.parametrize("mapping, message", [
    ({"no_such_layer": 1}, "placement names unknown layer 'no_such_layer'; the layers are ['conv2d"),
    ({2: 1, DENSE: 0}, "placement makes non-contiguous stages: device order along the layers is [0, 1, 0]"),
    ({DENSE: 2}, "placement uses device 2, but there are 2 devices (0..1): more stages than devices"),
    ({DENSE: "/gpu:7"}, "placement uses device '/gpu:7', which is not one of this strategy's devices"),
])
def test_invalid_placements_are_refused_with_the_reason(mapping, message):
    with pytest.raises(ValueError) as raised:
        cnnpar.LayerPlacement(devices=2, placement=mapping).prepare(cnnpar.models.cnn("2+2"))
    assert str(raised.value).startswith(message)


def test_a_subclassed_model_has_no_graph_to_cut():
    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(TypeError, match=r"^LayerPlacement cuts the layer graph of a keras.Sequential or functional "
                                        r"model into stages; a subclassed model has no graph to cut. "
                                        r"Received: model of type Subclassed$"):
        cnnpar.LayerPlacement(2).prepare(Subclassed())


def test_a_skip_connection_across_the_stage_boundary_goes_to_the_stage_that_uses_it():
    strategy = cnnpar.LayerPlacement(2, placement={"c": 1})
    run = strategy.prepare(build_residual_cnn())
    prepared = run.model
    assert [[layer.name for layer in stage.layers] for stage in run.stages] == [
        ["a", "b", "b_norm", "b_relu"], ["c", "skip", "pool", "flat", "out"]]
    assert "      receives: b_relu (stage 0), a (stage 0)" in run.report().splitlines()
    devices = {w.path.split("/")[0]: w.value.device.split("device:")[-1] for w in prepared.weights}
    assert devices == {"a": "CPU:0", "b": "CPU:0", "b_norm": "CPU:0", "c": "CPU:1", "out": "CPU:1"}
    graph = tf.function(prepared).get_concrete_function(tf.TensorSpec([None, 28, 28, 1])).graph
    scope = {op: re.sub(r"_\d+$", "", [*op.name.split("/"), ""][1]) for op in graph.get_operations()}  # a_1: a
    placed = {(scope[op], op.type, op.device.split("device:")[-1]) for op in graph.get_operations()
              if op.type in ("Conv2D", "MatMul") or (op.type, scope[op]) == ("AddV2", "skip")}
    assert placed == {
        ("a", "Conv2D", "CPU:0"), ("b", "Conv2D", "CPU:0"), ("c", "Conv2D", "CPU:1"), ("skip", "AddV2", "CPU:1"),
        ("out", "MatMul", "CPU:1")}


def test_operations_on_tensors_run_where_their_latest_input_is_made(few_digits):
    """LayerPlacement failed on such a model with a bare ``KeyError: 'add_3'``. Each operation now runs on the
    stage of its latest input: the slice of the images on the first, the rest after ``b`` on the second."""
    run = cnnpar.LayerPlacement(2, placement={"b": 1}).prepare(build_cnn_with_operations_on_tensors())
    graph = tf.function(run.model).get_concrete_function(tf.TensorSpec([None, 28, 28, 1])).graph
    placed = {(op.type, op.device.split("device:")[-1]) for op in graph.get_operations()
              if len(op.name.split("/")) == 2 and op.type in ("StridedSlice", "AddV2", "Relu", "Mean", "ConcatV2")}
    assert placed == {("StridedSlice", "CPU:0"), ("AddV2", "CPU:1"), ("Relu", "CPU:1"), ("Mean", "CPU:1"),
                      ("ConcatV2", "CPU:1")}
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras_model, model = build_cnn_with_operations_on_tensors(), build_cnn_with_operations_on_tensors()
    expected = keras_model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history["loss"]
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, results_dir=None,
                        strategy=cnnpar.LayerPlacement(2, microbatches=2))
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert max_weight_difference(model, keras_model) < 1e-4  # 6e-5 as DataParallel(2); the steps moved them 0.65


def test_a_residual_network_with_batch_normalization_takes_single_s_step(few_digits):
    x, y = few_digits[0][:64], few_digits[1][:64]
    single, placed = build_residual_cnn(seed=3), build_residual_cnn(seed=3)
    cnnpar.fit(single, x, y, batch_size=64, shuffle=False, verbose=0, strategy="single", results_dir=None)
    cnnpar.fit(placed, x, y, batch_size=64, shuffle=False, verbose=0, results_dir=None,
               strategy=cnnpar.LayerPlacement(2, placement={"c": 1}))
    assert_same_step(single, placed, 1e-5, before=build_residual_cnn(seed=3))  # weights and the moving statistics


@pytest.mark.parametrize("microbatches", [1, 4])
def test_one_sgd_step_matches_single_within_1e_5(small_cnn, digits, microbatches):
    x, y = digits.x[::78][:64], digits.y[::78][:64]
    single, placed = small_cnn(seed=3), small_cnn(seed=3)
    for model, strategy in [(single, "single"), (placed, cnnpar.LayerPlacement(2, microbatches=microbatches))]:
        model.fit(x, y, batch_size=64, shuffle=False, verbose=0, strategy=strategy, results_dir=None)
    assert_same_step(single, placed, 1e-5, before=small_cnn(seed=3))


@pytest.mark.parametrize("rescaled", [True, False], ids=["rescaling first", "conv first"])
def test_images_given_as_integers_take_single_s_step(rescaled, digits):
    """With a ``Rescaling`` first, the stage timer took their gradient (None) and failed; with a convolution
    first, it called the convolution on the integers, which Keras's model casts to its ``Input``'s float32."""
    def rescaling_cnn():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((28, 28, 1)), *([keras.layers.Rescaling(1 / 255)] if rescaled else []),
                                  keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = (digits.x[::78][:64] * 255).astype("uint8"), digits.y[::78][:64]
    single, placed = rescaling_cnn(), rescaling_cnn()
    for model, strategy in [(single, "single"), (placed, cnnpar.LayerPlacement(2, microbatches=2))]:
        cnnpar.fit(model, x, y, batch_size=64, shuffle=False, verbose=0, strategy=strategy, results_dir=None)
    assert_same_step(single, placed, 1e-5, before=rescaling_cnn())


def test_epoch_csv_records_bubble_and_measured_stage_times(small_cnn, few_digits, tmp_path):
    small_cnn().fit(*few_digits, batch_size=64, epochs=2, verbose=0, results_dir=tmp_path,
                    strategy=cnnpar.LayerPlacement(2, microbatches=4))
    rows = read_rows(tmp_path / "small_cnn_keras_tensorflow_layers_2dev.csv")
    assert [float(r["bubble_fraction"]) for r in rows] == [0.2, 0.2]
    assert all(float(r["stage0_seconds"]) > 0 and float(r["stage1_seconds"]) > 0 for r in rows)
    log = (tmp_path / "results.log").read_text()
    assert "layout balance: the largest stage has" in log


def test_activity_regularization_of_micro_batches_sums_to_the_whole_batch_s(few_digits):
    """Keras divides a layer's activity regularization by the examples it saw: each of 2 micro-batches added the
    whole batch's share again (one step 3.3e-4 from Single's; 0.0054 after 8 steps, a loss 0.009 higher)."""
    def regularized_cnn():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
        return model

    x, y = few_digits[0][:64], few_digits[1][:64]
    single, placed = regularized_cnn(), regularized_cnn()
    losses = [cnnpar.fit(model, x, y, batch_size=64, shuffle=False, verbose=0, strategy=strategy,
                         results_dir=None).history["loss"]
              for model, strategy in [(single, "single"), (placed, cnnpar.LayerPlacement(2, microbatches=2))]]
    assert_same_step(single, placed, 1e-5, before=regularized_cnn())
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def test_timing_the_stages_leaves_the_moving_statistics_as_they_were(few_digits):
    """Before training, the stages of a Sequential model are timed in training mode, six passes over one batch:
    their BatchNormalization updates stayed in the moving statistics (0.056 off Keras's after 4 steps)."""
    def normalized_cnn():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, use_bias=False), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
        return model

    x, y = few_digits[0][:128], few_digits[1][:128]
    settings = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0}
    expected, placed = normalized_cnn(), normalized_cnn()
    expected.fit(x, y, **settings)
    cnnpar.fit(placed, x, y, strategy=cnnpar.LayerPlacement(2), results_dir=None, **settings)
    assert [weight.name for weight in placed.non_trainable_weights] == ["moving_mean", "moving_variance"]
    assert max_weight_difference(placed, expected) < 1e-5  # get_weights() holds them


def test_stages_follow_the_layers_when_the_first_layers_go_to_the_second_device(small_cnn, few_digits):
    strategy = cnnpar.LayerPlacement(2, placement={0: 1, 3: 0}, microbatches=2)
    model = small_cnn()
    model.fit(few_digits[0][:64], few_digits[1][:64], batch_size=32, verbose=0, strategy=strategy, results_dir=None)
    run = strategy.prepare(model)
    assert [stage.device for stage in run.stages] == ["/device:CPU:1", "/device:CPU:0"]
    assert [len(stage.layers) for stage in run.stages] == [3, 3]


def test_balanced_stages_minimises_the_largest_stage():
    assert placement.balanced_stages([4, 1, 1, 1, 5], 2) == [0, 0, 0, 1, 1]
    assert placement.balanced_stages([1, 2, 3, 4, 5, 6], 3) == [0, 0, 0, 1, 1, 2]  # 6 | 9 | 6
    assert placement.balanced_stages([3], 2) == [0]


@pytest.mark.slow
# The resnet: a skip connection, and BatchNormalization per micro-batch, so its steps are not Single's. The
# sequential CNNs' steps match Single's (test_one_sgd_step_matches_single_within_1e_5), so Single's floor is
# theirs (their own run here cost 33-43 s of the suite).
def test_three_epochs_of_the_resnet_on_two_devices_reach_the_floor(digits_split):
    train, val = digits_split
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("resnet")
    history = model.fit(train.x, train.y, epochs=3, batch_size=64, validation_data=(val.x, val.y), verbose=0,
                        strategy=cnnpar.LayerPlacement(2, microbatches=2), results_dir=None)
    assert history.history["val_accuracy"][-1] >= FLOORS["resnet"]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"microbatches": 0}, ValueError, "microbatches must be a positive int. Received: microbatches=0"),
    ({"devices": []}, ValueError, "devices must name at least one device. Received: devices=[]"),
    ({"placement": [1, 2]}, TypeError,
     "placement must be None or a dict of layer -> device. Received: placement=[1, 2]"),
])
def test_layer_placement_validates_its_arguments(kwargs, error, message):
    with pytest.raises(error) as raised:
        cnnpar.LayerPlacement(**kwargs)
    assert str(raised.value) == message
    assert repr(cnnpar.LayerPlacement(2, microbatches=4)) == "<LayerPlacement devices=2 microbatches=4>"
