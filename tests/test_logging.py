import concurrent.futures
import csv
import datetime
import errno
import logging
import math
import os
import re
import socket
import statistics
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.plan import experiments
from keras_cnnpar.results import callbacks, checkpoints, runs
from keras_cnnpar.runtime import atomic
from tests.helpers import ENV, cnnpar_command, documented_runs_columns, fill, flock_waiters, tmpfs, wait_until
from tests.helpers import read_rows as read

EPOCH_COLUMNS = ["epoch", "accuracy", "devices", "epoch_seconds", "global_batch", "images_per_second", "loss",
                 "strategy", "timestamp", "train_seconds", "val_accuracy", "val_loss"]
CSV_NAME = "small_cnn_keras_tensorflow_{}.csv"


@pytest.fixture
def train(few_digits, few_val_digits):
    """Fit on 320 class-balanced digits (256 to train, 64 to validate) with logging into ``results_dir``."""
    (x, y), validation = few_digits, few_val_digits

    def fit(model, results_dir, strategy="single", **kwargs):
        kwargs = {"epochs": 2, "verbose": 0, "batch_size": 64, **kwargs}
        return model.fit(x[:256], y[:256], validation_data=validation, strategy=strategy, results_dir=results_dir,
                         **kwargs)

    return fit


class ReadEpochCsv(keras.callbacks.Callback):
    """Reads the epoch CSV at the start of each epoch, while training is still running."""

    def __init__(self, path):
        super().__init__()
        self.path, self.seen = path, []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append([r["epoch"] for r in read(self.path)] if self.path.exists() else None)


def test_epoch_csv_has_one_row_per_epoch_flushed_during_training(small_cnn, tmp_path, train):
    path = tmp_path / CSV_NAME.format("mirrored_2dev")
    reader = ReadEpochCsv(path)
    history = train(small_cnn(), tmp_path, strategy=cnnpar.DataParallel(2), epochs=3, callbacks=[reader])
    # No file before its first complete epoch; then each row is on disk before the next epoch starts.
    assert reader.seen == [None, ["1"], ["1", "2"]]
    rows = read(path)
    assert list(rows[0]) == EPOCH_COLUMNS
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert {(r["strategy"], r["devices"], r["global_batch"]) for r in rows} == {("mirrored", "2", "64")}
    for r, val_accuracy in zip(rows, history.history["val_accuracy"]):
        assert float(r["images_per_second"]) == pytest.approx(256 / float(r["train_seconds"]), rel=1e-3)
        assert 0 < float(r["train_seconds"]) <= float(r["epoch_seconds"])
        assert float(r["val_accuracy"]) == pytest.approx(val_accuracy, abs=1e-6)


@pytest.mark.parametrize("strategy", ["single", "channels"])  # Keras's own fit, and a loop of ours
def test_validation_every_other_epoch_gets_its_columns_in_the_epoch_csv(small_cnn, tmp_path, train, strategy):
    """The columns came from the first epoch's logs: with ``validation_freq=2`` the validation of epoch 2 was
    left out of the file (as ``keras.callbacks.CSVLogger`` leaves it out)."""
    history = train(small_cnn(), tmp_path, strategy=strategy, epochs=3, validation_freq=2)
    run = read(tmp_path / "runs.csv")[0]
    rows = read(tmp_path / run["epoch_csv"])
    assert list(rows[0]) == EPOCH_COLUMNS
    assert [(r["epoch"], r["val_loss"] != "") for r in rows] == [("1", False), ("2", True), ("3", False)]
    assert float(rows[1]["val_loss"]) == pytest.approx(history.history["val_loss"][0], rel=1e-6)
    view = tmp_path / CSV_NAME.format(f"{run['strategy']}_{run['devices']}dev")
    assert (tmp_path / run["epoch_csv"]).read_bytes() == view.read_bytes()


def test_runs_csv_gets_a_row_per_run_with_speedup_against_single(small_cnn, tmp_path, train):
    train(small_cnn(), tmp_path, epochs=3)
    train(small_cnn(), tmp_path, strategy="mirrored", epochs=3)
    single, mirrored = read(tmp_path / "runs.csv")
    assert list(single) == documented_runs_columns()
    assert (single["strategy"], single["speedup"], single["efficiency"]) == ("single", "1.0", "1.0")
    ratio = float(mirrored["images_per_second"]) / float(single["images_per_second"])
    assert float(mirrored["speedup"]) == pytest.approx(ratio, abs=1e-4)
    assert float(mirrored["efficiency"]) == pytest.approx(ratio / 2, abs=1e-4)
    assert mirrored["epoch_csv"] == f"runs/{mirrored['run_id']}/{CSV_NAME.format('mirrored_2dev')}"
    assert mirrored["epochs"] == "3"
    assert (tmp_path / mirrored["epoch_csv"]).read_bytes() == (tmp_path / CSV_NAME.format("mirrored_2dev")).read_bytes()
    epochs = read(tmp_path / CSV_NAME.format("single_1dev"))
    after_first = [float(r["images_per_second"]) for r in epochs[1:]]
    assert float(single["images_per_second"]) == pytest.approx(statistics.median(after_first), abs=0.01)


def test_results_log_has_timestamped_start_epoch_and_end_lines(small_cnn, tmp_path, train):
    train(small_cnn(), tmp_path)
    lines = (tmp_path / "results.log").read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["start", "machine", "epoch", "epoch", "end"]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ", line) for line in lines)
    assert re.fullmatch(r"\S+ machine CPU .+ \(AVX-512 (yes|no), AVX512-BF16 (yes|no), AMX (yes|no)\); oneDNN (on|off) "
                        r"\(.+\); GPU .+", lines[1])
    assert "epoch 2/2 loss=" in lines[3]


def test_a_rerun_from_initial_epoch_keeps_earlier_rows_without_duplicates(small_cnn, tmp_path, train):
    model = small_cnn()
    train(model, tmp_path, epochs=3)
    train(model, tmp_path, epochs=4, initial_epoch=2)
    assert [r["epoch"] for r in read(tmp_path / CSV_NAME.format("single_1dev"))] == ["1", "2", "3", "4"]


