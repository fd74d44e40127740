import concurrent.futures
import csv
import errno
import logging
import os
import re
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
