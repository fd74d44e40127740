import csv
import re
import subprocess
import sys
import warnings
from pathlib import Path

import click
import keras
import numpy as np
import pytest
import tensorflow as tf
from click.testing import CliRunner

from keras_cnnpar import cli, serving
from keras_cnnpar.cli import training
from keras_cnnpar.plan import experiments
from keras_cnnpar.results import runs
from keras_cnnpar.strategies import registry
from keras_cnnpar.zoo import data
from tests.helpers import (
    BAD_TRAIN_FILES,
    ENV,
    cnnpar_command,
    flock_waiters,
    kaggle_head,
    one_line_refusal,
    processes,
    read_rows,
    tmpfs,
    wait_until,
    write_lines,
)
from tests.helpers import run_cli as run

RUN_NAME = "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev"


def test_data_kaggle_writes_train_and_unlabeled_test(kaggle_dir):
    pixels, labels = data.read_kaggle_csv(kaggle_dir / "train.csv")
    test_pixels, test_labels = data.read_kaggle_csv(kaggle_dir / "test.csv", labeled=False)
    assert (pixels.shape, test_pixels.shape, test_labels) == ((4000, 784), (1000, 784), None)
    assert sorted(set(labels)) == list(range(10))


def test_train_on_a_csv_writes_the_run_files_and_a_summary(kaggle_dir, tmp_path):
    small = kaggle_head(kaggle_dir / "train.csv", 320, tmp_path / "small.csv")
    results = tmp_path / "results"
    result = run("train", "--model", "3+3", "--strategy", "mirrored", "--devices", 2, "--epochs", 2,
                 "--data", small, "--results", results, "--verbose", 2)
    assert result.exit_code == 0, result.output
    assert "Epoch 2/2" in result.output
    summary = result.output[result.output.index("Run summary"):].splitlines()
    assert summary[0] == "Run summary"
    assert [line[2:16].rstrip() for line in summary[1:]] == \
        ["model", "data", "strategy", "global batch", "final", "throughput", "run", "files", ""]
    assert f"  data          {small}: 256 train / 64 validation" in summary
    assert "  strategy      <DataParallel devices=2 scale_lr=None>" in summary
    epoch_csv = results / "cnn2d_3layer_fullconnected_3layer_keras_tensorflow_mirrored_2dev.csv"
    weights = epoch_csv.name.replace(".csv", ".weights.h5")
    assert sorted(p.name for p in results.iterdir()) == \
        sorted([epoch_csv.name, "results.log", "runs", "runs.csv", weights])
    (own_folder,) = (results / "runs").iterdir()  # the run's own copies, named by its id
    assert sorted(p.name for p in own_folder.iterdir()) == sorted([epoch_csv.name, weights])
    assert (own_folder / epoch_csv.name).read_bytes() == epoch_csv.read_bytes()
    with open(epoch_csv, newline="") as file:
        rows = list(csv.DictReader(file))
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[0]["global_batch"] == "64"


@pytest.mark.parametrize("case", sorted(BAD_TRAIN_FILES))
def test_bad_data_exits_2_and_writes_nothing(tmp_path, case):
    lines, message = BAD_TRAIN_FILES[case]
    path = write_lines(tmp_path / "train.csv", lines)
    results = tmp_path / "results"
    results.mkdir()
    earlier = runs.csv_text(runs.RUNS_COLUMNS, [dict.fromkeys(runs.RUNS_COLUMNS, "earlier run")])
    (results / "runs.csv").write_bytes(earlier.encode())
    result = run("train", "--data", path, "--results", results)
    assert result.exit_code == 2
    assert message.format(path=path) in " ".join(result.output.split())
    assert [p.name for p in results.iterdir()] == ["runs.csv"]
    assert (results / "runs.csv").read_bytes() == earlier.encode()