def test_results_dir_none_writes_nothing(small_cnn, tmp_path, monkeypatch, train):
    monkeypatch.chdir(tmp_path)
    train(small_cnn(), None)
    assert list(tmp_path.iterdir()) == []


class Explode(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("boom")


def test_a_failed_run_leaves_no_empty_csv_and_logs_why(small_cnn, tmp_path, train):
    with pytest.raises(RuntimeError, match="boom"):
        train(small_cnn(), tmp_path, callbacks=[Explode()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.log"]
    assert re.fullmatch(r"\S+ failed model=small_cnn strategy=single: RuntimeError: boom \[run \d{8}T\d{6}-\d+-\w{4}\]",
                        (tmp_path / "results.log").read_text().splitlines()[-1])


def run_row(model, strategy, devices, batch, images_per_second, **provenance):
    return {"model": model, "strategy": strategy, "devices": str(devices), "global_batch": str(batch),
            "images_per_second": str(images_per_second), "precision": "float32", "data": "d", "machine": "m",
            **provenance}


def test_the_speedup_baseline_is_the_latest_single_run_of_the_same_model_and_batch():
    rows = [run_row("a", "single", 1, 64, 100), run_row("a", "single", 1, 128, 400), run_row("b", "single", 1, 64, 7),
            run_row("a", "mirrored", 2, 64, 150), run_row("a", "single", 1, 64, 120),
            run_row("a", "single", 1, 64, 9, machine="another"), run_row("a", "single", 1, 64, 9, data="2 examples"),
            run_row("a", "single", 1, 64, 9, precision="mixed_bfloat16"), run_row("a", "single", 1, 64, 9, data="")]
    assert runs.single_throughput(rows, run_row("a", "mirrored", 2, 64, 0)) == 120.0  # the latest alike
    assert runs.single_throughput(rows, run_row("a", "mirrored", 2, 128, 0)) == 400.0
    assert runs.single_throughput(rows, run_row("a", "mirrored", 2, 32, 0)) is None
    assert runs.single_throughput(rows, run_row("a", "mirrored", 2, 64, 0, data="")) is None  # unknown: no match
    assert runs.speedup_and_efficiency("mirrored", 2, 150.0, 120.0) == (1.25, 0.625)
    assert runs.speedup_and_efficiency("mirrored", 2, 150.0, None) == ("", "")


def test_runs_csv_and_the_sweep_summary_agree_on_speedup(small_cnn, tmp_path, train):
    train(small_cnn(), tmp_path, epochs=2)  # the Single baseline at batch 64
    train(small_cnn(), tmp_path, epochs=2, strategy="layers")
    train(small_cnn(), tmp_path, epochs=2, batch_size=32, strategy="mirrored")  # no Single run at batch 32
    recorded = {r["strategy"]: r for r in read(tmp_path / "runs.csv")}
    summary = {row["strategy"]: row for row in experiments.summarize(tmp_path)}
    assert sorted(summary) == ["layers", "mirrored", "single"]
    assert float(recorded["layers"]["speedup"]) == \
        pytest.approx(summary["layers"]["speedup"], abs=1e-4)
    assert recorded["mirrored"]["speedup"] == ""  # no baseline at this batch ...
    assert summary["mirrored"]["speedup"] != summary["mirrored"]["speedup"]  # ... in the summary either (NaN)


@pytest.mark.slow
def test_no_log_writes_no_file_at_all(tmp_path, small_csv):
    result = subprocess.run(cnnpar_command("train", "--no-log", "--epochs", "1", "--strategy", "async-ps", "--model",
                                           "3+3", "--data", small_csv, "--verbose", "0"),
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == []


def test_a_rerun_that_fails_before_its_first_epoch_leaves_the_previous_file(small_cnn, tmp_path, train):
    train(small_cnn(), tmp_path, epochs=2)
    path = tmp_path / CSV_NAME.format("single_1dev")
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        train(small_cnn(), tmp_path, callbacks=[Explode()])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "results.log", "runs", "runs.csv"])
    assert len(list((tmp_path / "runs").iterdir())) == 1  # the failed run left no folder and no temporary file


def test_a_runs_csv_of_unknown_columns_is_refused_before_training_and_left_alone(small_cnn, tmp_path, train):
    (tmp_path / "runs.csv").write_text("timestamp;model;strategy\n2026;m;single\n")
    with pytest.raises(ValueError) as raised:
        train(small_cnn(), tmp_path, epochs=1)
    assert str(raised.value) == (
        f"{tmp_path / 'runs.csv'}, line 1: expected the header of this version's runs.csv or an older version's, "
        f"whose rows a migration keeps; against an older version's, it lacks "
        f"{','.join(runs.OLDER_RUNS_COLUMNS[0])} and has timestamp;model;strategy besides. Received: "
        f"header='timestamp;model;strategy'; restore the header or move the file aside, then run again (a missing "
        f"runs.csv is started anew)")
    assert (tmp_path / "runs.csv").read_text() == "timestamp;model;strategy\n2026;m;single\n"  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.csv"]  # nothing trained, nothing written


def test_a_runs_csv_of_an_older_version_is_migrated_keeping_its_rows(small_cnn, tmp_path, train):
    old_columns = runs.RUNS_COLUMNS[:runs.RUNS_COLUMNS.index("precision")]  # the previous version's
    old_row = dict.fromkeys(old_columns, "") | {"model": "small_cnn", "strategy": "single", "global_batch": "64",
                                              "images_per_second": "5000"}
    (tmp_path / "runs.csv").write_text(runs.csv_text(old_columns, [old_row]))
    with pytest.warns(UserWarning) as warned:
        train(small_cnn(), tmp_path, epochs=1, strategy="mirrored")
    (backup,) = tmp_path.glob("runs.csv.*.bak")
    assert [str(w.message) for w in warned] == [
        f"{tmp_path / 'runs.csv'}: migrated to this version's columns; added precision,data,run_id,version,"
        f"tensorflow,machine,compute_share,communication_share,input_share,idle_share,time_split (empty in the 1 "
        f"earlier rows); the file as it was is kept as {backup.name}"]
    assert backup.read_bytes() == runs.csv_text(old_columns, [old_row]).encode()
    rows = read(tmp_path / "runs.csv")
    assert list(rows[0]) == runs.RUNS_COLUMNS and len(rows) == 2
    assert {k: rows[0][k] for k in ("model", "images_per_second", "machine")} == {
        "model": "small_cnn", "images_per_second": "5000", "machine": ""}
    assert rows[1]["speedup"] == ""  # the old Single row does not say on which data and machine it ran


def hand_edited_runs_csv(folder, rows=2):
    """A ``runs.csv`` of ``rows`` runs whose header lost the name ``machine`` by hand (its rows untouched); its text."""
    text = runs.csv_text(runs.RUNS_COLUMNS, [run_row("m", "single", 1, 64, 100 + n) for n in range(rows)])
    header, rest = text.split("\n", 1)
    text = header.replace(",machine,", ",") + "\n" + rest
    (folder / "runs.csv").write_text(text)
    return text


def test_a_hand_edited_runs_csv_header_is_refused_naming_the_difference_and_left_alone(tmp_path):
    text = hand_edited_runs_csv(tmp_path)
    with pytest.raises(ValueError) as raised:
        runs.prepare_runs_csv(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / 'runs.csv'}, line 1: expected the header of this version's runs.csv or an older version's, "
        f"whose rows a migration keeps; against this version's, it lacks machine and has no column besides. "
        f"Received: header='{text.splitlines()[0][:100]}...'; restore the header or move the file aside, then run "
        f"again (a missing runs.csv is started anew)")
    with pytest.raises(ValueError, match="it lacks machine and has no column besides"):
        runs.check_runs_csv(tmp_path)
    assert (tmp_path / "runs.csv").read_bytes() == text.encode()  # every row kept, nothing else written
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]


