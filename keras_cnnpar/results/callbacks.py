"""Run logging callbacks: the per-epoch CSV (``EpochLogger``) and the run's record (``RunRecorder``).

``cnnpar.fit`` adds both, in that order, after the user's callbacks; the names
and the ``runs.csv`` row come from :mod:`keras_cnnpar.results.runs`.

Example:

>>> import os, tempfile, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> results = tempfile.mkdtemp()
>>> history = model.fit(digits.x[::10], digits.y[::10], batch_size=64, strategy="single",
...                     results_dir=results, verbose=0)   # adds an EpochLogger and a RunRecorder
>>> sorted(os.listdir(results))
['cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.csv', 'results.log', 'runs', 'runs.csv']
"""

import contextlib
import csv
import functools
import io
import math
import os
import shutil
import tempfile
import time
import typing
from pathlib import Path

import keras
import numpy as np

from keras_cnnpar.results import runs
from keras_cnnpar.results.runs import RunInfo
from keras_cnnpar.runtime import atomic, hardware
from keras_cnnpar.runtime.atomic import created_mode, write_atomic

__all__ = ["EpochLogger", "RunInfo", "RunLogs", "RunNotRecorded", "RunRecorder", "run_callbacks"]


class RunNotRecorded(RuntimeError):
    """A run trained, but its end could not be written (a full disk, or a ``runs.csv`` that became unusable during
    the run): it is logged as failed, and ``runs.csv`` and the weights still describe the runs before it."""


