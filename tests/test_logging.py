import csv
import re
import statistics

import keras
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar import callbacks

EPOCH_COLUMNS = ["epoch", "accuracy", "devices", "epoch_seconds", "global_batch", "images_per_second", "loss",
                 "strategy", "timestamp", "train_seconds", "val_accuracy", "val_loss"]
CSV_NAME = "small_cnn_keras_tensorflow_{}.csv"


def read(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def train(model, digits, results_dir, strategy="single", **kwargs):
    kwargs = {"epochs": 2, "verbose": 0, **kwargs}
    return model.fit(digits.x[:256], digits.y[:256], batch_size=64, validation_data=(digits.x[256:320],
                     digits.y[256:320]), strategy=strategy, results_dir=results_dir, **kwargs)


def test_epoch_csv_has_one_flushed_row_per_epoch_with_stable_columns(small_cnn, digits, tmp_path):
    train(small_cnn(), digits, tmp_path, strategy=cnnpar.DataParallel(2), epochs=3)
    rows = read(tmp_path / CSV_NAME.format("mirrored_2dev"))
    assert list(rows[0]) == EPOCH_COLUMNS
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert {(r["strategy"], r["devices"], r["global_batch"]) for r in rows} == {("mirrored", "2", "64")}
    for r in rows:
        assert float(r["images_per_second"]) == pytest.approx(256 / float(r["train_seconds"]), rel=1e-3)
        assert 0 < float(r["train_seconds"]) <= float(r["epoch_seconds"])
        assert 0.0 <= float(r["val_accuracy"]) <= 1.0


def test_runs_csv_gets_a_row_per_run_with_speedup_against_single(small_cnn, digits, tmp_path):
    train(small_cnn(), digits, tmp_path, epochs=3)
    train(small_cnn(), digits, tmp_path, strategy="mirrored", epochs=3)
    single, mirrored = read(tmp_path / "runs.csv")
    assert list(single) == callbacks.RUNS_COLUMNS
    assert (single["strategy"], single["speedup"], single["efficiency"]) == ("single", "1.0", "1.0")
    ratio = float(mirrored["images_per_second"]) / float(single["images_per_second"])
    assert float(mirrored["speedup"]) == pytest.approx(ratio, abs=1e-4)
    assert float(mirrored["efficiency"]) == pytest.approx(ratio / 2, abs=1e-4)
    assert mirrored["epoch_csv"] == CSV_NAME.format("mirrored_2dev") and mirrored["epochs"] == "3"
    epochs = read(tmp_path / CSV_NAME.format("single_1dev"))
    after_first = [float(r["images_per_second"]) for r in epochs[1:]]
    assert float(single["images_per_second"]) == pytest.approx(statistics.median(after_first), abs=0.01)


def test_results_log_has_timestamped_start_epoch_and_end_lines(small_cnn, digits, tmp_path):
    train(small_cnn(), digits, tmp_path)
    lines = (tmp_path / "results.log").read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["start", "epoch", "epoch", "end"]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ", line) for line in lines)
    assert "epoch 2/2 loss=" in lines[2]


def test_a_rerun_from_initial_epoch_keeps_earlier_rows_without_duplicates(small_cnn, digits, tmp_path):
    model = small_cnn()
    train(model, digits, tmp_path, epochs=3)
    train(model, digits, tmp_path, epochs=4, initial_epoch=2)
    assert [r["epoch"] for r in read(tmp_path / CSV_NAME.format("single_1dev"))] == ["1", "2", "3", "4"]


def test_results_dir_none_writes_nothing(small_cnn, digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(small_cnn(), digits, None)
    assert list(tmp_path.iterdir()) == []


class Explode(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("boom")


def test_a_failed_run_leaves_no_empty_csv_and_logs_why(small_cnn, digits, tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        train(small_cnn(), digits, tmp_path, callbacks=[Explode()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.log"]
    assert (tmp_path / "results.log").read_text().splitlines()[-1].endswith(
        "failed model=small_cnn strategy=single: RuntimeError: boom")