def test_an_older_runs_csv_with_a_row_it_cannot_map_is_refused_not_dropped(tmp_path):
    old_columns = runs.OLDER_RUNS_COLUMNS[-1]
    text = runs.csv_text(old_columns, [dict.fromkeys(old_columns, "1")] * 2)
    text += "1,2,3\n"  # a line cut short by hand
    (tmp_path / "runs.csv").write_text(text)
    with pytest.raises(ValueError) as raised:
        runs.prepare_runs_csv(tmp_path)
    assert str(raised.value).startswith(
        f"{tmp_path / 'runs.csv'}, line 4: expected {len(old_columns)} comma-separated values, as under its header "
        f"(an older version's), to migrate it to this version's columns. Received: 3 values; ")
    assert (tmp_path / "runs.csv").read_bytes() == text.encode()
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]


@pytest.mark.parametrize("old_columns", runs.OLDER_RUNS_COLUMNS, ids=len)
def test_every_older_runs_csv_is_migrated_keeping_every_row_and_a_copy_of_the_file(tmp_path, old_columns):
    text = runs.csv_text(old_columns, [dict.fromkeys(old_columns, str(n)) for n in range(3)]) + "\n"  # a blank line
    (tmp_path / "runs.csv").write_text(text)
    with pytest.warns(UserWarning, match=r"\(empty in the 3 earlier rows\); the file as it was is kept as "
                                         r"runs\.csv\.\d{8}T\d{6}\.bak$"):
        runs.prepare_runs_csv(tmp_path)
    rows = read(tmp_path / "runs.csv")
    assert [[row[column] for column in old_columns] for row in rows] == [[str(n)] * len(old_columns) for n in range(3)]
    assert {row[runs.RUNS_COLUMNS[-1]] for row in rows} == {""}
    (backup,) = tmp_path.glob("runs.csv.*.bak")
    assert backup.read_bytes() == text.encode()


def test_a_line_cut_short_is_skipped_with_a_warning_and_the_row_still_lands(small_cnn, tmp_path, train):
    train(small_cnn(), tmp_path, epochs=1)
    text = (tmp_path / "runs.csv").read_text()
    (tmp_path / "runs.csv").write_text(text[:text.rindex(",", 0, len(text) - 40)])  # no newline at the end
    columns = len(runs.RUNS_COLUMNS)
    with pytest.warns(UserWarning, match=rf"runs.csv, line 2: expected {columns} comma-separated values. Received: "):
        train(small_cnn(), tmp_path, epochs=1)
    lines = list(csv.reader((tmp_path / "runs.csv").read_text().splitlines()))
    assert len(lines) == 3 and len(lines[2]) == columns


@pytest.mark.parametrize("room_checked", [True, False], ids=["room checked first", "h5py failing midway"])
def test_a_disk_that_fills_while_the_weights_are_written_leaves_the_earlier_run_and_logs_this_one_failed(
        small_cnn, tmp_path, train, monkeypatch, room_checked):
    if not room_checked:  # as when another process fills the disk after the check
        monkeypatch.setattr(atomic, "check_room", lambda folder, size: None)
    with tmpfs(tmp_path / "disk", "1m") as results:
        train(small_cnn(), results, epochs=1, save_weights=True)
        (first,) = read(results / "runs.csv")
        weights = results / CSV_NAME.format("single_1dev").replace(".csv", ".weights.h5")
        assert weights.samefile(results / first["epoch_csv"].replace(".csv", ".weights.h5"))  # a link: no space
        before = weights.read_bytes()
        fill(results, leave=64 * 1024)  # room for the epoch CSVs and the log, not for the weights
        with pytest.raises(callbacks.RunNotRecorded) as raised:
            train(small_cnn(seed=1), results, epochs=1, save_weights=True)
        assert str(raised.value) == (
            f"the run trained, but its results could not be written into {results}: No space left on device; "
            f"runs.csv, the weights and the configuration's epoch CSV still hold the runs before it, and "
            f"results.log says this run failed. Received: OSError errno=28")
        assert read(results / "runs.csv") == [first] and weights.read_bytes() == before
        second = [line for line in (results / "results.log").read_text().splitlines()
                  if first["run_id"] not in line]
        assert [line.split()[1] for line in second] == ["start", "machine", "epoch", "failed"]
        assert second[-1].split(" ", 1)[1] == (
            f"failed model=small_cnn strategy=single: RunNotRecorded: the run trained, but its results could not be "
            f"written into {results}: No space left on device; runs.csv, the weights and the configuration's epoch "
            f"CSV still hold the runs before it [run {second[0].rsplit(' ', 1)[1]}")
        assert [path.name for path in results.rglob("*") if ".partial" in path.name] == []


