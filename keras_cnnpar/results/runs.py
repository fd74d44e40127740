"""The results folder: the names of a run's files, ``runs.csv`` (its columns, migration and speedup rule), the log.

This module knows the folder's layout and nothing of TensorFlow; every other
module asks it for a name or a row. A run configuration's files are named as
in the original project:

>>> run_file_name("cnn2d_2layer_fullconnected_2layer", "mirrored", 2)
'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_mirrored_2dev.csv'
>>> run_file_name("cnn2d_2layer_fullconnected_2layer", "single", 1, ".weights.h5")
'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.weights.h5'
>>> kind_of("cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.weights.h5")
'3+3'

Each run also keeps its own copies under ``runs/<run id>/``, so two runs of one
configuration at once never share a file; the names above are the
configuration's latest run (a copy, replaced whole after every epoch):

>>> info = RunInfo("cnn2d_2layer_fullconnected_2layer", "single", 1, 64, 4000, 3, run_id="20261201T1200-7-ab")
>>> info.epoch_csv
'runs/20261201T1200-7-ab/cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.csv'
>>> info.view_csv
'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.csv'

Speedup is measured against the latest ``single`` run of the same model, global
batch, precision, data and machine, in ``runs.csv`` and in the sweep summary alike:

>>> like = {"model": "m", "global_batch": "64", "precision": "float32", "data": "d", "machine": "cpu"}
>>> rows = [{**like, "strategy": "single", "images_per_second": "100"},
...         {**like, "strategy": "single", "global_batch": "128", "images_per_second": "150"},
...         {**like, "strategy": "single", "data": "2 examples", "images_per_second": "2"}]
>>> single_throughput(rows, like)
100.0
"""

import contextlib
import csv
import dataclasses
import errno
import fcntl
import io
import math
import os
import secrets
import statistics
import warnings
from datetime import datetime
from pathlib import Path

from keras_cnnpar.runtime.atomic import write_atomic
from keras_cnnpar.zoo.names import MODEL_NAMES

FRAMEWORK = "keras_tensorflow"

RUNS_CSV = "runs.csv"
RESULTS_LOG = "results.log"
#: Folder of the results folder that holds one folder of files per run, named by the run's id.
RUN_FOLDERS = "runs"
#: Default folder of the checkpoints of interrupted runs, inside the results folder.
CHECKPOINTS = "checkpoints"
#: The shares of the last epoch's time split (``checks.StepTimeSplit``, in ``--checks`` runs), and its kind.
SHARE_COLUMNS = ("compute_share", "communication_share", "input_share", "idle_share")
SPLIT_COLUMNS = (*SHARE_COLUMNS, "time_split")
#: Columns of ``runs.csv``, in order (documented in docs/results.md); the split's are empty without one.
RUNS_COLUMNS = [
    "timestamp", "model", "strategy", "devices", "global_batch", "epochs",
    "loss", "accuracy", "val_loss", "val_accuracy",
    "train_seconds", "images_per_second", "speedup", "efficiency", "epoch_csv",
    "precision", "data", "run_id", "version", "tensorflow", "machine",
    *SPLIT_COLUMNS,
]
#: The headers of ``runs.csv`` that older versions wrote, which a migration maps onto ``RUNS_COLUMNS``: the
#: first version's, and the one before the time split's columns.
OLDER_RUNS_COLUMNS = (RUNS_COLUMNS[:RUNS_COLUMNS.index("precision")],
                      RUNS_COLUMNS[:RUNS_COLUMNS.index(SPLIT_COLUMNS[0])])
#: The columns of ``runs.csv`` that hold a number, or nothing.
NUMBER_COLUMNS = ("devices", "global_batch", "epochs", "loss", "accuracy", "val_loss", "val_accuracy",
                  "train_seconds", "images_per_second", "speedup", "efficiency", *SHARE_COLUMNS)
BASELINE = "single"
#: What a run and its Single baseline must share for a speedup to mean anything.
BASELINE_KEYS = ("model", "global_batch", "precision", "data", "machine")


