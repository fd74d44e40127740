"""A run's checkpoint: the model, its optimizer and the completed epochs, in one folder.

Strategies that outlive failures keep one per run configuration: ``MultiWorker``
saves it on preemption, ``AsyncPS`` after every epoch. A run that completes
removes it; a new run refuses to start over an existing one unless told to
resume it, so no checkpoint is lost.

Example:

>>> import tempfile, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> model.optimizer.build(model.trainable_variables)
>>> folder = Path(tempfile.mkdtemp()) / "run"
>>> RunCheckpoint(model, folder, resume=False).save(completed_epochs=2)
>>> RunCheckpoint(model, folder, resume=True).restore()
2
"""

import contextlib
import json
import logging
import shutil
import warnings
from pathlib import Path

import tensorflow as tf

from keras_cnnpar.runtime.atomic import write_atomic


class SaverRetracingFilter(logging.Filter):
    """Drops TensorFlow's warning that its own checkpoint saver retraced.

    Where the variables live on several tasks (AsyncPS's parameter servers),
    TensorFlow's ``MultiDeviceSaver.save`` traces a new function on every save,
    by design, and from the fifth save on TensorFlow warns that a function
    "triggered tf.function retracing" and advises the user to change code that
    is not theirs. Other retracing warnings pass.

    >>> record = logging.makeLogRecord({"msg": "5 out of the last 5 calls to <function "
    ...                                        "MultiDeviceSaver.save.<locals>.tf_function_save at 0x1> triggered "
    ...                                        "tf.function retracing."})
    >>> SaverRetracingFilter().filter(record)
    False
    """

    def filter(self, record):
        return "MultiDeviceSaver.save.<locals>.tf_function_save" not in record.getMessage()


class RunCheckpoint:
    """The checkpoint of one run in ``directory``: ``model``, its built optimizer and the completed epochs.

    Args:
        model: the (prepared) model whose variables are saved and restored.
        directory: the run's folder; its parent may hold other runs' folders.
        resume: allow an existing checkpoint (to restore it); without it, an
            existing one is an error that says how to continue or start over.
        config: the run's configuration (model, strategy, devices, global batch,
            data, ...), recorded beside the checkpoint; resuming with another
            one is an error that names each difference.
        may_change: keys of ``config`` that a resume may change (``"devices"``
            for a strategy that resumes on another number of workers); the
            differences in them are listed in :attr:`changes` instead.
    """

    #: The file beside the checkpoint that records the configuration of its run.
    CONFIG = "run.json"

    def __init__(self, model, directory, resume, config=None, may_change=()):
        self.directory = Path(directory)
        self.config = dict(config or {})
        self.may_change = tuple(may_change)
        #: What changed since the checkpoint, among ``may_change`` (``["devices 2 (checkpoint) vs 3 (this run)"]``).
        self.changes = []
        if not resume and self.holds_checkpoint():
            raise ValueError(f"{self.directory} holds the checkpoint of an interrupted run; pass resume=True "
                             f"(cnnpar train --resume) to continue it, or delete the folder to start over. "
                             f"Received: resume=False")
        if resume and not self.holds_checkpoint():
            self._refuse_another_configuration()
        self._check_config()
        self.epochs = tf.Variable(0, dtype=tf.int64, trainable=False, name="completed_epochs")
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, completed_epochs=self.epochs)
        self._manager = None

    def holds_checkpoint(self):
        """Whether the run's folder holds a checkpoint (its record, or TensorFlow's index of one)."""
        return (self.directory / self.CONFIG).exists() or any(
            tf.train.latest_checkpoint(str(folder.absolute())) for folder in (self.directory, self.preemption_folder))

    @property
    def preemption_folder(self):
        """Where ``PreemptionCheckpointHandler`` keeps the chief's checkpoint: inside the run's folder, so the
        other workers' temporary folders (beside it) belong to this run alone."""
        return self.directory / "preemption"

    @property
    def _absolute(self):
        # Parameter servers write their variables' shards themselves, from their own working folder.
        return str(self.directory.absolute())

    @property
    def completed_epochs(self):
        return int(self.epochs.numpy())

    def restore(self):
        """Restore the latest checkpoint, if there is one; return the completed epochs (0 without one)."""
        latest = tf.train.latest_checkpoint(self._absolute)
        if latest:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        return self.completed_epochs

    def _differences(self, recorded, keys=None):
        return [f"{key} {recorded.get(key)!r} (checkpoint) vs {value!r} (this run)"
                for key, value in self.config.items()
                if recorded.get(key, value) != value and (keys is None or key in keys)]

    def _refuse_another_configuration(self):
        """A resume whose configuration has no checkpoint, beside the checkpoint of another one (its folder's
        name holds the model and the device count): refused, naming that checkpoint and the differences. With no
        checkpoint anywhere, a ``UserWarning`` says that there is nothing to resume, and the run starts anew."""
        others = sorted(self.directory.parent.glob(f"*/{self.CONFIG}")) if self.directory.parent.is_dir() else []
        if not others:
            warnings.warn(f"resume=True, but {self.directory} holds no checkpoint, nor does any folder beside it: "
                          f"there is nothing to resume, and the run starts at its first epoch. Received: resume=True",
                          stacklevel=3)
            return
        recorded = json.loads(others[0].read_text(encoding="utf-8"))
        differences = self._differences(recorded) or ["its folder's name"]
        raise ValueError(f"resume=True, but {self.directory} holds no checkpoint; {others[0].parent} holds one of "
                         f"another configuration: {'; '.join(differences)}. Resume with that checkpoint's settings, "
                         f"or run without resume to start over (that checkpoint is kept). Received: resume=True")

    def _check_config(self):
        """Refuse to resume a checkpoint recorded for another configuration, naming every difference."""
        path = self.directory / self.CONFIG
        if not self.config or not path.exists():
            return
        recorded = json.loads(path.read_text(encoding="utf-8"))
        fixed = [key for key in self.config if key not in self.may_change]
        differences = self._differences(recorded, fixed)
        self.changes = self._differences(recorded, self.may_change)
        if differences:
            raise ValueError(f"{self.directory} holds the checkpoint of another configuration: "
                             f"{'; '.join(differences)}. Resume with the checkpoint's settings, or delete the folder "
                             f"to start over. Received: resume=True")

    def record_config(self):
        """Write the run's configuration beside the checkpoint (with the first checkpoint)."""
        if self.config:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(self.directory / self.CONFIG, json.dumps(self.config, indent=2, sort_keys=True) + "\n")

    def save(self, completed_epochs):
        """Write the checkpoint after ``completed_epochs``; the previous one goes once this one is complete."""
        previous = self.completed_epochs
        self.epochs.assign(completed_epochs)
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(self.checkpoint, self._absolute, max_to_keep=1)
            if not any(isinstance(f, SaverRetracingFilter) for f in tf.get_logger().filters):
                tf.get_logger().addFilter(SaverRetracingFilter())
        try:
            self._manager.save()
            self.record_config()
        except BaseException:
            self.epochs.assign(previous)  # the checkpoint on disk is still the previous one
            raise

    def remove(self, folder=None):
        """Delete ``folder`` (default: the run's), and the parent folder when no other run is left in it."""
        shutil.rmtree(folder or self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.directory.parent.rmdir()
