"""The user's Keras callbacks, run against the user's model rather than the strategy's training copy.

A strategy trains a copy of the user's model (:mod:`keras_cnnpar.keras_compat.rebuild`),
but Keras callbacks work on ``self.model``: ``ModelCheckpoint`` saves it,
``EarlyStopping`` restores its best weights into it, ``ReduceLROnPlateau``
changes its optimizer's learning rate, ``BackupAndRestore`` saves and restores
it. :class:`UserModelCallbacks` gives them the user's model:

- at the end of every epoch the trained weights and optimizer state are copied
  into the user's model *before* the callbacks run, so a checkpoint holds that
  epoch's weights, and a request to stop goes back into training;
- a learning rate that a callback sets on the user's model, in ``on_train_begin``,
  ``on_epoch_begin`` (``LearningRateScheduler``), ``on_epoch_end``
  (``ReduceLROnPlateau``) or ``on_train_batch_begin``, goes to the training copy
  (times the strategy's ``scale_lr`` factor) before the training goes on. Keras's
  ``fit`` reads it at every step; the strategies with loops of their own
  (``AsyncPS``, ``ChannelSharded``, ``Hybrid``) at every epoch's start;
- after ``on_train_begin``, weights and an epoch that a callback restored into
  the user's model (``BackupAndRestore``) go into training;
- ``on_train_end`` runs once the trained state is back in the user's model
  (``cnnpar.fit`` calls :meth:`UserModelCallbacks.train_ended`), so
  ``EarlyStopping(restore_best_weights=True)`` leaves the best weights there.

Batch-level hooks reach the callbacks where the strategy calls them at every
step (Keras's ``fit``, the tensor-parallel loop); a strategy that cannot
(``AsyncPS``) calls them once per epoch, and a warning names each callback that
has such hooks. During an epoch the user's model holds the weights of the last
completed epoch.

>>> import keras, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)
>>> history = cnnpar.fit(model, digits.x[:128], digits.y[:128], batch_size=64, epochs=5, callbacks=[stop],
...                      results_dir=None, verbose=0)
>>> len(history.history["loss"]), stop.model is model  # stopped after the second epoch, which gained < 10.0
(2, True)
"""

import contextlib
import copy
import shutil
import tempfile
import warnings
from pathlib import Path

import keras

from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.strategies import loop

#: Keras's batch hooks of training, and of validation (``fit`` runs them through ``evaluate``).
#: Keras's callbacks that write files, and the argument naming where (a file or a folder).
FILE_WRITERS = {
    keras.callbacks.ModelCheckpoint: "filepath",
    keras.callbacks.CSVLogger: "filename",
    keras.callbacks.TensorBoard: "log_dir",
    keras.callbacks.BackupAndRestore: "backup_dir",
}


@contextlib.contextmanager
def chief_writes(callbacks, is_chief, worker="worker"):
    """``callbacks`` as a worker of a cluster runs them: only the chief writes where the user said.

    On the chief (and in a single process) they are the user's own. On another
    worker every callback that writes files (:data:`FILE_WRITERS`, subclasses
    included) is replaced by a copy that writes into a temporary folder of
    this process, removed when the block ends, so the paths the user named hold
    the chief's files and nothing else; the copies still run, so every worker
    does the same work at the same steps. A ``BackupAndRestore`` copy starts
    from the chief's backup, when this worker can read it (a shared folder), so
    every worker resumes at the same epoch, as Keras 2 did.

    >>> import tempfile
    >>> logger = keras.callbacks.CSVLogger("log.csv")
    >>> with chief_writes([logger], is_chief=False) as (copy_of_logger,):
    ...     copy_of_logger.filename.startswith(tempfile.gettempdir()), logger.filename
    (True, 'log.csv')
    """
    if is_chief or not callbacks:
        yield callbacks
        return
    folder = Path(tempfile.mkdtemp(prefix=f"cnnpar-{worker}-callbacks-"))
    try:
        yield [_writing_into(callback, folder / str(index)) for index, callback in enumerate(callbacks)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _writing_into(callback, folder):
    """``callback`` itself if it writes no file, else a copy that writes into ``folder``."""
    kind = next((kind for kind in FILE_WRITERS if isinstance(callback, kind)), None)
    if kind is None:
        return callback
    target = Path(getattr(callback, FILE_WRITERS[kind]))
    if kind is keras.callbacks.BackupAndRestore:  # its paths are fixed when it is created: create another
        if target.is_dir():
            shutil.copytree(target, folder / "backup")
        return keras.callbacks.BackupAndRestore(str(folder / "backup"), save_freq=callback.save_freq,
                                                delete_checkpoint=callback.delete_checkpoint,
                                                double_checkpoint=callback.double_checkpoint)
    folder.mkdir(parents=True)
    moved = copy.copy(callback)
    setattr(moved, FILE_WRITERS[kind], str(folder / target.name))
    return moved


class UserModelCallbacks(keras.callbacks.Callback):
    """Runs ``callbacks`` against the user's ``model`` while ``run`` (a strategy's ``Run``) trains (see the module).

    Every hook passes the strategy's own ``logs`` dict on, so what a callback
    adds to it (``ReduceLROnPlateau``'s ``learning_rate``, the checks' figures)
    reaches the run's CSV and the ``History``.
    """

    def __init__(self, callbacks, model, run):
        super().__init__()
        self.user_model, self.run, self.prepared, self.strategy = model, run, run.model, run.strategy
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            callback.set_model(model)
        if self.strategy.batch_hooks:
            for callback in loop.with_batch_hooks(self.callbacks):
                warnings.warn(f"{type(callback).__name__} has batch-level hooks, which "
                              f"{type(self.strategy).__name__} calls {self.strategy.batch_hooks}, not at every step",
                              stacklevel=3)

    def set_params(self, params):
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)

    def _each(self, hook, *args):
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def _each_passing_the_rate_on(self, hook, *args):
        """``_each``; then a learning rate the callbacks set on the user's model goes to the training copy."""
        rate = self._user_learning_rate()
        self._each(hook, *args)
        changed = self._user_learning_rate()
        if changed is not None and changed != rate:
            self.prepared.optimizer.learning_rate = changed * self.strategy.lr_factor()

    def on_train_begin(self, logs=None):
        self.user_model.stop_training = False
        self.user_model._initial_epoch = None
        self._each_passing_the_rate_on("on_train_begin", logs)
        restored_epoch = self.user_model._initial_epoch
        if restored_epoch:  # BackupAndRestore loaded a backup into the user's model
            rebuild.copy_state(self.user_model, self.prepared)
            self.run.reload()
            self.prepared._initial_epoch = restored_epoch

    def on_epoch_end(self, epoch, logs=None):
        rebuild.copy_state(self.prepared, self.user_model)
        self._each_passing_the_rate_on("on_epoch_end", epoch, logs)
        if self.user_model.stop_training:
            self.prepared.stop_training = True

    def train_ended(self, logs=None):
        """``on_train_end``, once the trained state is back in the user's model."""
        self._each("on_train_end", logs)

    def _user_learning_rate(self):
        """The user's optimizer's constant learning rate, or None under a schedule."""
        optimizer = getattr(self.user_model.optimizer, "inner_optimizer", self.user_model.optimizer)
        if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            return None
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def on_epoch_begin(self, epoch, logs=None):
        self._each_passing_the_rate_on("on_epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._each_passing_the_rate_on("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._each("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self._each("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._each("on_test_end", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._each("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._each("on_test_batch_end", batch, logs)
