"""Everyday Keras callbacks under every in-process strategy, run against the user's model.

(AsyncPS and MultiWorker run in processes of their own; their epoch loop is the
same ``UserModelCallbacks`` path, and one test runs AsyncPS's.)
"""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.engine.user_callbacks import UserModelCallbacks
from keras_cnnpar.strategies import base
from tests.helpers import IN_PROCESS, build_small_cnn, max_difference

#: Every in-process strategy, the layer placement pipelined.
STRATEGIES = [cnnpar.LayerPlacement(2, microbatches=2) if alias == "layers" else alias for alias in IN_PROCESS]


@pytest.fixture(scope="module")
def user_data(few_digits):
    x, y = few_digits
    return tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64)


class StopAt(keras.callbacks.Callback):
    """Raises at the end of ``epoch`` (0-based), as a killed job ends mid-run."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"killed after epoch {epoch + 1}")


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_checkpoints_early_stopping_and_a_reduced_rate_act_on_the_users_model(strategy, user_data, tmp_path):
    model = build_small_cnn(learning_rate=0.1)
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.keras")),
        # loss falls every epoch, so with mode="max" the first epoch is the best: stop after two more, restore it
        keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=2, restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", mode="max", patience=0, factor=0.5, min_lr=0.0),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TerminateOnNaN(),
    ]
    history = cnnpar.fit(model, user_data, epochs=10, strategy=strategy, callbacks=callbacks, results_dir=None,
                         verbose=0)
    losses = history.history["loss"]
    assert len(losses) == 3 and np.argmax(losses) == 0  # stopped by EarlyStopping, in the user's model
    saved = [keras.saving.load_model(tmp_path / f"epoch{epoch}.keras") for epoch in (1, 2, 3)]
    assert {type(m).__name__ for m in saved} == {"Sequential"}  # the user's model, not the strategy's copy
    assert max_difference(model.get_weights(), saved[0].get_weights()) == 0.0  # the best epoch's weights restored
    assert max_difference(saved[2].get_weights(), saved[0].get_weights()) > 1e-3  # training went on meanwhile
    with open(tmp_path / "log.csv") as file:
        rates = [float(row["learning_rate"]) for row in csv.DictReader(file)]
    assert rates == pytest.approx([0.1, 0.1, 0.05])  # the rate in use: reduced after epochs 2 and 3
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.025)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_the_rate_a_scheduler_sets_at_an_epochs_start_trains_that_epoch(strategy, user_data):
    """``LearningRateScheduler`` sets the rate in ``on_epoch_begin``, which reached the training copy only when set
    in ``on_epoch_end``: every strategy trained at the compiled rate (a loss of 2.2923 where Keras's was 2.2911)."""
    def schedule(epoch, rate):
        return [0.05, 0.0, 0.02][epoch]

    expected = build_small_cnn().fit(user_data, epochs=3, verbose=0,
                                     callbacks=[keras.callbacks.LearningRateScheduler(schedule)]).history
    history = cnnpar.fit(build_small_cnn(), user_data, epochs=3, strategy=strategy, results_dir=None, verbose=0,
                         callbacks=[keras.callbacks.LearningRateScheduler(schedule)]).history
    assert history["learning_rate"] == pytest.approx([0.05, 0.0, 0.02])
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_backup_and_restore_resumes_a_killed_run_at_its_epoch(strategy, user_data, tmp_path):
    uninterrupted = cnnpar.fit(build_small_cnn(), user_data, epochs=4, strategy=strategy, results_dir=None,
                               verbose=0).history["loss"]
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        cnnpar.fit(build_small_cnn(), user_data, epochs=4, strategy=strategy, results_dir=None, verbose=0,
                   callbacks=[keras.callbacks.BackupAndRestore(backup), StopAt(1)])
    fresh = build_small_cnn(seed=5)  # a new process would start from other weights
    resumed = cnnpar.fit(fresh, user_data, epochs=4, strategy=strategy, results_dir=None, verbose=0,
                         callbacks=[keras.callbacks.BackupAndRestore(backup)]).history["loss"]
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-4)  # epochs 3 and 4, from the backed-up weights


