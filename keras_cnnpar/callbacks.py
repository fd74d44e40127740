"""Run logging: the per-epoch CSV, ``runs.csv`` and ``results.log`` (design §7).

Example:

>>> import os, tempfile, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> results = tempfile.mkdtemp()
>>> history = model.fit(digits.x[:256], digits.y[:256], batch_size=64, strategy="single",
...                     results_dir=results, verbose=0)   # adds a RunLogger
>>> sorted(os.listdir(results))
['cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.csv', 'results.log', 'runs.csv']
"""

import csv
import dataclasses
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

import keras

from keras_cnnpar import models

RUNS_COLUMNS = [
    "timestamp", "model", "strategy", "devices", "global_batch", "epochs",
    "loss", "accuracy", "val_loss", "val_accuracy",
    "train_seconds", "images_per_second", "speedup", "efficiency", "epoch_csv",
]


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a run is: the names in its files and the figures its throughput needs."""

    model: str
    strategy: str
    devices: int
    global_batch: int
    samples_per_epoch: int | None
    epochs: int
    initial_epoch: int = 0

    @property
    def epoch_csv(self):
        return models.run_file_name(self.model, self.strategy, self.devices)


class RunLogger(keras.callbacks.Callback):
    """Write a run's per-epoch CSV, its ``runs.csv`` row and its ``results.log`` lines.

    Follows ``keras.callbacks.CSVLogger``'s lifecycle: the epoch CSV opens in
    ``on_train_begin``, gets one flushed row per epoch, and closes in
    ``on_train_end``, which also appends the run's row to ``runs.csv``. Columns
    are ``epoch`` (1-based) then the rest sorted by name. A run that starts at
    ``initial_epoch > 0`` keeps the rows of the epochs before it and appends, so
    no epoch appears twice. Only the chief process adds this callback.

    It must come after callbacks that change the logs (it writes what it sees),
    and it measures an epoch's training time up to the start of validation.

    Example:

    >>> import tempfile, keras_cnnpar as cnnpar
    >>> info = RunInfo("cnn2d_3layer_fullconnected_3layer", "single", 1, 64, 256, epochs=1)
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[:256], digits.y[:256], batch_size=64, verbose=0,
    ...                     callbacks=[RunLogger(info, tempfile.mkdtemp())])

    Args:
        info: the run's :class:`RunInfo`.
        results_dir: folder of the three files; created when training starts.
        report: the strategy's layout report, logged after the start line.
    """

    def __init__(self, info, results_dir, report=None):
        super().__init__()
        self.info = info
        self.report = report
        self.results_dir = Path(results_dir)
        self._file = None
        self._writer = None
        self._epochs = []

    def on_train_begin(self, logs=None):
        self.results_dir.mkdir(parents=True, exist_ok=True)
        path = self.results_dir / self.info.epoch_csv
        header = _keep_epochs(path, self.info.initial_epoch)
        self._file = open(path, "a" if header else "w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, header) if header else None
        self._epochs = []
        self._log(f"start model={self.info.model} strategy={self.info.strategy} devices={self.info.devices} "
                  f"global_batch={self.info.global_batch} epochs={self.info.epochs} "
                  f"initial_epoch={self.info.initial_epoch} csv={path.name}")
        for line in (self.report or "").splitlines():
            self._log(f"layout {line}")

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
            "timestamp": _now(),
            "epoch_seconds": round(now - self._epoch_start, 6),
            "train_seconds": round(train_seconds, 6),
            "images_per_second": round(samples / train_seconds, 2) if samples else "",
            "strategy": self.info.strategy,
            "devices": self.info.devices,
            "global_batch": self.info.global_batch,
        }
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, ["epoch", *sorted(set(row) - {"epoch"})])
            self._writer.writeheader()
        self._writer.writerow({key: row.get(key, "") for key in self._writer.fieldnames})
        self._file.flush()
        self._epochs.append(row)
        metrics = " ".join(f"{k}={row[k]:.4f}" for k in ("loss", "accuracy", "val_loss", "val_accuracy") if k in row)
        self._log(f"epoch {epoch + 1}/{self.info.epochs} {metrics} images_per_second={row['images_per_second']}")
        if row.get("lost_workers"):
            self._log(f"event epoch {epoch + 1}: {int(row['lost_workers'])} worker(s) lost; "
                      f"their steps ran again on the others")

    def on_train_end(self, logs=None):
        self._close()
        if self._epochs:
            row = _append_run(self.results_dir / "runs.csv", self.info, self._epochs)
            self._log(f"end model={self.info.model} strategy={self.info.strategy} "
                      f"images_per_second={row['images_per_second']} speedup={row['speedup']}")

    def on_failure(self, error):
        """Close the epoch CSV, drop it if it holds no row, and log why training stopped.

        ``cnnpar.fit`` calls this when training raises; rows of completed epochs stay.
        """
        self._close()
        path = self.results_dir / self.info.epoch_csv
        if self._writer is None and path.exists() and path.stat().st_size == 0:
            path.unlink()
        self._log(f"failed model={self.info.model} strategy={self.info.strategy}: "
                  f"{type(error).__name__}: {error}")

    def _close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def _log(self, message):
        self.results_dir.mkdir(parents=True, exist_ok=True)
        with open(self.results_dir / "results.log", "a", encoding="utf-8") as log:
            log.write(f"{_now()} {message}\n")


def _now():
    return datetime.now().isoformat(timespec="seconds")


def _keep_epochs(path, initial_epoch):
    """Keep the rows of epochs ``<= initial_epoch`` in ``path``; return its header, or None to start anew."""
    if initial_epoch <= 0 or not path.exists():
        return None
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        header, rows = reader.fieldnames, [r for r in reader if int(r["epoch"]) <= initial_epoch]
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(partial, path)
    return header


def run_throughput(epochs):
    """Images/s of a run: the median over its epochs, leaving out the first (tracing) when there are more."""
    measured = [e["images_per_second"] for e in epochs[1:] or epochs if e["images_per_second"] != ""]
    return round(statistics.median(measured), 2) if measured else ""


def _append_run(path, info, epochs):
    last = epochs[-1]
    throughput = run_throughput(epochs)
    baseline = _single_throughput(path, info)
    speedup = round(throughput / baseline, 4) if baseline and throughput != "" else ""
    row = {
        "timestamp": _now(), "model": info.model, "strategy": info.strategy, "devices": info.devices,
        "global_batch": info.global_batch, "epochs": last["epoch"],
        **{key: last.get(key, "") for key in ("loss", "accuracy", "val_loss", "val_accuracy")},
        "train_seconds": round(sum(e["train_seconds"] for e in epochs), 4),
        "images_per_second": throughput,
        "speedup": 1.0 if info.strategy == "single" else speedup,
        "efficiency": 1.0 if info.strategy == "single" else (round(speedup / info.devices, 4) if speedup else ""),
        "epoch_csv": info.epoch_csv,
    }
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, RUNS_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)
    return row


def _single_throughput(path, info):
    """Images/s of the latest Single run of the same model and global batch in ``runs.csv``."""
    if not path.exists():
        return None
    with open(path, newline="", encoding="utf-8") as file:
        rows = [r for r in csv.DictReader(file)
                if r["model"] == info.model and r["strategy"] == "single"
                and r["global_batch"] == str(info.global_batch) and r["images_per_second"]]
    return float(rows[-1]["images_per_second"]) if rows else None