def test_a_row_that_cannot_be_written_logs_the_run_failed_once_without_weights_too(
        small_cnn, tmp_path, train, monkeypatch):
    """Without ``save_weights`` the run's end is written by ``on_train_end``, inside Keras's fit: its failure was
    logged there and again by ``cnnpar.fit`` on the way out, two ``failed`` lines for one run."""
    def full_disk(*args, **kwargs):  # runs.csv's row, as a disk that fills at the end of training refuses it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runs, "append_run", full_disk)
    with pytest.raises(callbacks.RunNotRecorded, match="No space left on device"):
        train(small_cnn(), tmp_path, epochs=1)
    lines = (tmp_path / "results.log").read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["start", "machine", "epoch", "failed"], lines


def test_speedup_is_measured_only_against_a_single_run_of_the_same_data_precision_and_machine(
        small_cnn, tmp_path, train, few_digits):
    x, y = few_digits
    cnnpar.fit(small_cnn(), x[:128], y[:128], batch_size=64, epochs=1, results_dir=tmp_path, verbose=0)  # other data
    train(small_cnn(), tmp_path, epochs=1, precision="mixed_bfloat16")  # the same data, another precision
    train(small_cnn(), tmp_path, epochs=1, strategy="mirrored")
    rows = read(tmp_path / "runs.csv")
    assert rows[-1]["speedup"] == rows[-1]["efficiency"] == ""  # no Single run of these data in float32
    train(small_cnn(), tmp_path, epochs=1)
    train(small_cnn(), tmp_path, epochs=1, strategy="mirrored")
    first, *_, single, mirrored = read(tmp_path / "runs.csv")
    assert float(mirrored["speedup"]) == pytest.approx(
        float(mirrored["images_per_second"]) / float(single["images_per_second"]), abs=1e-3)
    assert first["data"] != single["data"] == mirrored["data"] and single["data"].startswith("256 examples, labels ")
    assert len({row["run_id"] for row in read(tmp_path / "runs.csv")}) == 5
    assert mirrored["machine"] and mirrored["tensorflow"] and mirrored["version"].startswith(cnnpar.__version__)
    log = (tmp_path / "results.log").read_text().splitlines()
    assert all(line.endswith(f" [run {mirrored['run_id']}]") for line in log[-4:])  # start, machine, epoch, end



HOLDER = """
import sys
from pathlib import Path
from keras_cnnpar import runs
path, ready, line = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
with runs.locked(path) as file:
    file.write(line[:len(line) // 2])
    file.flush()
    ready.touch()
    sys.stdin.readline()  # holds the lock mid-line until the test, seeing the append wait, writes a line or closes
    file.write(line[len(line) // 2:] + "\\n")
"""
APPENDERS = {
    "results.log": ("A line written in two halves", lambda folder: runs.append_line(folder / "results.log", "B")),
    "runs.csv": (",".join(runs.RUNS_COLUMNS), lambda folder: runs.append_run(folder, runs.RunInfo(
        "m", "single", 1, 64, 64, 1), [{"epoch": 1, "train_seconds": 1.0, "images_per_second": 64.0}])),
}


@pytest.mark.slow  # the holder is a process of its own
@pytest.mark.parametrize("name", sorted(APPENDERS))
def test_an_append_waits_for_a_writer_that_holds_the_file_mid_line(tmp_path, name):
    """The holder keeps the file locked, half its line written, until the append is seen waiting for the lock."""
    first_line, append = APPENDERS[name]
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / name), str(ready), first_line],
                              stdin=subprocess.PIPE, env=ENV)
    try:
        wait_until(ready.exists, "the holder to lock the file with half its line written", process=holder)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            appended = pool.submit(append, tmp_path)
            wait_until(lambda: appended.done() or os.getpid() in flock_waiters(tmp_path / name),
                       "the append to wait for the lock")
            assert not appended.done(), "the append did not wait for the holder's lock"
            holder.stdin.close()  # the holder completes its line and unlocks
            appended.result(timeout=60)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    lines = (tmp_path / name).read_text().splitlines()
    assert lines[0] == first_line and len(lines) == 2


def test_tensorflows_warning_that_its_own_checkpoint_saver_retraced_is_not_shown(small_cnn, tmp_path):
    """Where the variables live on several tasks (AsyncPS's parameter servers), TensorFlow's saver traces a new
    function on every save and, from the fifth epoch's checkpoint, printed a warning per save that told the user to
    change code that is not theirs. Once a run's checkpoint saves, that warning is dropped; others pass."""
    model = small_cnn()
    model.optimizer.build(model.trainable_variables)
    checkpoints.RunCheckpoint(model, tmp_path / "run", resume=False).save(completed_epochs=1)
    seen, handler, logger = [], logging.Handler(), tf.get_logger()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        for function in ("MultiDeviceSaver.save.<locals>.tf_function_save", "train_step"):
            logger.warning(f"5 out of the last 5 calls to <function {function} at 0x1> triggered tf.function "
                           "retracing.")
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in seen] == [
        "5 out of the last 5 calls to <function train_step at 0x1> triggered tf.function retracing."]