class EpochLogger(keras.callbacks.Callback):
    """Write one flushed CSV row per epoch: the logs, the epoch's time and its images/s.

    Follows ``keras.callbacks.CSVLogger``'s lifecycle: the file opens in
    ``on_train_begin``, gets one flushed row per epoch, and closes in
    ``on_train_end``. Columns are ``epoch`` (1-based) then the rest sorted by
    name; a column first seen after the first epoch (validation every
    ``validation_freq`` epochs) rewrites the file with it, earlier rows blank
    there (``keras.callbacks.CSVLogger`` drops it). The run writes its own
    file (``RunInfo.epoch_csv``, under ``runs/<run id>/``), created once its
    first epoch is complete, and after every epoch copies it whole onto the
    configuration's file (``RunInfo.view_csv``, the latest run's): a run that
    fails before its first epoch leaves the previous run's file as it was, and
    two runs of one configuration at once each keep their own. A run that starts at
    ``initial_epoch > 0`` keeps the rows of the epochs before it (from the
    configuration's file) and appends, so no epoch appears twice.

    It must come after callbacks that change the logs (it writes what it sees),
    and it measures an epoch's training time up to the start of validation.

    Example:

    >>> import tempfile, keras_cnnpar as cnnpar
    >>> info = RunInfo("cnn2d_3layer_fullconnected_3layer", "single", 1, 64, 500, epochs=1)
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> logger = EpochLogger(info, tempfile.mkdtemp())
    >>> history = model.fit(digits.x[::10], digits.y[::10], batch_size=64, verbose=0, callbacks=[logger])
    >>> [row["epoch"] for row in logger.rows]
    [1]

    Args:
        info: the run's :class:`RunInfo`.
        results_dir: folder of the CSV; created when training starts.
    """

    def __init__(self, info, results_dir):
        super().__init__()
        self.info = info
        self.path = Path(results_dir) / info.epoch_csv
        self.view = Path(results_dir) / info.view_csv
        self.rows = []
        self._file = self._writer = self._temporary = self._view_before = None

    def on_train_begin(self, logs=None):
        self.view.parent.mkdir(parents=True, exist_ok=True)
        self._view_before = self.view.read_bytes() if self.view != self.path and self.view.exists() else None
        header, kept = _kept_epochs(self.view, self.info.initial_epoch)
        descriptor, self._temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial",
                                                       dir=self.view.parent)  # the run's folder comes with epoch 1
        os.fchmod(descriptor, created_mode())
        self._file = os.fdopen(descriptor, "w", newline="", encoding="utf-8")
        self._kept, self.rows = kept, []
        self._writer = None
        if header:
            self._rewrite(header)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._train_end = None

    def on_test_begin(self, logs=None):
        if self._train_end is None:
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        train_seconds = (self._train_end or now) - self._epoch_start
        samples = self.info.samples_per_epoch
        row = {
            **{key: value if isinstance(value, str) else float(value) for key, value in (logs or {}).items()},
            "epoch": epoch + 1,
            "timestamp": runs.now(),
            "epoch_seconds": round(now - self._epoch_start, 6),
            "train_seconds": round(train_seconds, 6),
            "images_per_second": round(samples / train_seconds, 2) if samples else "",
            "strategy": self.info.strategy,
            "devices": self.info.devices,
            "global_batch": self.info.global_batch,
        }
        columns = self._writer.fieldnames if self._writer else ["epoch"]
        if set(row) - set(columns):
            self._rewrite(["epoch", *sorted((set(columns) | set(row)) - {"epoch"})])
        self._writer.writerow(row)
        self._file.flush()
        if self._temporary is not None:  # the first complete epoch: the new file takes the old one's place
            os.fsync(self._file.fileno())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._temporary, self.path)
            self._temporary = None
        if self.view != self.path:
            write_atomic(self.view, self.path.read_bytes())
        self.rows.append(row)

    def on_train_end(self, logs=None):
        self.close()

    def _rewrite(self, columns):
        """Write the header of ``columns`` and the rows so far again (blank where a row lacks a column); the run's
        file, once it has its first epoch, is replaced whole, never left half-written."""
        text = io.StringIO()
        writer = csv.DictWriter(text, columns, restval="")
        writer.writeheader()
        writer.writerows(self._kept + self.rows)
        if self._temporary is None:
            self._file.close()
            write_atomic(self.path, text.getvalue())
            self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 (close() closes it)
        else:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(text.getvalue())
        self._writer = csv.DictWriter(self._file, columns, restval="")

    def restore_view(self):
        """Put back the configuration's CSV of the run before (none: remove it), for a run that trained but could
        not be recorded: the CSV then describes the recorded run, as ``runs.csv`` and the weights do."""
        if self.view == self.path:
            return
        if self._view_before is None:
            self.view.unlink(missing_ok=True)
        else:
            write_atomic(self.view, self._view_before)

    def close(self):
        """Close the file. A new file that never completed an epoch goes and the previous one stays; after a
        failure later on, the rows of the completed epochs stay."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._temporary is not None:
            Path(self._temporary).unlink(missing_ok=True)
            self._temporary = None


class RunRecorder(keras.callbacks.Callback):
    """Record a run in the results folder: its ``results.log`` lines and, at the end, its ``runs.csv`` row.

    It reads each epoch's figures from ``epochs``, the run's
    :class:`EpochLogger`, so it must come after it. Only the chief process
    adds these callbacks.

    Args:
        info: the run's :class:`RunInfo`.
        results_dir: folder of ``runs.csv`` and ``results.log``.
        epochs: the run's :class:`EpochLogger`.
        report: the strategy's layout report, logged after the start line.
        events: None, or a function of an epoch's row returning the lines of what happened in it (the
            strategy's ``epoch_events``: a worker lost, ...), logged as ``event`` lines.
        save_weights: the run's end also writes the trained weights (``info.weights_files``); the end is then
            recorded by :meth:`finish`, which ``cnnpar.fit`` calls with the user's model once the trained weights
            are in it, rather than by ``on_train_end``.
    """

    def __init__(self, info, results_dir, epochs, report=None, events=None, save_weights=False):
        super().__init__()
        self.info, self.results_dir, self.epochs, self.report = info, Path(results_dir), epochs, report
        self.events = events or (lambda row: [])
        self.save_weights = save_weights
        #: The run's row of ``runs.csv``, once training ended.
        self.row = None
        self._runs_before = False

    def on_train_begin(self, logs=None):
        recorded = self.results_dir / runs.RUNS_CSV
        self._runs_before = recorded.exists() and recorded.read_bytes().count(b"\n") > 1  # a row below the header
        info = self.info
        self._log(f"start model={info.model} strategy={info.strategy} devices={info.devices} "
                  f"global_batch={info.global_batch} epochs={info.epochs} initial_epoch={info.initial_epoch} "
                  f"precision={info.precision} csv={info.epoch_csv}")
        self._log(f"machine {hardware.describe()}")
        for line in (self.report or "").splitlines():
            self._log(f"layout {line}")

    def on_epoch_end(self, epoch, logs=None):
        row = self.epochs.rows[-1]
        metrics = " ".join(f"{k}={row[k]:.4f}" for k in ("loss", "accuracy", "val_loss", "val_accuracy") if k in row)
        self._log(f"epoch {epoch + 1}/{self.info.epochs} {metrics} images_per_second={row['images_per_second']}")
        for event in self.events(row):
            self._log(f"event epoch {epoch + 1}: {event}")

    def on_train_end(self, logs=None):
        if not self.save_weights:
            self.finish()

    def finish(self, model=None):
        """Record the run's end: ``model``'s weights first (with ``save_weights``), then its ``runs.csv`` row and
        its end line, so the three agree.

        The weights are written to temporary files, which take their places
        only once the row is recorded. A failure to write (``OSError``: a full
        disk), or with ``save_weights`` a ``runs.csv`` that cannot take the row
        (edited during the run), leaves the files of the runs before as they
        were, logs the run as failed and raises :class:`RunNotRecorded`;
        without weights, such a ``runs.csv`` only loses this run's row, with a warning.
        """
        if not self.epochs.rows:
            return
        staged = []
        try:
            if self.save_weights:
                staged = _staged_weights(model, self.results_dir, self.info.weights_files)
            self.row = runs.append_run(self.results_dir, self.info, self.epochs.rows, strict=self.save_weights)
            for temporary, path in staged:
                os.replace(temporary, path)
        except (OSError, ValueError) as error:
            for temporary, _ in staged:
                atomic.discard(temporary)
            raise self._not_recorded(error) from error
        row = self.row or {}  # None: runs.csv became unusable during the run (a warning said so)
        try:
            self._log(f"end model={self.info.model} strategy={self.info.strategy} "
                      f"images_per_second={row.get('images_per_second', '')} speedup={row.get('speedup', '')}")
        except OSError as error:
            raise RunNotRecorded(f"the run's row and weights are in {self.results_dir}, but results.log could not "
                                 f"take its end line: {_reason(error)}. Received: {type(error).__name__} "
                                 f"errno={error.errno}") from error

    def _not_recorded(self, error):
        """The :class:`RunNotRecorded` of a failure to write the run's end (an ``OSError``, or the ``ValueError`` of
        a ``runs.csv`` that cannot take the row), once the configuration's CSV is the run's before and the run is
        logged as failed."""
        try:
            self.epochs.restore_view()
            files = "runs.csv, the weights and the configuration's epoch CSV"
        except OSError:
            files = "runs.csv and the weights"
        kept = f"{files} still hold the runs before it" if self._runs_before else "nothing of it was recorded"
        if isinstance(error, OSError):
            message = (f"the run trained, but its results could not be written into {self.results_dir}: "
                       f"{_reason(error)}; {kept}")
            received = f". Received: {type(error).__name__} errno={error.errno}"
        else:  # its message ends in what it received, and what to do
            message = f"the run trained, but its row could not be recorded: {error}; {kept}"
            received = ""
        try:
            self.on_failure(RunNotRecorded(message))
            message += ", and results.log says this run failed"
        except (OSError, ValueError):
            message += " (results.log could not be written either)"
        return RunNotRecorded(message + received)

    def on_failure(self, error):
        """Log why training stopped (``cnnpar.fit`` calls this when training raises)."""
        self._log(f"failed model={self.info.model} strategy={self.info.strategy}: {type(error).__name__}: {error}")

    def _log(self, message):
        run = f" [run {self.info.run_id}]" if self.info.run_id else ""
        runs.append_line(self.results_dir / runs.RESULTS_LOG, f"{runs.now()} {message}{run}")


class RunLogs(typing.NamedTuple):
    """The logging callbacks of one run, in the order Keras calls them: its epochs' CSV, then its record."""

    epochs: "EpochLogger"
    recorder: "RunRecorder"

    def failed(self, error):
        """Close the epochs' CSV and log the run failed with ``error`` (unless the record itself raised it);
        a results folder gone bad meanwhile does not hide ``error``."""
        self.epochs.close()
        if not isinstance(error, RunNotRecorded):  # that one logged the run failed itself
            with contextlib.suppress(OSError, ValueError):
                self.recorder.on_failure(error)


