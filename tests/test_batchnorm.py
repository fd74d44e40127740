"""BatchNormalization under data parallelism: synchronized statistics give Single's step; per-replica (and
per-micro-batch) ones do not, and the parity check says why."""

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat.precise_bn import PreciseBatchNorm
from keras_cnnpar.plan.checks import NOISE_FACTOR, PARITY_TOLERANCE, GradientParityCheck
from tests.helpers import (
    SYNCHRONIZED_STEP_TOLERANCE,
    assert_same_step,
    build_residual_cnn,
    build_resnet,
    build_small_cnn,
    max_difference,
    max_weight_difference,
    moving_statistics,
    one_sgd_step,
)


@pytest.fixture(scope="module")
def single(batch):
    return one_sgd_step(build_residual_cnn(seed=3), "single", batch)


def test_synchronized_batch_statistics_take_single_s_step(batch, single):
    assert cnnpar.DataParallel(2).sync_batchnorm  # the default
    synchronized = one_sgd_step(build_residual_cnn(seed=3), cnnpar.DataParallel(2), batch)
    assert_same_step(single, synchronized, SYNCHRONIZED_STEP_TOLERANCE, before=build_residual_cnn(seed=3),
                     moved=1e-1)  # the moving statistics too
    assert max_difference(moving_statistics(single), moving_statistics(synchronized)) < 1e-6


def build_nested_block_cnn(seed=3):
    """A CNN whose BatchNormalization is inside a nested block (a ``Sequential`` used as a layer)."""
    keras.utils.set_random_seed(seed)
    block = keras.Sequential([keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
                              keras.layers.ReLU()], name="block")
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                              block, keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")], name="nested_block_cnn")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def test_a_batchnormalization_inside_a_nested_block_is_synchronized_too(batch):
    """The copy that synchronizes the layers did not look inside nested models: the block's BatchNormalization
    normalized each replica's slice of the batch, 3.9e-2 from Single's step, with sync_batchnorm=True."""
    single = one_sgd_step(build_nested_block_cnn(), "single", batch)
    synchronized = one_sgd_step(build_nested_block_cnn(), cnnpar.DataParallel(2), batch)
    assert max_weight_difference(single, synchronized) < SYNCHRONIZED_STEP_TOLERANCE  # moving statistics too
    per_replica = one_sgd_step(build_nested_block_cnn(), cnnpar.DataParallel(2, sync_batchnorm=False), batch)
    assert max_weight_difference(single, per_replica) > 10 * SYNCHRONIZED_STEP_TOLERANCE


def test_per_replica_statistics_differ_and_the_parity_check_says_why(batch, single, capsys):
    strategy = cnnpar.DataParallel(2, sync_batchnorm=False)
    per_replica = one_sgd_step(build_residual_cnn(seed=3), strategy, batch)
    assert max_weight_difference(single, per_replica) > 10 * SYNCHRONIZED_STEP_TOLERANCE
    check = GradientParityCheck(build_residual_cnn(seed=3), strategy, *batch)
    check.on_train_begin()
    assert check.verdict == "FAIL (expected: BatchNormalization per replica)"
    assert "its BatchNormalization layers normalize each replica's slice of the batch with that slice's statistics " \
           "(sync_batchnorm=False)" in capsys.readouterr().err


def test_micro_batch_statistics_differ_and_the_parity_check_says_why(batch, capsys):
    """GPipe's BatchNormalization per micro-batch: the plan showed a bare FAIL for such a layer placement."""
    check = GradientParityCheck(build_residual_cnn(seed=3), cnnpar.LayerPlacement(2, microbatches=2), *batch)
    check.on_train_begin()
    assert check.difference > 10 * SYNCHRONIZED_STEP_TOLERANCE
    assert check.verdict == "FAIL (expected: BatchNormalization per micro-batch)"
    assert "its BatchNormalization layers normalize each micro-batch with that micro-batch's statistics, as in " \
           "GPipe; with microbatches=1 the step is Single's" in capsys.readouterr().err


def test_the_parity_check_passes_a_synchronized_split_within_the_model_s_float_noise(batch):
    synchronized = GradientParityCheck(build_resnet(seed=3), cnnpar.DataParallel(2), *batch)
    synchronized.on_train_begin()
    assert synchronized.noise > 1e-4  # Single's own float32 gradient, against float64
    assert PARITY_TOLERANCE < synchronized.difference <= NOISE_FACTOR * synchronized.noise
    assert synchronized.verdict == "pass"
    plain = GradientParityCheck(build_small_cnn(seed=3), cnnpar.DataParallel(2), *batch)
    plain.on_train_begin()
    assert plain.noise < 1e-6 and plain.difference < 1e-5 and plain.verdict == "pass"


def test_sync_batchnorm_is_a_flag():
    with pytest.raises(TypeError, match=r"^sync_batchnorm must be True or False. Received: sync_batchnorm='yes'$"):
        cnnpar.DataParallel(2, sync_batchnorm="yes")


def test_precise_statistics_reach_a_batchnormalization_inside_a_nested_block():
    """AsyncPS's precise BN read only the model's top-level layers: a nested block's BatchNormalization kept the
    moving statistics that stale weights from every worker had mixed."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3, activation="relu", name="dense")
    block = keras.Sequential([dense, keras.layers.BatchNormalization(name="inner")], name="block")
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(epsilon=0.0, name="outer"), block])
    batches = [np.random.default_rng(seed).normal(seed, 1.0, (8, 4)).astype("float32") for seed in (1, 2)]
    assert PreciseBatchNorm(model).update(model, batches) == 2
    normalized = [(batch - batch.mean(axis=0)) / batch.std(axis=0) for batch in batches]  # by the outer one
    expected = np.mean([dense(batch).numpy().mean(axis=0) for batch in normalized], axis=0)
    assert expected.max() > 0.1
    np.testing.assert_allclose(block.get_layer("inner").moving_mean.numpy(), expected, rtol=1e-4)
    np.testing.assert_allclose(model.get_layer("outer").moving_mean.numpy(),  # the top-level one, as before
                               np.mean([batch.mean(axis=0) for batch in batches], axis=0), rtol=1e-5)
