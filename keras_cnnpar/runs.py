"""The results folder: the names of a run's files, ``runs.csv`` and its speedup rule, and atomic writes.

This module knows the folder's layout and nothing of TensorFlow; every other
module asks it for a name or a row. A run configuration's files are named as
in the original project:

>>> run_file_name("cnn2d_2layer_fullconnected_2layer", "mirrored", 2)
'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_mirrored_2dev.csv'
>>> run_file_name("cnn2d_2layer_fullconnected_2layer", "single", 1, ".weights.h5")
'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.weights.h5'
>>> kind_of("cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.weights.h5")
'3+3'

Speedup is measured against the latest ``single`` run of the same model at the
same global batch, in ``runs.csv`` and in the sweep summary alike:

>>> rows = [{"model": "m", "strategy": "single", "global_batch": "64", "images_per_second": "100"},
...         {"model": "m", "strategy": "single", "global_batch": "128", "images_per_second": "150"}]
>>> single_throughput(rows, "m", 64)
100.0
"""

import contextlib
import csv
import dataclasses
import fcntl
import io
import os
import statistics
import tempfile
import warnings
from datetime import datetime
from pathlib import Path

FRAMEWORK = "keras_tensorflow"

#: Model kind -> the name the original project gave its result files (and the Keras model's name).
MODEL_NAMES = {
    "2+2": "cnn2d_2layer_fullconnected_2layer",
    "3+3": "cnn2d_3layer_fullconnected_3layer",
    "resnet": "cnn2d_resnet_3stage",
}

RUNS_CSV = "runs.csv"
RESULTS_LOG = "results.log"
#: Default folder of the checkpoints of interrupted runs, inside the results folder.
CHECKPOINTS = "checkpoints"
#: Columns of ``runs.csv``, in order (documented in docs/results.md).
RUNS_COLUMNS = [
    "timestamp", "model", "strategy", "devices", "global_batch", "epochs",
    "loss", "accuracy", "val_loss", "val_accuracy",
    "train_seconds", "images_per_second", "speedup", "efficiency", "epoch_csv",
]
BASELINE = "single"


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
    precision: str = "float32"

    @property
    def epoch_csv(self):
        return run_file_name(self.model, self.strategy, self.devices)


def run_file_name(model_name, strategy, devices, suffix=".csv"):
    """Name of a run configuration's file (its per-epoch CSV by default), in the original project's convention."""
    return f"{model_name}_{FRAMEWORK}_{strategy}_{devices}dev{suffix}"


def kind_of(file_name):
    """The model kind (``"2+2"``, ``"3+3"`` or ``"resnet"``) whose run files start like ``file_name``, else None."""
    return next((kind for kind, name in MODEL_NAMES.items() if Path(file_name).name.startswith(name + "_")), None)


def model_label(model_name):
    """The short name of a model in plots and tables: its kind (``"2+2"``) when it is one of ours, else its name.

    >>> model_label("cnn2d_2layer_fullconnected_2layer"), model_label("my_cnn")
    ('2+2', 'my_cnn')
    """
    return kind_of(model_name + "_") or model_name


def now():
    """The timestamp written into every file of the results folder."""
    return datetime.now().isoformat(timespec="seconds")


def read_csv(path):
    """The rows of a CSV file as dicts; ``[]`` when it does not exist."""
    if not Path(path).exists():
        return []
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def csv_text(columns, rows):
    """``rows`` (dicts) as CSV text with a header of ``columns``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_atomic(path, content, write=None):
    """Write ``path`` all at once: a unique temporary file in the same folder, flushed, fsynced, then renamed.

    ``content`` is text or bytes; or give ``write(temporary_path)`` to let
    another library write the temporary file (its name keeps ``path``'s
    suffixes). A reader sees the old file or the new one, never half of one,
    and a failed write leaves the old file as it was.

    >>> folder = Path(tempfile.mkdtemp())
    >>> write_atomic(folder / "a.txt", "hello")
    >>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
    ('hello', ['a.txt'])
    """
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial" + "".join(path.suffixes),
                                             dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            if write is None:
                file.write(content.encode("utf-8") if isinstance(content, str) else content)
        if write is not None:
            write(temporary)
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(path):
    """``path`` opened for reading and appending (created if missing) under an exclusive ``flock``.

    Every append to a shared file of the results folder (``runs.csv``,
    ``results.log``) goes through it, so concurrent runs into one folder never
    interleave their writes nor both write a header.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", newline="", encoding="utf-8") as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            file.seek(0)
            yield file
            file.flush()
            os.fsync(file.fileno())
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)