def test_a_runs_images_per_second_leaves_out_the_first_and_the_profiled_epoch_while_another_remains(tmp_path):
    """docs/results.md: the median over the epochs after the first, leaving out the epoch traced for the time split
    (slower under the profiler) when another remains; with none left, the traced epoch's figure."""
    def epochs(*figures):
        return [{"epoch": number, "train_seconds": 1.0, "images_per_second": figure, "time_split": split}
                for number, (figure, split) in enumerate(figures, start=1)]

    info = runs.RunInfo("m", "mirrored", 2, 64, 64, epochs=4, run_id="r")
    row = runs.append_run(tmp_path, info, epochs((10.0, ""), (100.0, ""), (200.0, ""), (90.0, "trace")))
    assert (row["images_per_second"], row["time_split"], row["epochs"]) == (150.0, "trace", 4)
    row = runs.append_run(tmp_path, info, epochs((10.0, ""), (90.0, "trace")))
    assert row["images_per_second"] == 90.0
    assert [r["images_per_second"] for r in read(tmp_path / "runs.csv")] == ["150.0", "90.0"]


def test_a_runs_csv_that_a_spreadsheet_saved_with_a_byte_order_mark_keeps_its_rows(tmp_path):
    text = runs.csv_text(runs.RUNS_COLUMNS, [dict.fromkeys(runs.RUNS_COLUMNS, "1")])
    (tmp_path / "runs.csv").write_bytes(("\ufeff" + text).encode())  # as Excel's "CSV UTF-8" writes it
    runs.check_runs_csv(tmp_path)
    runs.prepare_runs_csv(tmp_path)
    assert (tmp_path / "runs.csv").read_bytes() == ("\ufeff" + text).encode()  # nothing to migrate
    assert [row["timestamp"] for row in runs.read_runs(tmp_path / "runs.csv")] == ["1"]
    assert [row["timestamp"] for row in runs.read_csv(tmp_path / "runs.csv")] == ["1"]


# runs.csv's rows, read back, migrated and refused, without training (the mutation run of results/runs.py)

def epoch_rows(*figures, **last):
    """Epoch rows of a run: one per images/s figure, one second each, ``last``'s columns in the last."""
    rows = [{"epoch": n, "train_seconds": 1.0, "images_per_second": f} for n, f in enumerate(figures, start=1)]
    rows[-1].update(last)
    return rows


def run_info(strategy="single", devices=1, run_id="r1", **provenance):
    provenance = {"precision": "float32", "data": "d", "machine": "m", **provenance}
    return runs.RunInfo("m", strategy, devices, 64, 64, 3, run_id=run_id, **provenance)


def test_a_runs_row_holds_its_last_epochs_figures_its_median_throughput_and_its_speedup_against_single(tmp_path):
    single = runs.append_run(tmp_path, run_info(), epoch_rows(5.0, 350.0, 350.0, loss=0.5, accuracy=0.9))
    timed = [{"epoch": 1, "train_seconds": 1.23456, "images_per_second": 1.0},
             {"epoch": 2, "train_seconds": 2.0, "images_per_second": 100.123},
             {"epoch": 3, "train_seconds": 2.0, "images_per_second": 200.0},
             {"epoch": 4, "train_seconds": 2.0, "images_per_second": 90.0, "loss": 0.25, "val_loss": 0.5,
              "compute_share": 0.123456, "communication_share": math.nan, "time_split": "trace"}]
    mirrored = runs.append_run(tmp_path, run_info("mirrored", 2, "r2"), timed)
    common = {"model": "m", "global_batch": 64, "precision": "float32", "data": "d", "version": "", "tensorflow": "",
              "machine": "m", "val_accuracy": "", **dict.fromkeys(runs.SPLIT_COLUMNS, "")}
    assert {**single, "timestamp": ""} == {
        **common, "timestamp": "", "strategy": "single", "devices": 1, "epochs": 3, "loss": 0.5, "accuracy": 0.9,
        "val_loss": "", "train_seconds": 3.0, "images_per_second": 350.0, "speedup": 1.0, "efficiency": 1.0,
        "run_id": "r1", "epoch_csv": "runs/r1/m_keras_tensorflow_single_1dev.csv"}
    assert {**mirrored, "timestamp": ""} == {
        **common, "timestamp": "", "strategy": "mirrored", "devices": 2, "epochs": 4, "loss": 0.25, "accuracy": "",
        "val_loss": 0.5, "train_seconds": 7.2346, "images_per_second": 150.06, "speedup": 0.4287,
        "efficiency": 0.2144, "compute_share": 0.1235, "time_split": "trace", "run_id": "r2",
        "epoch_csv": "runs/r2/m_keras_tensorflow_mirrored_2dev.csv"}  # the median of 100.123 and 200: 150.06 / 350
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", single["timestamp"])
    text = (tmp_path / "runs.csv").read_bytes().decode()
    assert text == runs.csv_text(runs.RUNS_COLUMNS, [single, mirrored]), text  # one header, a line a run


def test_throughput_speedup_and_efficiency_are_rounded_and_empty_where_unknown():
    assert runs.run_throughput([{"images_per_second": ""}]) == ""  # no epoch timed: no figure
    assert runs.run_throughput(epoch_rows(1.0, 100.0, 100.125, "")) == 100.06  # the median, to 2 places
    assert runs.speedup_and_efficiency("mirrored", 2, "", 100.0) == ("", "")
    assert runs.speedup_and_efficiency("single", 1, "", None) == (1.0, 1.0)
    assert runs.speedup_and_efficiency("mirrored", 3, 100.0, 300.0) == (0.3333, 0.1111)


def test_a_runs_own_files_are_in_its_folder_and_without_an_id_they_are_the_configurations():
    info = run_info(run_id="7")
    assert info.own_file(".weights.h5") == "runs/7/m_keras_tensorflow_single_1dev.weights.h5"
    assert info.weights_files == ["runs/7/m_keras_tensorflow_single_1dev.weights.h5",
                                  "m_keras_tensorflow_single_1dev.weights.h5"]
    assert run_info(run_id="").own_file(".weights.h5") == "m_keras_tensorflow_single_1dev.weights.h5"
    assert re.fullmatch(rf"\d{{8}}T\d{{6}}-{os.getpid()}-[0-9a-f]{{4}}", runs.new_run_id())