def run_callbacks(info, results_dir, report=None, events=None, save_weights=False):
    """The :class:`RunLogs` of one run.

    ``runs.csv`` is made ready first (an older one migrated, one that cannot be
    refused with a ``ValueError``), so a run never trains to find no place for its row.
    """
    runs.prepare_runs_csv(results_dir)
    epochs = EpochLogger(info, results_dir)
    return RunLogs(epochs, RunRecorder(info, results_dir, epochs, report, events, save_weights))


def _reason(error):
    """What an ``OSError`` says, in one line: the system's words for its ``errno`` (h5py's own text spans lines)."""
    return os.strerror(error.errno) if error.errno else " ".join(str(error).split())


def _staged_weights(model, results_dir, names):
    """``[(temporary, path)]``: ``model``'s weights staged (:func:`atomic.stage`) beside each of ``names``, relative
    to ``results_dir``: written by Keras for the first, the others hard links to it (copies where the file system
    has none), so the configuration's file costs no space; nothing is left behind when one fails."""
    staged = []
    try:
        for name in names:
            path = results_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if not staged:
                atomic.check_room(path.parent, _weights_bytes(model))
            write = functools.partial(_link_or_copy, staged[0][0]) if staged else model.save_weights
            staged.append((atomic.stage(path, write=write), path))
    except BaseException:
        for temporary, _ in staged:
            atomic.discard(temporary)
        raise
    return staged


def _weights_bytes(model):
    """About the size of ``model``'s ``.weights.h5`` (a little more): its variables and its optimizer's, and HDF5's
    bookkeeping of each (1-3 KiB measured) and of the file."""
    variables = [*model.weights, *getattr(model.optimizer, "variables", [])]
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize + 4096 for v in variables) + 65536


def _link_or_copy(source, target):
    """Make ``target`` (an empty temporary file) another name of ``source``, or a copy of it without hard links."""
    os.unlink(target)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _kept_epochs(path, initial_epoch):
    """``(header, rows)`` of the epochs ``<= initial_epoch`` in ``path``; ``(None, [])`` to start anew."""
    if initial_epoch <= 0 or not path.exists():
        return None, []
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        return reader.fieldnames, [r for r in reader if int(r["epoch"]) <= initial_epoch]