class ResultsFileError(ValueError):
    """A results file that does not read as a version of this library wrote it; the message names the file, the
    line and, where one is at fault, the column."""


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
    #: What identifies the training data (size and a digest of the labels), for the baseline match.
    data: str = ""
    #: The run's own id, in its ``runs.csv`` row and every ``results.log`` line.
    run_id: str = ""
    #: Provenance (``keras_cnnpar.results.provenance``): package version, TensorFlow's, the machine.
    version: str = ""
    tensorflow: str = ""
    machine: str = ""

    @property
    def epoch_csv(self):
        """This run's own epoch CSV, relative to the results folder (``runs.csv``'s ``epoch_csv`` column)."""
        return self.own_file(".csv")

    @property
    def view_csv(self):
        """The configuration's epoch CSV, a copy of its latest run's (the original project's name)."""
        return run_file_name(self.model, self.strategy, self.devices)

    @property
    def weights_files(self):
        """Where this run's trained weights go (``cnnpar train``): its own file, then the configuration's."""
        return weights_files({"epoch_csv": self.epoch_csv})

    def own_file(self, suffix):
        """This run's own file with ``suffix`` (``runs/<run id>/<configuration><suffix>``; without an id, the
        configuration's file)."""
        name = run_file_name(self.model, self.strategy, self.devices, suffix)
        return f"{RUN_FOLDERS}/{self.run_id}/{name}" if self.run_id else name


def run_file_name(model_name, strategy, devices, suffix=".csv"):
    """Name of a run configuration's file (its per-epoch CSV by default), in the original project's convention;
    ``devices=None`` leaves the device count out (the checkpoint of a strategy that resumes on another count).

    >>> run_file_name("m", "multi-worker", None, "")
    'm_keras_tensorflow_multi-worker'
    """
    return f"{model_name}_{FRAMEWORK}_{strategy}" + ("" if devices is None else f"_{devices}dev") + suffix


def weights_files(row):
    """Where the weights of the run of ``runs.csv`` ``row`` go: its own file, then the configuration's (the latest
    run's), relative to the results folder.

    >>> weights_files({"epoch_csv": "runs/7/m_keras_tensorflow_single_1dev.csv"})
    ['runs/7/m_keras_tensorflow_single_1dev.weights.h5', 'm_keras_tensorflow_single_1dev.weights.h5']
    """
    own = str(Path(row["epoch_csv"]).with_suffix(".weights.h5"))
    return list(dict.fromkeys([own, Path(own).name]))


def kind_of(file_name):
    """The model kind (``"2+2"``, ``"3+3"`` or ``"resnet"``) whose run files start like ``file_name``, else None."""
    return next((kind for kind, name in MODEL_NAMES.items() if Path(file_name).name.startswith(name + "_")), None)


def model_label(model_name):
    """The short name of a model in plots and tables: its kind (``"2+2"``) when it is one of ours, else its name.

    >>> model_label("cnn2d_2layer_fullconnected_2layer"), model_label("my_cnn")
    ('2+2', 'my_cnn')
    """
    return kind_of(model_name + "_") or model_name


def new_run_id():
    """A run's id: when it started, its process and a random part, so two runs never share one.

    >>> len(new_run_id().split("-"))
    3
    """
    return f"{datetime.now():%Y%m%dT%H%M%S}-{os.getpid()}-{secrets.token_hex(2)}"


def now():
    """The timestamp written into every file of the results folder."""
    return datetime.now().isoformat(timespec="seconds")


def read_csv(path):
    """The rows of a CSV file as dicts; ``[]`` when it does not exist."""
    if not Path(path).exists():
        return []
    with open(path, newline="", encoding="utf-8-sig") as file:
        return list(csv.DictReader(file))


def csv_text(columns, rows):
    """``rows`` (dicts) as CSV text with a header of ``columns``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


@contextlib.contextmanager
def locked(path):
    """``path`` opened for reading and appending (created if missing) under an exclusive ``flock``.

    Every append to a shared file of the results folder (``runs.csv``,
    ``results.log``) goes through it, so concurrent runs into one folder never
    interleave their writes nor both write a header. A file replaced while
    this process waited for the lock (a migrated ``runs.csv``) is opened again.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    while True:
        with _open_in_place(path) as file:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX)
            try:
                if os.path.exists(path) and os.stat(path).st_ino != os.fstat(file.fileno()).st_ino:
                    continue  # replaced while this process waited: lock the new file instead
                file.seek(0)
                yield file
                file.flush()
                os.fsync(file.fileno())
                return
            finally:
                fcntl.flock(file.fileno(), fcntl.LOCK_UN)