def test_a_row_appended_after_a_line_cut_short_starts_a_line_of_its_own_and_the_cut_line_is_named(tmp_path):
    single = runs.csv_text(runs.RUNS_COLUMNS, [runs.append_run(tmp_path, run_info(), epoch_rows(5.0, 300.0))])
    cut = single.splitlines()[1][:30]
    (tmp_path / "runs.csv").write_text(single.replace("\r\n", "\n", 1) + cut + "\n" + single.split("\r\n", 1)[1]
                                       + cut)  # a cut line before the Single row and one at the end, no newline
    before = (tmp_path / "runs.csv").read_bytes().decode()
    with pytest.warns(UserWarning) as warned:
        mirrored = runs.append_run(tmp_path, run_info("mirrored", 2), epoch_rows(5.0, 150.0))
    values = len(next(csv.reader([cut])))
    assert [str(w.message) for w in warned] == [
        f"{tmp_path / 'runs.csv'}, line {n}: expected {len(runs.RUNS_COLUMNS)} comma-separated values. Received: "
        f"{values} values; the line is ignored" for n in (3, 5)]
    assert (mirrored["speedup"], mirrored["efficiency"]) == (0.5, 0.25)  # the Single row after the cut line
    assert (tmp_path / "runs.csv").read_bytes().decode() == before + "\n" + runs.csv_text(
        runs.RUNS_COLUMNS, [mirrored]).split("\r\n", 1)[1]


def test_a_runs_csv_spoilt_during_the_run_is_left_as_it_is_and_the_row_warned_lost_or_refused_with_strict(tmp_path):
    text = "timestamp;model\n2026;m\n"
    (tmp_path / "runs.csv").write_text(text)
    expected = runs._unknown_header(tmp_path / "runs.csv", ["timestamp;model"])
    with pytest.warns(UserWarning) as warned:
        assert runs.append_run(tmp_path, run_info(), epoch_rows(5.0, 300.0)) is None
    assert [str(w.message) for w in warned] == [f"{expected}; this run's row was not recorded there"]
    with pytest.raises(ValueError) as raised:
        runs.append_run(tmp_path, run_info(), epoch_rows(5.0, 300.0), strict=True)
    assert str(raised.value) == expected
    assert (tmp_path / "runs.csv").read_bytes().decode() == text
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]


def test_an_older_runs_csv_met_at_a_runs_end_is_replaced_at_once_by_its_migrated_rows_and_the_run(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr(runs, "datetime", FixedNow)
    old_columns = runs.OLDER_RUNS_COLUMNS[1]  # its rows know their data and machine: a Single baseline
    old = {**dict.fromkeys(old_columns, ""), "model": "m", "strategy": "single", "global_batch": "64",
           "images_per_second": "300", "precision": "float32", "data": "d", "machine": "m"}
    text = runs.csv_text(old_columns, [old]) + "\r\n" + runs.csv_text(old_columns, [old]).split("\r\n", 1)[1]
    (tmp_path / "runs.csv").write_text(text)  # two runs, a blank line between them
    (tmp_path / "runs.csv.20261207T120000.bak").write_text("a copy kept by an earlier migration")
    with pytest.warns(UserWarning) as warned:
        row = runs.append_run(tmp_path, run_info("mirrored", 2), epoch_rows(5.0, 150.0))
    assert [str(w.message) for w in warned] == [
        f"{tmp_path / 'runs.csv'}: migrated to this version's columns; added {','.join(runs.SPLIT_COLUMNS)} (empty "
        f"in the 2 earlier rows); the file as it was is kept as runs.csv.20261207T120000-2.bak"]
    assert (row["speedup"], row["efficiency"]) == (0.5, 0.25)
    assert (tmp_path / "runs.csv").read_bytes().decode() == runs.csv_text(runs.RUNS_COLUMNS, [old, old, row])
    assert (tmp_path / "runs.csv.20261207T120000-2.bak").read_bytes().decode() == text


class FixedNow(datetime.datetime):
    """The clock of a migration's copy, stopped at 2026-12-07 12:00:00."""

    @classmethod
    def now(cls, tz=None):
        return cls(2026, 12, 7, 12)


@pytest.mark.parametrize("header, difference", [
    ([*runs.RUNS_COLUMNS, "model", "data"], "against this version's, it lacks no column and has no column besides, "
                                            "and repeats data,model"),
    (runs.RUNS_COLUMNS[1::-1] + runs.RUNS_COLUMNS[2:], "against this version's, its columns are in another order"),
    ([c for c in runs.RUNS_COLUMNS if c not in ("data", "machine")] + ["host", "set"],
     "against this version's, it lacks data,machine and has host,set besides"),
    (["host", *runs.OLDER_RUNS_COLUMNS[0][1:]], "against an older version's, it lacks timestamp and has host besides"),
], ids=["a column twice", "in another order", "two renamed", "an older header renamed"])
def test_a_runs_csv_header_no_version_wrote_is_refused_naming_how_it_differs_from_the_nearest(tmp_path, header,
                                                                                              difference):
    path = tmp_path / "runs.csv"
    path.write_text(",".join(header) + "\n")
    received = ",".join(header)
    expected = (f"{path}, line 1: expected the header of this version's runs.csv or an older version's, whose rows a "
                f"migration keeps; {difference}. Received: header={received[:100] + '...'!r}; restore the header or "
                f"move the file aside, then run again (a missing runs.csv is started anew)")
    for refuse, kind in ((runs.check_runs_csv, ValueError), (runs.read_runs, runs.ResultsFileError)):
        with pytest.raises(kind) as raised:
            refuse(path if refuse is runs.read_runs else tmp_path)
        assert str(raised.value) == expected


@pytest.mark.parametrize("length", [100, 101])
def test_a_refused_header_is_quoted_whole_up_to_100_characters_then_cut(tmp_path, length):
    header = ("x" * (length - 6)) + ",model"
    (tmp_path / "runs.csv").write_text(header + "\n")
    with pytest.raises(runs.ResultsFileError) as raised:
        runs.read_runs(tmp_path / "runs.csv")
    assert str(raised.value).split("Received: ")[1].startswith(
        f"header={header if length == 100 else header[:100] + '...'!r}; ")


def test_read_runs_takes_an_older_header_leaves_out_a_line_cut_short_naming_it_and_refuses_bytes_not_utf8(tmp_path):
    path = tmp_path / "runs.csv"
    old_columns = runs.OLDER_RUNS_COLUMNS[0]
    path.write_text(runs.csv_text(old_columns, [dict.fromkeys(old_columns, "1")]) + "1,2\r\n"
                    + runs.csv_text(old_columns, [dict.fromkeys(old_columns, "2")]).split("\r\n", 1)[1])
    with pytest.warns(UserWarning) as warned:
        assert runs.read_runs(path) == [dict.fromkeys(old_columns, "1"), dict.fromkeys(old_columns, "2")]
    assert [str(w.message) for w in warned] == [f"{path}, line 3: expected {len(old_columns)} comma-separated "
                                                f"values. Received: 2 values; the line is ignored"]
    path.write_bytes(b"timestamp,model\n\xe9t\xe9,m\n")
    with pytest.raises(runs.ResultsFileError) as raised:
        runs.read_runs(path)
    assert str(raised.value) == f"{path}: expected UTF-8 text. Received: byte 0xe9 at offset 16"
    path.write_text("")
    assert runs.read_runs(path) == [] == runs.read_runs(tmp_path / "none.csv") == runs.read_csv(tmp_path / "none")


def test_the_results_log_gets_whole_lines_appended_in_a_folder_made_for_it(tmp_path):
    log = tmp_path / "new" / "results.log"
    runs.append_line(log, "first")
    runs.append_line(log, "second")
    assert log.read_text() == "first\nsecond\n"


def test_a_results_file_is_made_under_the_umask_as_a_file_not_a_program(tmp_path):
    mask = os.umask(0o022)
    try:
        runs.append_line(tmp_path / "results.log", "a")
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "results.log").st_mode & 0o777 == 0o644


