"""Datasets as users pass them: a finite batched tf.data pipeline, an infinite one with steps_per_epoch, and
validation data as a dataset, under every in-process strategy (multi-worker: tests/test_multi_worker.py's launch
tests run a user's tf.data script)."""

import keras
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from tests.helpers import IN_PROCESS, build_small_cnn, epoch_column

STRATEGIES = IN_PROCESS


@pytest.fixture(scope="module")
def user_data(few_digits):
    """A user's own pipelines: 256 training digits in 4 shuffled batches, 64 validation digits in 2."""
    x, y = few_digits
    train = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).shuffle(256, seed=0).batch(64)
    validation = tf.data.Dataset.from_tensor_slices((x[256:], y[256:])).batch(32)
    return train, validation


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_each_epoch_is_one_pass_of_a_finite_dataset(strategy, user_data, tmp_path):
    train, validation = user_data
    model = build_small_cnn()
    history = cnnpar.fit(model, train, validation_data=validation, epochs=3, strategy=strategy,
                         results_dir=tmp_path, verbose=0)
    assert int(train.cardinality()) == 4
    assert int(model.optimizer.iterations.numpy()) == 3 * 4  # every epoch took the dataset's 4 batches
    assert len(history.history["val_loss"]) == 3
    name = cnnpar.runs.run_file_name("small_cnn", cnnpar.strategies.resolve(strategy).alias,
                                     cnnpar.strategies.resolve(strategy).num_devices)
    assert epoch_column(tmp_path / name) == [1, 2, 3]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_an_infinite_dataset_takes_steps_per_epoch(strategy, user_data):
    train, validation = user_data
    model = build_small_cnn()
    cnnpar.fit(model, train.repeat(), validation_data=validation, epochs=2, steps_per_epoch=3, strategy=strategy,
               results_dir=None, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * 3


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_validation_steps_take_the_batches_kerass_fit_takes(strategy, few_digits):
    """One validation step per epoch on a dataset of 2 batches: Keras's fit validates on the first batch, then
    (its iterator going on) on the second. Single and LayerPlacement, which run Keras's fit 8 steps per call,
    validated the first epoch on both batches and the second on the first."""
    x, y = few_digits
    train = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64).repeat()
    validation = tf.data.Dataset.from_tensor_slices((x[256:], y[256:])).batch(32)
    options = {"validation_data": validation, "validation_steps": 1, "epochs": 2, "steps_per_epoch": 2,
               "shuffle": False, "verbose": 0}
    expected = build_small_cnn().fit(train, **options).history
    history = cnnpar.fit(build_small_cnn(), train, strategy=strategy, results_dir=None, **options).history
    for name in ("val_loss", "val_accuracy"):
        assert history[name] == pytest.approx(expected[name], abs=1e-5), name


@pytest.mark.parametrize("strategy", ["single", cnnpar.ChannelSharded(2)], ids=str)
def test_tensorboard_writes_the_epoch_scalars(strategy, user_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, validation = user_data
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs"), write_graph=False)
    cnnpar.fit(build_small_cnn(), train, validation_data=validation, epochs=2, strategy=strategy, results_dir=None,
               verbose=0, callbacks=[board])
    events = EventAccumulator(str(tmp_path / "logs" / "train"), size_guidance={"tensors": 0}).Reload()
    assert {"epoch_loss", "epoch_accuracy"} <= set(events.Tags()["tensors"])
    assert [event.step for event in events.Tensors("epoch_loss")] == [0, 1]