def _open_in_place(path):
    """``path`` opened for reading and appending, created under the umask if missing; a symbolic link is refused
    with a ``ValueError`` (a results file is written in place, never through a link to elsewhere)."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); results files are written in place, "
                         f"never through a link: remove the link or choose another results folder. "
                         f"Received: {path}") from None
    return os.fdopen(descriptor, "a+", newline="", encoding="utf-8")


def append_line(path, line):
    """Append one whole line to a text file (the results log), creating its folder."""
    with locked(path) as file:
        file.seek(0, os.SEEK_END)
        file.write(line + "\n")


def run_throughput(epochs):
    """Images/s of a run: the median over its epochs, leaving out the first (tracing) when there are more, and
    the one run under the profiler for the time split (``time_split`` set) when another remains.

    >>> run_throughput([{"images_per_second": 10}, {"images_per_second": 100}, {"images_per_second": 90,
    ...                 "time_split": "trace"}])
    100.0
    """
    timed = epochs[1:] or epochs
    timed = [e for e in timed if not e.get("time_split")] or timed
    measured = [float(e["images_per_second"]) for e in timed if e["images_per_second"] != ""]
    return round(statistics.median(measured), 2) if measured else ""


def single_throughput(rows, run):
    """Images/s of the latest Single run among ``runs.csv`` ``rows`` that shares ``run``'s model, global batch,
    precision, data and machine (:data:`BASELINE_KEYS`), or None; a key that either leaves empty never matches."""
    def same(row):
        return all(str(row.get(key) or "") == str(run.get(key) or "") != "" for key in BASELINE_KEYS)

    matching = [r for r in rows if r.get("strategy") == BASELINE and same(r) and _number(r.get("images_per_second"))]
    return _number(matching[-1]["images_per_second"]) if matching else None


def _share(value):
    """A split column's value as ``runs.csv`` holds it: a share to 4 places, the split's kind, or empty.

    >>> _share(0.123456), _share(float("nan")), _share("trace"), _share("nan")
    (0.1235, '', 'trace', '')
    """
    number = _number(value)
    if number is None:
        return value
    return "" if math.isnan(number) else round(number, 4)


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


def prepare_runs_csv(results_dir):
    """Make ``runs.csv`` of ``results_dir`` ready for a row, before a run trains; raise ``ValueError`` if it cannot be.

    A file written by an older version (a header of :data:`OLDER_RUNS_COLUMNS`)
    is migrated in place, atomically, after a copy of it is kept beside it
    (``runs.csv.<time>.bak``): the current header, every old row with the new
    columns empty; a ``UserWarning`` names the added columns and the copy. Any
    other header, or an old row the migration could not map, is refused
    (:func:`check_runs_csv`) and the file left as it was.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / RUNS_CSV).write_text(csv_text(OLDER_RUNS_COLUMNS[0], [{"model": "m"}]))
    >>> import warnings; warnings.simplefilter("ignore")
    >>> prepare_runs_csv(folder)
    >>> [row["model"] for row in read_csv(folder / RUNS_CSV)], read_csv(folder / RUNS_CSV)[0]["machine"]
    (['m'], '')
    >>> [path.name.endswith(".bak") for path in sorted(folder.iterdir())]
    [False, True]
    """
    check_runs_csv(results_dir)
    path = Path(results_dir) / RUNS_CSV
    if not path.exists():
        return
    with locked(path) as file:
        text = file.read()
        migrated = _migrated(path, text)
        if migrated != text:
            _replace_migrated(path, text, migrated)


def check_runs_csv(results_dir):
    """Raise ``ValueError`` unless a run could record its row in ``runs.csv`` of ``results_dir`` without losing one:
    a header that is neither this version's nor an older version's (:data:`OLDER_RUNS_COLUMNS`), naming the
    columns missing and unexpected; an older file's row of another number of values; a ``runs.csv`` or
    ``results.log`` that is a symbolic link. It only reads (the CLI calls it before anything else is done).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> header = ",".join(RUNS_COLUMNS).replace("machine", "host")
    >>> _ = (folder / RUNS_CSV).write_text(header + "\\n")
    >>> check_runs_csv(folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../runs.csv, line 1: ...; against this version's, it lacks machine and has host besides. Received: ...
    """
    for name in (RUNS_CSV, RESULTS_LOG):
        if (Path(results_dir) / name).is_symlink():
            _open_in_place(Path(results_dir) / name)  # refuses it, naming the link and its target
        _check_appendable(Path(results_dir) / name)
    path = Path(results_dir) / RUNS_CSV
    if path.exists():
        with open(path, newline="", encoding="utf-8") as file:
            _old_rows(path, file.read())


def _check_appendable(path):
    """Raise ``ValueError`` where ``path`` exists but is not a file this process can read and append to.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> (folder / RUNS_CSV).mkdir()
    >>> _check_appendable(folder / RUNS_CSV)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../runs.csv: expected a file that this user can read and append to; it is a folder. Received: ...
    """
    if not path.exists():
        return
    found = ("a folder" if path.is_dir() else "not a regular file" if not path.is_file()
             else None if os.access(path, os.R_OK | os.W_OK) else "not readable and writable by this user")
    if found:
        raise ValueError(f"{path}: expected a file that this user can read and append to; it is {found}. "
                         f"Received: {path}")


#: What Excel writes before the header of a CSV it saves as UTF-8; read as nothing.
BYTE_ORDER_MARK = "\ufeff"


def _migrated(path, text):
    """``text`` of ``runs.csv`` under the current header: as it is, or an older version's rows with the new columns
    empty; a ``ValueError`` when the migration could not keep every row (see :func:`_old_rows`)."""
    old_rows = _old_rows(path, text)
    return text if old_rows is None else csv_text(RUNS_COLUMNS, old_rows)


def _old_rows(path, text):
    """The rows of ``text`` of ``runs.csv`` as dicts when it has an older version's header; None when it has the
    current one (or is empty; a byte-order mark before it, as a spreadsheet may write, is read as nothing). A ``ValueError`` for any other header, or a row of another number of values than
    its header (it could not be mapped: a migration never drops a row)."""
    reader = csv.reader(io.StringIO(text.removeprefix(BYTE_ORDER_MARK)))  # lines end at "\n" only, as csv writes
    header = next(reader, None)
    if header is None or header == RUNS_COLUMNS:
        return None
    if header not in OLDER_RUNS_COLUMNS:
        raise ValueError(_unknown_header(path, header))
    rows = []
    for values in reader:
        if not values:
            continue  # a blank line holds no run
        if len(values) != len(header):
            raise ValueError(f"{path}, line {reader.line_num}: expected {len(header)} comma-separated values, as "
                             f"under its header (an older version's), to migrate it to this version's columns. "
                             f"Received: {len(values)} values; fix or remove that line, then run again (nothing was "
                             f"changed)")
        rows.append(dict(zip(header, values)))
    return rows


def _unknown_header(path, header):
    """The refusal of a ``runs.csv`` ``header`` that no version wrote: the columns it lacks and has besides, against
    the nearest header a version wrote."""
    nearest = min([RUNS_COLUMNS, *OLDER_RUNS_COLUMNS], key=lambda known: len(set(known) ^ set(header)))
    missing = [column for column in nearest if column not in header]
    unexpected = [column for column in dict.fromkeys(header) if column not in nearest]
    repeated = sorted({column for column in header if header.count(column) > 1})
    difference = (f"it lacks {','.join(missing) or 'no column'} and has {','.join(unexpected) or 'no column'} besides"
                  + (f", and repeats {','.join(repeated)}" if repeated else "")
                  if missing or unexpected or repeated else "its columns are in another order")
    version = "this version's" if nearest is RUNS_COLUMNS else "an older version's"
    received = ",".join(header)
    received = received if len(received) <= 100 else received[:100] + "..."
    return (f"{path}, line 1: expected the header of this version's runs.csv or an older version's, whose rows a "
            f"migration keeps; against {version}, {difference}. Received: header={received!r}; restore the header "
            f"or move the file aside, then run again (a missing runs.csv is started anew)")


def _replace_migrated(path, text, migrated, new_rows=""):
    """Replace ``runs.csv`` at ``path`` (``text``, an older version's) with ``migrated`` and ``new_rows`` (CSV lines)
    once a copy of ``text`` is kept beside it; a ``UserWarning`` names the added columns and the copy. Call it
    holding the file's lock."""
    backup = _backup_name(path)
    write_atomic(backup, text)
    write_atomic(path, migrated + new_rows)
    header = next(csv.reader(text.removeprefix(BYTE_ORDER_MARK).splitlines()[:1]))
    added = [column for column in RUNS_COLUMNS if column not in header]
    earlier = len(list(csv.reader(io.StringIO(migrated)))) - 1
    warnings.warn(f"{path}: migrated to this version's columns; added {','.join(added)} (empty in the {earlier} "
                  f"earlier rows); the file as it was is kept as {backup.name}", stacklevel=4)


def _backup_name(path):
    """A free name for a copy of ``path`` beside it: ``<name>.<time>.bak``, then ``<name>.<time>-2.bak`` and on."""
    stem = f"{path.name}.{datetime.now():%Y%m%dT%H%M%S}"
    names = (f"{stem}.bak", *(f"{stem}-{count}.bak" for count in range(2, 1000)))
    return next(path.with_name(name) for name in names if not path.with_name(name).exists())


def append_run(results_dir, info, epochs, strict=False):
    """Append the row of a finished run (its :class:`RunInfo` and epoch rows) to ``runs.csv``; return it.

    An older ``runs.csv`` is migrated first (:func:`prepare_runs_csv`, which a
    run calls before training too). A damaged line never fails the run: lines
    with the wrong number of values are skipped when looking for the Single
    baseline, each with a warning that names the file and the line; a file
    that became unusable during the run keeps its content, and the row is not
    recorded there: a warning says so and None is returned, or with ``strict``
    (the run's weights ride on its row) a ``ValueError`` is raised.
    """
    path = Path(results_dir) / RUNS_CSV
    with locked(path) as file:
        text = file.read()
        try:
            migrated = _migrated(path, text)
        except ValueError as error:
            if strict:
                raise
            warnings.warn(f"{error}; this run's row was not recorded there", stacklevel=3)
            return None
        throughput = run_throughput(epochs)
        last = epochs[-1]
        row = {
            "timestamp": now(), "model": info.model, "strategy": info.strategy, "devices": info.devices,
            "global_batch": info.global_batch, "epochs": last["epoch"],
            **{key: last.get(key, "") for key in ("loss", "accuracy", "val_loss", "val_accuracy")},
            "train_seconds": round(sum(float(e["train_seconds"]) for e in epochs), 4),
            "images_per_second": throughput, "epoch_csv": info.epoch_csv,
            **{key: getattr(info, key) for key in ("precision", "data", "run_id", "version", "tensorflow", "machine")},
            **{key: _share(last.get(key, "")) for key in SPLIT_COLUMNS},
        }
        row["speedup"], row["efficiency"] = speedup_and_efficiency(
            info.strategy, info.devices, throughput, single_throughput(_recorded_rows(path, migrated), row))
        if migrated != text:  # the migrated file and the row replace the old file at once
            _replace_migrated(path, text, migrated, csv_text(RUNS_COLUMNS, [row]).split("\n", 1)[1])
            return row
        file.write("" if not text or text.endswith("\n") else "\n")  # after a line cut short
        writer = csv.DictWriter(file, RUNS_COLUMNS)
        if not text:
            writer.writeheader()
        writer.writerow(row)
    return row


def _recorded_rows(path, text):
    """The well-formed rows of ``text``, the content of ``runs.csv`` under the current header."""
    lines = list(csv.reader(io.StringIO(text)))
    return [dict(zip(RUNS_COLUMNS, values)) for _, values in _whole_rows(path, lines[1:], RUNS_COLUMNS)]


def _whole_rows(path, lines, header):
    """``(line number, values)`` of each of ``lines`` (a CSV file's rows after ``header``) that holds a value per
    column; a warning names each other line (cut short, say: a run that stopped mid-write) and it is left out."""
    for number, values in enumerate(lines, start=2):
        if len(values) != len(header):
            warnings.warn(f"{path}, line {number}: expected {len(header)} comma-separated values. Received: "
                          f"{len(values)} values; the line is ignored", stacklevel=3)
            continue
        yield number, values


def read_runs(path):
    """The rows of the ``runs.csv`` at ``path`` as dicts, checked for a report (``[]`` where it does not exist).

    A header that no version wrote (a name missing or renamed: the values would shift under the names) and a value
    that is not a number in a column of numbers (:data:`NUMBER_COLUMNS`) raise :class:`ResultsFileError`, naming the
    file, the line and the column; a line of another number of values than the header's (cut short) is left out,
    with a warning naming it, as :func:`append_run` leaves it out of the speedup's baseline. Bytes that are not
    UTF-8 raise :class:`ResultsFileError` too, naming the first.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / RUNS_CSV
    >>> _ = path.write_text(csv_text(RUNS_COLUMNS, [{"model": "m", "devices": "2", "images_per_second": "fast"}]))
    >>> read_runs(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    keras_cnnpar.results.runs.ResultsFileError: .../runs.csv, line 2, column images_per_second: expected a number or nothing. Received: 'fast'
    """
    if not Path(path).exists():
        return []
    try:
        with open(path, newline="", encoding="utf-8-sig") as file:  # "-sig": a byte-order mark read as nothing
            lines = list(csv.reader(file))
    except UnicodeDecodeError as error:
        raise ResultsFileError(f"{path}: expected UTF-8 text. Received: byte {error.object[error.start]:#04x} at "
                               f"offset {error.start}") from None
    if not lines:
        return []
    header = lines[0]
    if header not in (RUNS_COLUMNS, *OLDER_RUNS_COLUMNS):
        raise ResultsFileError(_unknown_header(path, header))
    rows = []
    for number, values in _whole_rows(path, lines[1:], header):
        row = dict(zip(header, values))
        for column in NUMBER_COLUMNS:
            if row.get(column) and _number(row[column]) is None:
                raise ResultsFileError(f"{path}, line {number}, column {column}: expected a number or nothing. "
                                       f"Received: {row[column]!r}")
        rows.append(row)
    return rows