@pytest.mark.parametrize("name", [runs.RUNS_CSV, runs.RESULTS_LOG])
def test_a_results_file_that_is_a_symbolic_link_is_refused_naming_its_target_and_nothing_is_written(tmp_path, name):
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / name).symlink_to(target)
    expected = (f"{tmp_path / 'results' / name} is a symbolic link (to {target}); results files are written in "
                f"place, never through a link: remove the link or choose another results folder. Received: "
                f"{tmp_path / 'results' / name}")
    for write in (lambda: runs.check_runs_csv(tmp_path / "results"),
                  lambda: runs.append_line(tmp_path / "results" / name, "ours")):
        with pytest.raises(ValueError) as raised:
            write()
        assert str(raised.value) == expected
    assert target.read_text() == "theirs\n"


def test_a_results_file_that_is_not_a_regular_file_or_not_writable_is_refused_naming_what_it_is(tmp_path,
                                                                                                 monkeypatch):
    with socket.socket(socket.AF_UNIX) as listening:  # not a FIFO: opening one would wait for a writer
        listening.bind(str(tmp_path / "runs.csv"))
        with pytest.raises(ValueError) as raised:
            runs.check_runs_csv(tmp_path)
    assert str(raised.value) == (f"{tmp_path / 'runs.csv'}: expected a file that this user can read and append to; "
                                 f"it is not a regular file. Received: {tmp_path / 'runs.csv'}")
    (tmp_path / "runs.csv").unlink()
    (tmp_path / "results.log").write_text("")
    (tmp_path / "results.log").chmod(0o444)
    real_access = os.access

    def access(path, mode):  # as this user's permissions say, even for root, who may write anything
        return real_access(path, mode) and not (mode & os.W_OK and not os.stat(path).st_mode & 0o200)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ValueError) as raised:
        runs.check_runs_csv(tmp_path)
    assert str(raised.value) == (f"{tmp_path / 'results.log'}: expected a file that this user can read and append "
                                 f"to; it is not readable and writable by this user. Received: "
                                 f"{tmp_path / 'results.log'}")


def test_csv_text_writes_only_the_columns_of_its_header():
    assert runs.csv_text(["a", "b"], [{"b": 2, "a": 1, "c": 3}]) == "a,b\r\n1,2\r\n"


def test_an_older_runs_csv_is_migrated_whatever_line_breaks_of_unicode_its_values_hold_and_after_a_byte_order_mark(
        tmp_path):
    """Before: a value with a character that ``str.splitlines`` takes for a line's end (a form feed, U+001C, U+0085,
    U+2028), written unquoted by csv, cut its row in two and the file was refused; after a byte-order mark the
    warning named ``timestamp`` among the columns added."""
    old_columns = runs.OLDER_RUNS_COLUMNS[0]
    old = {**dict.fromkeys(old_columns, ""), "model": "m", "epoch_csv": "a\x0cb\x1cc\x85d\u2028e"}
    text = runs.BYTE_ORDER_MARK + runs.csv_text(old_columns, [old, old])
    (tmp_path / "runs.csv").write_bytes(text.encode())
    with pytest.warns(UserWarning) as warned:
        runs.prepare_runs_csv(tmp_path)
    added = [column for column in runs.RUNS_COLUMNS if column not in old_columns]
    assert [str(w.message).split("; ")[1] for w in warned] == [f"added {','.join(added)} (empty in the 2 earlier rows)"]
    assert runs.read_runs(tmp_path / "runs.csv") == [{**dict.fromkeys(runs.RUNS_COLUMNS, ""), **old}] * 2


# Files written all at once (runtime/atomic.py)

def test_a_file_written_at_once_replaces_the_old_whole_under_the_umasks_mode_leaving_no_temporary(tmp_path):
    mask = os.umask(0o027)
    try:
        atomic.write_atomic(tmp_path / "a.csv", "old")
        atomic.write_atomic(tmp_path / "a.csv", b"new \xc3\xa9")
        seen = []
        atomic.write_atomic(tmp_path / "m.weights.h5", None, write=lambda temporary: (
            seen.append(os.path.basename(temporary)), (tmp_path / temporary).write_bytes(b"h5")))
        assert atomic.created_mode() == 0o640 and atomic.created_mode(directory=True) == 0o750 == 0o777 & ~0o027
    finally:
        os.umask(mask)
    assert (tmp_path / "a.csv").read_bytes() == b"new \xc3\xa9" and (tmp_path / "m.weights.h5").read_bytes() == b"h5"
    assert re.fullmatch(r"\.m\.weights\.\w+\.partial\.weights\.h5", seen[0]), seen
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"a.csv": 0o640, "m.weights.h5": 0o640}