class BatchLogs(keras.callbacks.Callback):
    """Keeps every training batch's index and logs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((batch, {name: float(value) for name, value in logs.items()}))


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if base.resolve(s).steps_per_execution == 1], ids=str)
def test_a_batch_hook_sees_every_step_with_the_running_loss_and_metrics(strategy, user_data):
    """(Keras's ``fit`` calls batch hooks once per ``steps_per_execution`` steps; these strategies run one.)"""
    recorder = BatchLogs()
    history = cnnpar.fit(build_small_cnn(), user_data, epochs=1, strategy=strategy, callbacks=[recorder],
                         results_dir=None, verbose=0)
    assert [batch for batch, _ in recorder.seen] == [0, 1, 2, 3]
    last = recorder.seen[-1][1]  # the running means after the last step are the epoch's
    assert last["loss"] == pytest.approx(history.history["loss"][0], rel=1e-5)
    assert last["accuracy"] == pytest.approx(history.history["accuracy"][0], rel=1e-5)
    assert recorder.seen[0][1]["loss"] != pytest.approx(last["loss"], rel=1e-5)


def test_a_rate_that_a_callback_sets_reaches_the_training_copy_times_the_strategys_factor():
    class Halve(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.optimizer.learning_rate = 0.5 * float(self.model.optimizer.learning_rate.numpy())

    strategy = cnnpar.DataParallel(2, scale_lr="linear")
    model = build_small_cnn(learning_rate=0.1)
    run = strategy.prepare(model)
    prepared = run.model
    assert float(prepared.optimizer.learning_rate.numpy()) == pytest.approx(0.2)
    users = UserModelCallbacks([Halve()], model, run)
    prepared.set_weights([w + 1.0 for w in prepared.get_weights()])  # as an epoch of training would
    prepared.optimizer.iterations.assign(7)
    users.on_epoch_end(0, {})
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert float(prepared.optimizer.learning_rate.numpy()) == pytest.approx(0.1)  # 0.05 x 2 replicas
    assert max_difference(model.get_weights(), prepared.get_weights()) == 0.0  # the epoch's weights, and state
    assert int(model.optimizer.iterations.numpy()) == 7


def test_a_strategy_that_calls_batch_hooks_once_per_epoch_names_the_callbacks_that_have_them():
    class PerBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    class OncePerEpoch(cnnpar.Single):
        batch_hooks = "once per epoch (as AsyncPS does)"

    model = build_small_cnn()
    run = cnnpar.strategies.Run(OncePerEpoch(), None, model)
    with pytest.warns(UserWarning) as warned:
        UserModelCallbacks([PerBatch(), keras.callbacks.CSVLogger("unused.csv")], model, run)
    assert [str(w.message) for w in warned] == [
        "PerBatch has batch-level hooks, which OncePerEpoch calls once per epoch (as AsyncPS does), not at every step"]
    assert cnnpar.AsyncPS.batch_hooks.startswith("once per epoch")


class Events(keras.callbacks.Callback):
    """Records the epoch and test hooks in their order, with the epoch's keys and the test results."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_test_begin(self, logs=None):
        self.seen.append("test begins")

    def on_test_end(self, logs=None):
        self.seen.append(("test ends", {name: round(float(value), 6) for name, value in logs.items()}))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((epoch, sorted(name for name in logs if name in ("loss", "val_loss"))))


@pytest.mark.slow  # AsyncPS's coordinator process and cluster
def test_under_async_ps_a_callback_sees_validation_between_its_test_hooks_as_under_keras(user_data):
    """AsyncPS validates in its coordinator process; the user's callbacks saw its results in the epoch's logs
    but never ``on_test_begin`` or ``on_test_end``, which Keras calls around every validation."""
    events = Events()
    history = cnnpar.fit(build_small_cnn(), user_data, epochs=2, validation_data=user_data.take(1),
                         validation_freq=2, strategy=cnnpar.AsyncPS(2, checkpoint_dir=None), callbacks=[events],
                         results_dir=None, verbose=0)
    validated = {name: round(history.history[f"val_{name}"][0], 6) for name in ("accuracy", "loss")}
    assert events.seen == [(0, ["loss"]), "test begins", ("test ends", validated), (1, ["loss", "val_loss"])]