def test_train_refuses_a_hand_edited_runs_csv_header_in_one_line_before_anything_runs(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    earlier = runs.csv_text(runs.RUNS_COLUMNS, [dict.fromkeys(runs.RUNS_COLUMNS, str(n)) for n in range(2)])
    header, rows = earlier.split("\n", 1)
    edited = header.replace(",machine,", ",") + "\n" + rows  # the name removed by hand, the rows untouched
    (results / "runs.csv").write_bytes(edited.encode())
    result = run("train", "--model", "3+3", "--epochs", 1, "--results", results)
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith(f"Error: {results / 'runs.csv'}, line 1: ") and \
        "it lacks machine and has no column besides. Received: header='timestamp,model," in line
    assert (results / "runs.csv").read_bytes() == edited.encode()  # every earlier row kept
    assert [p.name for p in results.iterdir()] == ["runs.csv"]  # nothing trained, nothing written


@pytest.mark.slow
def test_train_on_a_disk_that_fills_exits_1_in_one_line_and_the_folder_still_holds_the_earlier_run(small_csv, tmp_path):
    with tmpfs(tmp_path / "disk", "3m") as results:  # the 3+3's weights (2 MB) fit once
        command = cnnpar_command("train", "--model", "3+3", "--epochs", "1", "--data", small_csv, "--results",
                                 results, "--verbose", "0")
        first = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-2000:]
        (recorded,) = read_rows(results / "runs.csv")
        weights = results / "cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.weights.h5"
        view = weights.with_suffix("").with_suffix(".csv")  # the configuration's epoch CSV: the latest run's
        before, view_before = weights.read_bytes(), view.read_bytes()
        second = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
        assert second.returncode == 1, second.stderr[-2000:]  # not 139 (h5py's SIGSEGV)
        assert "Traceback" not in second.stderr
        assert second.stderr.splitlines()[-1] == (
            f"Error: the run trained, but its results could not be written into {results}: No space left on device; "
            f"runs.csv, the weights and the configuration's epoch CSV still hold the runs before it, and results.log "
            f"says this run failed. Received: OSError errno=28")
        assert read_rows(results / "runs.csv") == [recorded] and weights.read_bytes() == before
        assert view.read_bytes() == view_before  # it described the failed run
        log = (results / "results.log").read_text().splitlines()
        assert [line.split()[1] for line in log if recorded["run_id"] not in line][-1] == "failed"
        assert [path.name for path in results.rglob("*") if ".partial" in path.name] == []


def test_missing_data_file_exits_2(tmp_path):
    result = run("train", "--data", tmp_path / "none.csv", "--results", tmp_path / "results")
    assert result.exit_code == 2 and "none.csv: file not found" in result.output
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("args, message", [
    (["--strategy", "ring"], "'ring' is not one of " + ", ".join(f"'{name}'" for name in registry.names())),
    (["--strategy", "single", "--devices", "2"], "strategy 'single' takes no devices. Received: devices=2"),
    (["--model", "4+4"], "expected 2+2, 3+3, resnet, a .keras file or package.module:function. Received: "
                         "--model 4+4"),
    (["--microbatches", "4"], "strategy 'single' takes no microbatches. Received: microbatches=4"),
])
def test_bad_options_exit_2_with_the_reason(tmp_path, args, message):
    result = run("train", *args, "--results", tmp_path / "results")
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "results").exists()


