"""The resnet model kind (functional, BatchNormalization, residual adds) under every in-process strategy."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import keras_cnnpar as cnnpar
from keras_cnnpar import serving
from keras_cnnpar.zoo.names import MODEL_NAMES
from tests.helpers import (
    assert_same_step,
    build_resnet,
    build_resnet_float64,
    max_difference,
    max_weight_difference,
    moving_statistics,
    one_sgd_step,
)

#: One SGD step from the same weights, in float64, against Single's (the moving statistics included).
STEP_PARITY = [
    (cnnpar.DataParallel(2), 1e-5),
    (cnnpar.LayerPlacement(2), 1e-5),
    (cnnpar.ChannelSharded(2), 1e-4),
    (cnnpar.Hybrid(data=2, model=2), 1e-4),
]


@pytest.fixture(scope="module")
def single(batch):
    return one_sgd_step(build_resnet_float64(seed=3), "single", batch)


def test_the_resnet_is_functional_with_batch_normalization_and_residual_adds():
    model = cnnpar.models.cnn("resnet")
    assert model.count_params() == 78_426
    assert model.name == MODEL_NAMES["resnet"] == "cnn2d_resnet_3stage"
    assert not isinstance(model, keras.Sequential)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert (kinds.count("BatchNormalization"), kinds.count("Add"), kinds.count("GlobalAveragePooling2D")) == (9, 3, 1)
    assert [layer.strides for layer in model.layers if isinstance(layer, keras.layers.Conv2D)
            and layer.kernel_size == (1, 1)] == [(2, 2), (2, 2)]  # the two projection shortcuts


@pytest.mark.parametrize("strategy, tolerance", STEP_PARITY, ids=lambda p: repr(p) if not isinstance(p, float) else "")
def test_one_sgd_step_matches_single(strategy, tolerance, batch, single):
    stepped = one_sgd_step(build_resnet_float64(seed=3), strategy, batch)
    assert_same_step(single, stepped, tolerance, before=build_resnet_float64(seed=3), moved=1e-2)
    assert max_difference(moving_statistics(single), moving_statistics(stepped)) < tolerance


def test_per_replica_statistics_on_the_mesh_take_data_parallel_s_step(batch, single):
    hybrid = one_sgd_step(build_resnet_float64(seed=3), cnnpar.Hybrid(data=2, model=2, sync_batchnorm=False), batch)
    data_parallel = one_sgd_step(build_resnet_float64(seed=3), cnnpar.DataParallel(2, sync_batchnorm=False), batch)
    assert max_weight_difference(hybrid, single) > 1e-3
    assert max_difference(hybrid.trainable_weights, data_parallel.trainable_weights) < 1e-5
    # The moving statistics take the mean of the replicas' batch statistics. For the stem's BatchNormalization,
    # whose input is the same under both: the mean of the halves' means is the batch's mean, and the mean of the
    # halves' variances is below the batch's variance (by the within/between split of the variance).
    hybrid_stem, single_stem = ({w.path: w.numpy() for w in model.weights if w.path.startswith("stem_norm/moving")}
                                for model in (hybrid, single))
    assert max_difference([hybrid_stem["stem_norm/moving_mean"]], [single_stem["stem_norm/moving_mean"]]) < 1e-9
    shrink = single_stem["stem_norm/moving_variance"] - hybrid_stem["stem_norm/moving_variance"]
    assert shrink.min() >= 0 and shrink.max() > 1e-4


@pytest.mark.slow
def test_in_float32_a_split_batch_rounds_as_single_s_own_float32_step_does(batch, single):
    """The float32 story behind the float64 parity: a synchronized split batch lands about as far from Single's
    float32 step as that step is from the exact (float64) one (within twice that)."""
    single32 = one_sgd_step(build_resnet(seed=3), "single", batch)
    float32_error = max_weight_difference(single32, single)
    assert 1e-5 < float32_error < 1e-3  # 1.8e-4 measured: the BN gradient of a conv cancels heavily
    for strategy in (cnnpar.DataParallel(2), cnnpar.Hybrid(data=2, model=2)):
        assert max_weight_difference(one_sgd_step(build_resnet(seed=3), strategy, batch), single32) < 2 * float32_error


def test_channel_sharding_holds_half_the_parameter_bytes_per_device():
    """The bytes each device really holds: the parts of the sharded model's variables placed on it."""
    model = cnnpar.models.cnn("resnet")
    single_bytes = sum(w.numpy().nbytes for w in model.weights)  # what Single holds on its one device
    sharded = cnnpar.sharded.ShardedModel(model, cnnpar.ChannelSharded(2).mesh())
    held = collections.Counter()
    for variable in sharded.weights:
        for part in dtensor.unpack(variable.read_value()):
            held[tf.DeviceSpec.from_string(part.device).device_index] += part.numpy().nbytes
    # Whole on both devices: the 9 BatchNormalizations' 4 vectors of 16+16+16+32+32+32+64+64+64 = 336 channels
    # (336 * 4 * 4 = 5,376 bytes) and the last Dense's bias (10 * 4 = 40, added after its row-mode sum); the
    # convolutions' and the Dense's other weights, 313,704 - 5,416 = 308,288 bytes, are halved.
    assert single_bytes == 313_704
    assert dict(held) == {0: 5_416 + 308_288 // 2, 1: 5_416 + 308_288 // 2}  # 159,560: 50.9% of Single's


@pytest.mark.slow
def test_after_hybrid_training_the_export_and_the_sharded_model_predict_as_the_model(few_digits, tmp_path):
    model = cnnpar.models.cnn("resnet")
    untrained = model.get_weights()
    strategy = cnnpar.Hybrid(data=2, model=2)
    model.fit(few_digits[0][:128], few_digits[1][:128], batch_size=64, verbose=0, results_dir=None, strategy=strategy)
    assert max_difference(moving_statistics(model)[:2], untrained[3:5]) > 1e-3  # the stem's moving statistics came back
    pixels = serving.sample_pixels()
    expected = model.predict(pixels.reshape(-1, 28, 28, 1) / 255.0, verbose=0)
    export = serving.export(model, tmp_path / "digits", verify=False)  # checked here, in one fresh process
    served = serving.load_in_fresh_process(export, pixels)
    assert np.max(np.abs(served["probabilities"] - expected)) < 1e-5
    sharded = cnnpar.sharded.ShardedModel(model, strategy.mesh())
    assert np.max(np.abs(sharded.forward(pixels.reshape(-1, 28, 28, 1) / 255.0) - expected)) < 1e-5
