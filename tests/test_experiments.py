"""cnnpar sweep and cnnpar report on a small subset: the files, their columns, resuming, and a recorded failure."""

import csv

import pandas as pd
import pytest
from click.testing import CliRunner

from keras_cnnpar import cli, experiments


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory, digits):
    """200 digits (20 per class) in the Kaggle train.csv format."""
    path = tmp_path_factory.mktemp("data") / "train.csv"
    keep = pd.Series(digits.y).groupby(digits.y).head(20).index
    frame = pd.DataFrame((digits.x[keep].reshape(len(keep), -1) * 255).round().astype(int),
                         columns=[f"pixel{i}" for i in range(784)])
    frame.insert(0, "label", digits.y[keep])
    frame.to_csv(path, index=False)
    return path


def read(path):
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def test_a_small_sweep_writes_every_run_and_report_renders_from_them(small_csv, tmp_path):
    results = tmp_path / "results"
    sweep = ["sweep", "--models", "2+2,3+3", "--strategies", "single,mirrored", "--devices", "1,2",
             "--epochs", "1", "--batch-size", "32", "--data", str(small_csv), "--results", str(results)]
    done = CliRunner().invoke(cli.main, sweep)  # this process plans; every configuration trains in a fresh one
    assert done.exit_code == 0, done.output[-2000:]
    assert "skip single on 2 devices: single runs on 1 device" in done.output
    assert "skip mirrored on 1 devices: mirrored needs at least 2 devices" in done.output
    runs = read(results / "runs.csv")
    assert sorted((r["model"][:17], r["strategy"]) for r in runs) == [
        ("cnn2d_2layer_full", "mirrored"), ("cnn2d_2layer_full", "single"),
        ("cnn2d_3layer_full", "mirrored"), ("cnn2d_3layer_full", "single")]
    epochs = read(results / runs[0]["epoch_csv"])
    assert {"grad_parity_max_abs_diff", "grad_parity_verdict", "shard_overlap", "compute_seconds", "sync_seconds",
            "step_seconds"} <= set(epochs[0])
    assert {r["status"] for r in read(results / "sweep.csv")} == {"done"}

    again = CliRunner().invoke(cli.main, sweep)  # resumes: nothing left to run
    assert again.exit_code == 0
    assert [r["status"] for r in read(results / "sweep.csv")][4:] == ["already complete"] * 4

    report = CliRunner().invoke(cli.main, ["report", "--results", str(results)])
    assert report.exit_code == 0, report.output[-2000:]
    summary = read(results / "summary.csv")
    assert list(summary[0]) == experiments.SUMMARY_COLUMNS
    assert {r["parity"] for r in summary} == {"pass"}
    for row in summary:  # flagged exactly when a multi-device run is below 80% efficiency
        low = row["strategy"] != "single" and float(row["efficiency"]) < 0.8
        assert row["flag"].startswith("efficiency") == low, row
    assert "| model | strategy | devices |" in (results / "summary.md").read_text()
    for plot in ("accuracy.png", "throughput.png", "speedup.png", "efficiency.png"):
        assert (results / plot).stat().st_size > 1000


def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(tmp_path):
    results = tmp_path / "results"
    done = CliRunner().invoke(cli.main, ["sweep", "--models", "2+2", "--strategies", "single", "--devices", "1",
                                         "--data", str(tmp_path / "missing.csv"), "--results", str(results)])
    assert done.exit_code == 1
    [row] = read(results / "sweep.csv")
    assert row["status"] == "failed (2)" and "missing.csv" in row["detail"]
    assert "0 of 1 configurations complete" in done.output


def test_report_without_runs_says_so(tmp_path):
    done = CliRunner().invoke(cli.main, ["report", "--results", str(tmp_path)])
    assert done.exit_code == 1
    assert f"no runs to report: {tmp_path / 'runs.csv'} is missing or empty" in done.output