def test_a_library_that_writes_a_new_file_in_the_temporarys_place_still_gets_the_umasks_mode(tmp_path):
    def private(temporary):  # as h5py does: its own file, made private
        os.unlink(temporary)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(descriptor, b"lib")
        os.close(descriptor)

    mask = os.umask(0o022)
    try:
        atomic.write_atomic(tmp_path / "w.h5", None, write=private)
    finally:
        os.umask(mask)
    assert ((tmp_path / "w.h5").read_bytes(), (tmp_path / "w.h5").stat().st_mode & 0o777) == (b"lib", 0o644)


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_whether_it_fails_writing_or_renaming(tmp_path):
    atomic.write_atomic(tmp_path / "a.txt", "old")

    def full(temporary):
        (tmp_path / temporary).write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left on device"):
        atomic.write_atomic(tmp_path / "a.txt", None, write=full)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "inside").write_text("kept")
    with pytest.raises(IsADirectoryError):
        atomic.write_atomic(tmp_path / "folder", "a file where a folder is")
    with pytest.raises(TypeError):
        atomic.write_atomic(tmp_path / "a.txt", 7)  # neither text nor bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "folder"]
    assert (tmp_path / "a.txt").read_text() == "old" and (tmp_path / "folder" / "inside").read_text() == "kept"


def test_files_written_together_all_change_or_none_and_no_temporary_is_left(tmp_path):
    atomic.write_together({tmp_path / "a.txt": "old a", tmp_path / "b.txt": b"old b"})

    def refused(temporary):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left on device"):
        atomic.write_together({tmp_path / "a.txt": "new a", tmp_path / "c.txt": "new c", tmp_path / "b.txt": refused})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a.txt": "old a", "b.txt": "old b"}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(IsADirectoryError):  # the second rename fails: the first file has changed, nothing is left
        atomic.write_together({tmp_path / "a.txt": "new a", tmp_path / "d": "a file where a folder is"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "d"]
    atomic.write_together({tmp_path / "a.txt": "new a", tmp_path / "b.txt": lambda t: (tmp_path / t).write_text("b")})
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()} == {"a.txt": "new a", "b.txt": "b"}


def test_a_made_folder_that_a_failed_block_leaves_empty_goes_again_and_only_the_folders_it_made(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(OSError), atomic.made_folder(tmp_path / "old" / "new" / "deeper") as folder:
        assert folder == tmp_path / "old" / "new" / "deeper" and folder.is_dir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and list((tmp_path / "old").iterdir()) == []
    with pytest.raises(KeyboardInterrupt), atomic.made_folder(tmp_path / "old" / "new" / "deeper") as folder:
        (folder.parent / "file").write_text("")  # a file in "new": it stays, with its folder
        raise KeyboardInterrupt
    assert sorted(p.name for p in (tmp_path / "old" / "new").iterdir()) == ["file"]
    with atomic.made_folder(tmp_path / "kept" / "made") as folder:
        pass
    assert folder.is_dir()


def test_a_discarded_temporary_is_emptied_unless_another_name_holds_it(tmp_path):
    temporary = atomic.stage(tmp_path / "a.txt", "content")
    with open(temporary, "rb") as still_open:  # as h5py holds its file after a failed write
        atomic.discard(temporary)
        assert os.fstat(still_open.fileno()).st_size == 0 and not os.path.exists(temporary)
    temporary = atomic.stage(tmp_path / "b.txt", "content")
    os.link(temporary, tmp_path / "linked.txt")
    atomic.discard(temporary)
    atomic.discard(temporary)  # gone already: nothing to do
    assert (tmp_path / "linked.txt").read_text() == "content" and [p.name for p in tmp_path.iterdir()] == [
        "linked.txt"]


def test_the_room_check_refuses_one_byte_more_than_is_free_naming_both(tmp_path, monkeypatch):
    class Stats:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda folder: Stats)
    atomic.check_room(tmp_path, 40960)
    with pytest.raises(OSError) as raised:
        atomic.check_room(tmp_path, 40961)
    assert (raised.value.errno, raised.value.strerror, raised.value.filename) == (
        errno.ENOSPC, "No space left on device: 40960 bytes free, 40961 needed", str(tmp_path))


def test_the_umask_is_read_where_linux_shows_it_else_set_and_restored(monkeypatch):
    mask = os.umask(0o027)
    try:
        with monkeypatch.context() as patched:  # read, not set: a thread creating a file meanwhile keeps its mask
            patched.setattr(os, "umask", lambda mask: pytest.fail("the umask was set to be read"))
            assert atomic.umask() == 0o027
        monkeypatch.setattr(atomic, "Path", lambda path: (_ for _ in ()).throw(OSError(errno.ENOENT, path)))
        assert atomic.umask() == 0o027 and os.umask(0o027) == 0o027  # and left as it was
    finally:
        os.umask(mask)


def test_a_probe_names_the_folder_it_could_not_create_in_a_file_on_the_way_or_a_link_to_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError) as raised:
        atomic.probe_folder(tmp_path / "file" / "sub")
    assert (raised.value.errno, raised.value.strerror, raised.value.filename) == (
        errno.ENOTDIR, "Not a directory", str(tmp_path / "file"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        atomic.probe_folder(tmp_path / "dangling" / "sub")
    with pytest.raises(OSError) as raised:
        atomic.probe_folder("/proc/sys/cnnpar")  # nothing can be created there, even by root
    assert (type(raised.value), raised.value.errno, raised.value.strerror, raised.value.filename) == (
        FileNotFoundError, errno.ENOENT, "No such file or directory", "/proc/sys")  # the folder, not the probe
    atomic.probe_folder(tmp_path / "new" / "deeper")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file"]