def append_line(path, line):
    """Append one whole line to a text file (the results log), creating its folder."""
    with locked(path) as file:
        file.seek(0, os.SEEK_END)
        file.write(line + "\n")


def run_throughput(epochs):
    """Images/s of a run: the median over its epochs, leaving out the first (tracing) when there are more."""
    measured = [float(e["images_per_second"]) for e in epochs[1:] or epochs if e["images_per_second"] != ""]
    return round(statistics.median(measured), 2) if measured else ""


def single_throughput(rows, model, global_batch):
    """Images/s of the latest Single run of ``model`` at ``global_batch`` among ``runs.csv`` rows, or None."""
    matching = [r for r in rows if r.get("model") == model and r.get("strategy") == BASELINE
                and str(r.get("global_batch")) == str(global_batch) and _number(r.get("images_per_second"))]
    return _number(matching[-1]["images_per_second"]) if matching else None


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def speedup_and_efficiency(strategy, devices, throughput, baseline):
    """``(speedup, efficiency)`` of a run against its Single baseline; ``""`` where unknown.

    >>> speedup_and_efficiency("mirrored", 2, 150.0, 100.0)
    (1.5, 0.75)
    """
    if strategy == BASELINE:
        return 1.0, 1.0
    if not baseline or throughput == "":
        return "", ""
    speedup = round(float(throughput) / baseline, 4)
    return speedup, round(speedup / int(devices), 4)


def append_run(results_dir, info, epochs):
    """Append the row of a finished run (its :class:`RunInfo` and epoch rows) to ``runs.csv``; return it.

    A damaged ``runs.csv`` never fails the run: a file whose header is not
    ``RUNS_COLUMNS`` is left alone (the row is not recorded there), and lines
    with the wrong number of values are skipped when looking for the Single
    baseline; each problem is a warning that names the file and the line.
    """
    path = Path(results_dir) / RUNS_CSV
    with locked(path) as file:
        text = file.read()
        rows, usable = _recorded_rows(path, text)
        throughput = run_throughput(epochs)
        speedup, efficiency = speedup_and_efficiency(
            info.strategy, info.devices, throughput, single_throughput(rows, info.model, info.global_batch))
        last = epochs[-1]
        row = {
            "timestamp": now(), "model": info.model, "strategy": info.strategy, "devices": info.devices,
            "global_batch": info.global_batch, "epochs": last["epoch"],
            **{key: last.get(key, "") for key in ("loss", "accuracy", "val_loss", "val_accuracy")},
            "train_seconds": round(sum(float(e["train_seconds"]) for e in epochs), 4),
            "images_per_second": throughput, "speedup": speedup, "efficiency": efficiency,
            "epoch_csv": info.epoch_csv,
        }
        if usable:
            file.write("" if not text or text.endswith("\n") else "\n")  # after a line cut short
            writer = csv.DictWriter(file, RUNS_COLUMNS)
            if not text:
                writer.writeheader()
            writer.writerow(row)
    return row


def _recorded_rows(path, text):
    """``(rows, usable)``: the well-formed rows of ``runs.csv``'s ``text``, and whether a row may be appended."""
    lines = list(csv.reader(io.StringIO(text)))
    if not lines:
        return [], True
    if lines[0] != RUNS_COLUMNS:
        warnings.warn(f"{path}, line 1: expected the header {','.join(RUNS_COLUMNS)}. Received: "
                      f"{','.join(lines[0])[:80]!r}; this run's row was not recorded there (move or fix the file)",
                      stacklevel=3)
        return [], False
    rows = []
    for number, values in enumerate(lines[1:], start=2):
        if len(values) != len(RUNS_COLUMNS):
            warnings.warn(f"{path}, line {number}: expected {len(RUNS_COLUMNS)} comma-separated values. Received: "
                          f"{len(values)} values; the line is ignored", stacklevel=3)
            continue
        rows.append(dict(zip(RUNS_COLUMNS, values)))
    return rows, True