def commands(group=cli.main, path=()):
    """``(path, command)`` for every visible command below ``group``, groups included."""
    for name, command in sorted(group.commands.items()):
        if command.hidden:
            continue
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def section(text, title):
    """The lines of one section (``Options:``, ``Commands:``) of a ``--help`` text."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


def test_help_lists_every_command_and_option_in_its_sections():
    listed = section(run("--help").output, "Commands:")
    assert [line.split()[0] for line in listed.splitlines() if line.startswith("  ") and not line.startswith("   ")] \
        == sorted(name for name, c in cli.main.commands.items() if not c.hidden)
    for path, command in commands():
        options = section(run(*path, "--help").output, "Options:")
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in options.replace(",", " ").split(), (path, param.opts[0])
    train_help = section(run("train", "--help").output, "Options:")
    said = " ".join(train_help.split()).replace("- ", "-")  # click wraps "local-steps" at its hyphen
    assert all(f"{e.alias}: {e.description}" in said for e in registry.entries())


@pytest.mark.slow  # a fresh Python process
def test_help_does_not_start_tensorflow():
    probe = ("import sys; from keras_cnnpar import cli; from click.testing import CliRunner; "
             "[CliRunner().invoke(cli.main, [*args, '--help']) for args in ([], ['train'], ['sweep'])]; "
             "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


@pytest.mark.parametrize("mesh", ["2", "2x0", "axb", "2x2x2"])
def test_a_malformed_mesh_exits_2_naming_the_expected_form(tmp_path, mesh):
    result = run("train", "--strategy", "hybrid", "--mesh", mesh, "--results", tmp_path / "results")
    assert result.exit_code == 2
    assert f"expected DATAxMODEL with two positive ints, e.g. 2x2. Received: --mesh {mesh}" in \
        " ".join(result.output.split())
    assert not (tmp_path / "results").exists()


def test_a_mesh_is_read_as_data_by_model():
    assert training._mesh("3x1") == (3, 1) and training._mesh("2X4") == (2, 4) and training._mesh(None) is None


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [[], ["--strategy", "async-ps", "--workers", "2"]], ids=["single", "async-ps"])
def test_train_starts_quietly_and_says_which_devices_it_uses(kaggle_dir, tmp_path, strategy):
    """async-ps: its servers and coordinator inherited the level the command set, read it as the user's, and
    printed TensorFlow's 7 start-up lines."""
    small = kaggle_head(kaggle_dir / "train.csv", 160, tmp_path / "small.csv")
    env = {key: value for key, value in ENV.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(cnnpar_command("train", *strategy, "--epochs", "1", "--data", small, "--no-log",
                                           "--verbose", "0"), cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line[:5] in ("E0000", "I0000", "W0000")] == []
    assert "All log messages before absl::InitializeLog" not in result.stderr
    assert re.fullmatch(r"training on /device:(CPU|GPU):0 \((no GPU|1 GPU) found\)", result.stdout.splitlines()[0])


def test_docs_list_exactly_the_options_of_train():
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    table = text.split("## `cnnpar train`", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[a-z-]+)", table))
    options = {param.opts[0] for param in training.train.params if isinstance(param, click.Option)}
    assert documented == options - {"--help"}


def test_data_kaggle_refuses_to_overwrite_without_force(kaggle_dir):
    before = (kaggle_dir / "train.csv").read_bytes()
    refused = run("data", "kaggle", "--out", kaggle_dir, "--seed", 1)
    assert refused.exit_code == 2
    assert f"{kaggle_dir / 'train.csv'} exists; pass --force to replace it" in " ".join(refused.output.split())
    assert (kaggle_dir / "train.csv").read_bytes() == before
    assert run("data", "kaggle", "--out", kaggle_dir, "--force").exit_code == 0  # the same seed: the same files
    assert (kaggle_dir / "train.csv").read_bytes() == before


@pytest.mark.parametrize("args, message", [
    (["train", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295."),
    (["data", "kaggle", "--out", "x", "--seed", "2e3"], "Invalid value for '--seed': '2e3' is not a valid integer"),
])
def test_out_of_range_options_are_usage_errors(tmp_path, args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.slow
def test_two_concurrent_runs_of_one_configuration_each_keep_their_own_files(kaggle_dir, tmp_path):
    """The runs overlap by construction: the test holds the lock of ``results.log`` until both runs wait for it
    to log their start, so neither can end before both have begun."""
    small = kaggle_head(kaggle_dir / "train.csv", 200, tmp_path / "small.csv")
    results = tmp_path / "results"
    command = cnnpar_command("train", "--strategy", "single", "--epochs", "2", "--data", small, "--results", results,
                             "--verbose", "0")
    with processes([command, command], tmp_path, [ENV, ENV]) as started:
        def both_wait():
            assert all(process.poll() is None for process in started), "a run ended before both had begun"
            return {process.pid for process in started} <= flock_waiters(results / runs.RESULTS_LOG)

        with runs.locked(results / runs.RESULTS_LOG):
            wait_until(both_wait, "both runs to wait for the lock of results.log to log their start", timeout=300)
        outputs = [process.communicate(timeout=300)[0] for process in started]
    assert [process.returncode for process in started] == [0, 0], outputs
    lines = (results / "runs.csv").read_text().splitlines()
    assert lines[0].startswith("timestamp,model,") and sum(line.startswith("timestamp,") for line in lines) == 1
    recorded = list(csv.DictReader(lines))
    assert len({row["run_id"] for row in recorded}) == len({row["epoch_csv"] for row in recorded}) == 2
    for row in recorded:  # each row names its own file, which holds that run's two epochs and nothing else
        assert row["epoch_csv"] == f"runs/{row['run_id']}/{RUN_NAME}.csv"
        epochs = list(csv.DictReader((results / row["epoch_csv"]).open()))
        assert [e["epoch"] for e in epochs] == ["1", "2"]
        assert float(row["train_seconds"]) == pytest.approx(sum(float(e["train_seconds"]) for e in epochs), abs=1e-3)
        assert (results / "runs" / row["run_id"] / f"{RUN_NAME}.weights.h5").stat().st_size > 0
    latest = (results / f"{RUN_NAME}.csv").read_bytes()  # the configuration's file: one whole run's copy
    assert latest in [(results / row["epoch_csv"]).read_bytes() for row in recorded]
    assert (results / f"{RUN_NAME}.weights.h5").exists()
    log = (results / "results.log").read_text().splitlines()
    for row in recorded:
        assert [line.split()[1] for line in log if line.endswith(f"[run {row['run_id']}]")] == \
            ["start", "machine", "epoch", "epoch", "end"]
    report = run("report", "--results", results)
    assert report.exit_code == 0, report.output
    header, _, *rows = ([cell.strip() for cell in line.strip("|").split("|")]
                        for line in report.output.splitlines() if line.startswith("|"))
    assert header == experiments.SUMMARY_COLUMNS
    (row,) = (dict(zip(header, cells)) for cells in rows)  # one configuration: its latest run, runs.csv's last row
    last = recorded[-1]
    # Figures of 10 and above print as whole numbers, smaller ones to 3 significant digits.
    assert row == {**row, "model": last["model"], "strategy": "single", "devices": "1",
                   "images_per_second": f"{float(last['images_per_second']):.0f}",
                   "val_accuracy": f"{float(last['val_accuracy']):.3g}", "speedup": "1", "efficiency": "1",
                   "parity": "n/a", "flag": ""}


def test_the_command_line_given_to_each_worker_gives_it_every_parameter_of_the_launchers():
    """`cnnpar train --workers N` starts N workers with its own command line again: flags, off switches and
    repeated options included."""
    given = ["--strategy", "multi-worker", "--workers", "2", "--no-fused-optimizer", "--checks", "--option",
             "compression='bfloat16'", "--option", "powersgd_rank=2", "--epochs", "1", "--results", "somewhere"]
    context = training.train.make_context("train", list(given))
    again = training._command_line(context)
    assert again[0] == "train"
    assert training.train.make_context("train", again[1:]).params == context.params
    assert context.params["fused_optimizer"] is False and context.params["strategy_options"] == (
        "compression='bfloat16'", "powersgd_rank=2")


def test_train_with_auto_and_checks_exits_2_before_anything_runs(tmp_path):
    """docs/cli.md: auto trains the plan's choice, "not with --checks" (its plan checks every configuration)."""
    result = run("train", "--strategy", "auto", "--checks", "--results", tmp_path / "results")
    assert result.exit_code == 2, result.output
    assert "--strategy auto checks the parity of every configuration in its plan; leave --checks out, or name a " \
           "strategy. Received: --checks" in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("name", ["runs.csv", "results.log"])
def test_a_results_file_that_is_a_folder_is_refused_in_one_line_before_training(tmp_path, name):
    (tmp_path / "results" / name).mkdir(parents=True)
    result = run("train", "--epochs", "1", "--results", tmp_path / "results")
    assert one_line_refusal(result) == (f"Error: {tmp_path / 'results' / name}: expected a file that this user can "
                                        f"read and append to; it is a folder. Received: {tmp_path / 'results' / name}")
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [name]


@pytest.mark.parametrize("tf_config", ["not json", '{"cluster": {"worker": ["10.9.9.9:2222", "10.9.9.8:2222"]}, '
                                                   '"task": {"type": "worker", "index": 0}}'])
def test_launch_refuses_a_tf_config_already_set_naming_it_before_any_worker_starts(tf_config, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    result = CliRunner().invoke(cli.main, ["launch", "--workers", "2", "--", "python", str(script)],
                                env={"TF_CONFIG": tf_config})
    line = one_line_refusal(result)
    assert line.startswith("Error: TF_CONFIG is set, and cnnpar launch --workers 2 starts a cluster of its own on "
                           "this machine: unset TF_CONFIG to launch here, or run the script itself on each host of "
                           "TF_CONFIG's cluster with CNNPAR_MULTI_WORKER=1. Received: TF_CONFIG="), line
    assert tf_config[:40] in line
    assert not (tmp_path / "ran").exists()


def small_cnn_for(input_shape, num_classes=10, compiled=True):
    """A small Keras model of its own (not the zoo's), as a user saves one."""
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(num_classes, activation="softmax")],
                             name="users_cnn")
    if compiled:
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("source", ["file", "function"])
def test_train_and_export_take_a_users_keras_file_or_function_the_run_logged_under_its_name_the_export_predicting_as_it(
        source, small_csv, tmp_path):
    if source == "file":
        small_cnn_for((28, 28, 1)).save(given := str(tmp_path / "mine.keras"))
        name = "users_cnn"
    else:
        given, name = "tests.helpers:build_small_cnn", "small_cnn"
    trained = run("train", "--model", given, "--epochs", "1", "--data", small_csv, "--results", tmp_path / "results",
                  "--verbose", "0")
    assert trained.exit_code == 0, trained.output
    assert f"  model         {name} ({given}, " in trained.output
    (row,) = read_rows(tmp_path / "results" / "runs.csv")
    assert row["model"] == name and 0 <= float(row["val_accuracy"]) <= 1
    weights = tmp_path / "results" / f"{name}_keras_tensorflow_single_1dev.weights.h5"
    exports = tmp_path / "exports"
    refused = run("export", "--weights", weights, "--out", exports)  # its name is not a zoo model's
    assert one_line_refusal(refused) == (
        f"Error: {weights}: cannot tell the model from the file name (a run's weights start with its model's name); "
        f"give --model: 2+2, 3+3, resnet, or the .keras file or package.module:function it was trained from. "
        f"Received: --weights {weights}")
    assert not exports.exists()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        exported = run("export", "--weights", weights, "--model", given, "--out", exports)
    assert exported.exit_code == 0, exported.output
    assert exported.stderr == "" and not warned  # nor Keras's warning of a .keras file saved untrained
    pixels = np.asarray(serving.sample_pixels(), np.float32)
    served = tf.saved_model.load(str(exports / "1")).signatures["serving_default"](pixels=tf.constant(pixels))
    expected = serving.load_weights(weights, given).predict(pixels.reshape(-1, 28, 28, 1) / 255.0, verbose=0)
    np.testing.assert_allclose(served["probabilities"].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("model, message", [
    ("missing.keras", "Invalid value for '--model': {tmp}/missing.keras: no such file. Received: --model "
                      "{tmp}/missing.keras"),
    ("not_a_model.keras", "{tmp}/not_a_model.keras: Keras could not load it as a model ("),
    ("rgb.keras", "{tmp}/rgb.keras takes inputs of shape (32, 32, 3), the data's are (28, 28, 1); give data of its "
                  "shape or a model of the data's. Received: --model {tmp}/rgb.keras"),
    ("five.keras", "{tmp}/five.keras gives 5 outputs, the data has 10 classes. Received: --model {tmp}/five.keras"),
    ("uncompiled.keras", "{tmp}/uncompiled.keras gives a model that was not compiled; compile it (optimizer, loss, "
                         "metrics) before saving or returning it."),
    ("os:getcwd", "os:getcwd must return a compiled keras.Model; it returned a str."),
    ("json:dumps", "json:dumps raised TypeError: dumps() missing 1 required positional argument: 'obj'."),
    ("no.such.module:build", "no.such.module:build: ModuleNotFoundError: No module named 'no'."),
])
def test_a_users_model_that_does_not_fit_is_refused_in_one_line_before_training(model, message, small_csv, tmp_path):
    (tmp_path / "not_a_model.keras").write_text("a text file")
    small_cnn_for((32, 32, 3)).save(tmp_path / "rgb.keras")
    small_cnn_for((28, 28, 1), num_classes=5).save(tmp_path / "five.keras")
    small_cnn_for((28, 28, 1), compiled=False).save(tmp_path / "uncompiled.keras")
    given = str(tmp_path / model) if model.endswith(".keras") else model
    result = run("train", "--model", given, "--epochs", "1", "--data", small_csv, "--results", tmp_path / "results")
    assert one_line_refusal(result).startswith("Error: " + message.format(tmp=tmp_path))
    assert not (tmp_path / "results").exists()
