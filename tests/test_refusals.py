"""Runs that would lose or corrupt results are refused before they train, in one line; files follow the umask."""

import contextlib
import os
import stat
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar import strategies
from keras_cnnpar.results import checkpoints, runs
from keras_cnnpar.zoo.names import MODEL_NAMES
from tests.helpers import build_small_cnn, fill, one_line_refusal, read_only, read_rows, tmpfs, write_lines
from tests.helpers import run_cli as run


def test_resume_on_a_strategy_that_keeps_no_checkpoint_is_refused_not_ignored(small_csv, tmp_path):
    with pytest.raises(ValueError, match=r"^strategy 'single' takes no resume. Received: resume=True$"):
        strategies.create("single", resume=True)
    assert repr(strategies.create("single", devices=1)) == "<Single devices=1>"  # one device is every strategy's
    result = run("train", "--strategy", "single", "--resume", "--data", small_csv, "--results", tmp_path / "r")
    assert "strategy 'single' takes no resume. Received: resume=True" in one_line_refusal(result)
    assert not (tmp_path / "r").exists()


def test_resume_of_another_configuration_names_the_checkpoint_found_and_the_difference(tmp_path):
    model = build_small_cnn()
    model.optimizer.build(model.trainable_variables)
    found = tmp_path / "small_cnn_keras_tensorflow_async-ps_2dev"
    checkpoints.RunCheckpoint(model, found, resume=False, config={"model": "small_cnn", "devices": 2}).save(1)
    with pytest.raises(ValueError) as raised:
        checkpoints.RunCheckpoint(model, tmp_path / "small_cnn_keras_tensorflow_async-ps_3dev", resume=True,
                                  config={"model": "small_cnn", "devices": 3})
    assert str(raised.value) == (
        f"resume=True, but {tmp_path / 'small_cnn_keras_tensorflow_async-ps_3dev'} holds no checkpoint; {found} "
        f"holds one of another configuration: devices 2 (checkpoint) vs 3 (this run). Resume with that "
        f"checkpoint's settings, or run without resume to start over (that checkpoint is kept). Received: resume=True")
    assert (found / "run.json").exists()  # kept


def test_a_resume_with_nothing_to_resume_says_so_in_one_warning_and_starts_anew(tmp_path):
    model = build_small_cnn()
    model.optimizer.build(model.trainable_variables)
    folder = tmp_path / "checkpoints" / "small_cnn_keras_tensorflow_async-ps_2dev"
    with pytest.warns(UserWarning) as warned:
        fresh = checkpoints.RunCheckpoint(model, folder, resume=True)  # nothing here, nothing beside it
    assert [str(warning.message) for warning in warned] == [
        f"resume=True, but {folder} holds no checkpoint, nor does any folder beside it: there is nothing to resume, "
        f"and the run starts at its first epoch. Received: resume=True"]
    assert fresh.restore() == 0


@pytest.mark.parametrize("strategy, count, smallest", [
    (cnnpar.Single(), 0, 1), (cnnpar.DataParallel(2), 1, 2), (cnnpar.Single(accumulate=2), 1, 2)], ids=repr)
def test_training_data_that_gives_an_epoch_no_step_is_refused_before_training(few_digits, tmp_path, strategy, count,
                                                                               smallest):
    x, y = few_digits
    with pytest.raises(ValueError) as raised:
        cnnpar.fit(build_small_cnn(), x[:count], y[:count], batch_size=64, strategy=strategy, results_dir=tmp_path)
    assert str(raised.value) == (
        f"{count} training example(s) give an epoch no step: {strategy!r} needs at least {smallest} per batch, one "
        f"for each of its pieces (replicas or micro-batches, times accumulate), and leaves a smaller batch out. Give "
        f"at least {smallest} training examples. Received: {count} training examples")
    assert list(tmp_path.iterdir()) == []  # no run recorded


def test_train_on_a_one_row_csv_under_mirrored_is_refused_in_one_line(small_csv, tmp_path):
    one_row = tmp_path / "one.csv"
    one_row.write_text("\n".join(small_csv.read_text().splitlines()[:2]) + "\n")
    result = run("train", "--strategy", "mirrored", "--devices", 2, "--data", one_row, "--results", tmp_path / "r")
    one_line_refusal(result)
    assert [line for line in result.output.splitlines() if not line.startswith("training on ")] == [
        "Error: 1 training example(s) give an epoch no step: <DataParallel devices=2 scale_lr=None> needs at least 2 "
        "per batch, one for each of its pieces (replicas or micro-batches, times accumulate), and leaves a smaller "
        "batch out. Give at least 2 training examples. Received: 1 training examples"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option", ["--results", "--export"])
@pytest.mark.parametrize("place", ["under a file", "in /proc", "through a loop of links"])
def test_a_folder_that_cannot_be_written_is_refused_before_training(small_csv, tmp_path, option, place):
    """A file where a folder must be, /proc, where even root creates nothing (``os.access`` says yes), or a link
    in a loop of links (which does not "exist", so its parent passed the probe and the run failed at its end)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "loopA").symlink_to("loopB")
    (tmp_path / "loopB").symlink_to("loopA")
    blocker, reason = {"under a file": (tmp_path / "a-file", "Not a directory"),
                       "in /proc": (Path("/proc"), "No such file or directory (a folder where no file can be "
                                                   "created)"),
                       "through a loop of links": (tmp_path / "loopA", "Too many levels of symbolic links")}[place]
    target = blocker / "inside"
    results = target if option == "--results" else tmp_path / "results"
    result = run("train", "--data", small_csv, "--epochs", 1, "--results", results,
                 *(["--export", target] if option == "--export" else []))
    assert f"cannot write into {target}: {blocker}: {reason}; nothing was done. Received: {option} {target}" \
        in one_line_refusal(result)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command, option", [
    (["data", "kaggle"], "--out"),
    (["export", "--weights", "w.weights.h5"], "--out"),
    (["predict", "--model-dir", "models/digits/1", "--test", "test.csv"], "--out"),
    (["report"], "--results"),
    (["train", "--strategy", "async-ps"], "--checkpoint-dir"),
])
def test_every_command_probes_its_output_folder_before_any_work(command, option, tmp_path, monkeypatch):
    """/proc, where nothing can be created (root's ``os.access`` says it can): one line, exit 2, before the
    weights are read, the predictions computed or anything trained."""
    monkeypatch.chdir(tmp_path)
    target = "/proc/cnnpar/out.csv" if command[0] == "predict" else "/proc/cnnpar"
    folder = os.path.dirname(target) if command[0] == "predict" else target
    result = run(*command, option, target)
    assert f"cannot write into {folder}: /proc: No such file or directory (a folder where no file can be created); " \
           f"nothing was done. Received: {option} " \
           f"{target}" in one_line_refusal(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pair, expected", [
    ("nope=1", "expected NAME=VALUE, NAME one of single's options (steps_per_execution, accumulate). "
               "Received: --option nope=1"),
    ("steps_per_execution", "expected NAME=VALUE, NAME one of single's options (steps_per_execution, accumulate). "
                            "Received: --option steps_per_execution"),
    ("steps_per_execution=0", "steps_per_execution must be a positive int. Received: steps_per_execution=0"),
    ("steps_per_execution='two'", "steps_per_execution must be a positive int. Received: "
                                  "steps_per_execution='two'"),
    ("accumulate=2", "accumulate has a flag of its own: give it as --accumulate. Received: --option accumulate=2"),
])
def test_an_option_of_the_strategys_constructor_reaches_it_and_a_bad_one_is_refused(pair, expected, tmp_path):
    result = run("train", "--strategy", "single", "--option", pair, "--results", tmp_path / "r")
    assert expected in one_line_refusal(result)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("pairs, expected", [
    (["checkpoint_dir=X"], "checkpoint_dir has a flag of its own: give it as --checkpoint-dir. Received: --option "
                           "checkpoint_dir=X"),  # no flag given: it said "set by its own flag already"
    (["ema_momentum=0.9", "ema_momentum=0.5"], "ema_momentum is given twice; give it once. Received: --option "
                                               "ema_momentum=0.9, --option ema_momentum=0.5"),
])
def test_an_option_with_a_flag_or_given_twice_is_refused_saying_so(pairs, expected, tmp_path):
    options = [word for pair in pairs for word in ("--option", pair)]
    result = run("train", "--strategy", "async-ps", *options, "--results", tmp_path / "r")
    assert one_line_refusal(result) == f"Error: Invalid value for --option: {expected}"
    assert not (tmp_path / "r").exists()


def test_a_results_log_that_is_a_symbolic_link_is_refused_and_its_target_untouched(small_csv, tmp_path):
    target, results = tmp_path / "elsewhere.txt", tmp_path / "results"
    target.write_text("someone else's file\n")
    results.mkdir()
    (results / "results.log").symlink_to(target)
    result = run("train", "--data", small_csv, "--epochs", 1, "--results", results)
    assert (f"{results / 'results.log'} is a symbolic link (to {target}); results files are written in place, never "
            f"through a link") in one_line_refusal(result)
    assert target.read_text() == "someone else's file\n"
    assert sorted(p.name for p in results.iterdir()) == ["results.log"]


@pytest.mark.slow  # an export verified in a fresh process
def test_results_weights_and_exports_are_created_as_the_umask_says(small_csv, tmp_path):
    previous = os.umask(0o027)
    try:
        result = run("train", "--data", small_csv, "--epochs", 1, "--results", tmp_path / "results",
                     "--export", tmp_path / "models" / "digits")
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in tmp_path.rglob("*") if path.parent != tmp_path}
    (run_id,) = os.listdir(tmp_path / "results" / "runs")
    run_files = [f"cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev{suffix}"
                 for suffix in (".csv", ".weights.h5")]
    assert {name: mode for name, mode in modes.items() if name.startswith("results/")} == {
        **{f"results/{name}": 0o640 for name in ("runs.csv", "results.log", *run_files)},
        **{f"results/runs/{run_id}/{name}": 0o640 for name in run_files},
        "results/runs": 0o750, f"results/runs/{run_id}": 0o750}
    exported = {name: mode for name, mode in modes.items() if name.startswith("models/digits/1")}
    assert exported["models/digits/1"] == 0o750 and exported["models/digits/1/saved_model.pb"] == 0o640
    assert set(exported.values()) <= {0o750, 0o640}



@pytest.mark.parametrize("content, message", [
    (b'{"cluster": {"worker": ["localhost:1\xff"]}}',
     "{spec}: expected UTF-8 JSON; byte 0xff at offset 36 is not UTF-8. Received: spec='{spec}'"),
    (b'{"cluster": {}, "pids": {"worker": 5}, "token": "t", "started": {}}',
     "{spec}: field pids.worker: expected a list of process ids; refusing to signal anything. Received: "
     "pids.worker=5"),
], ids=["not utf-8", "pids not a list"])
def test_cluster_stop_refuses_a_bad_spec_naming_the_file_and_the_field(tmp_path, content, message):
    spec = tmp_path / "cluster.json"
    spec.write_bytes(content)
    assert message.format(spec=spec) in one_line_refusal(run("cluster", "stop", "--spec", spec))
    assert spec.read_bytes() == content


def test_train_refuses_a_cluster_spec_that_is_not_utf8(small_csv, tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_bytes(b'{"worker": ["localhost:1"], "ps": ["localhost:2\xff"]}')
    result = run("train", "--strategy", "async-ps", "--cluster", spec, "--data", small_csv, "--results",
                 tmp_path / "results")
    assert f"{spec}: expected UTF-8 JSON; byte 0xff at offset 47 is not UTF-8. Received: cluster='{spec}'" in \
        one_line_refusal(result)


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.logits = keras.layers.Dense(10)

    def call(self, inputs):
        return self.logits(keras.ops.reshape(inputs, (-1, 784)))


def test_a_subclassed_model_is_refused_by_name_before_any_strategy_copies_it(tmp_path):
    """Keras's errors were Single's ``set_weights`` with "a weight list of length 0" and Mirrored's
    ``clone_model`` arguments."""
    model = cnnpar.parallel(Subclassed())
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(TypeError) as raised:
        model.fit(np.zeros((8, 28, 28, 1)), np.zeros(8), strategy="single", results_dir=tmp_path / "r", verbose=0)
    assert str(raised.value) == (
        "every strategy trains a copy of the model rebuilt from its graph of layers (as keras.models.clone_model "
        "does), which a keras.Sequential or a functional model (keras.Model(inputs, outputs)) has and a "
        "subclassed model has not. Received: model of type Subclassed")
    assert not (tmp_path / "r").exists()  # refused before a file was written


@pytest.mark.parametrize("strategy, instead", [
    (cnnpar.DataParallel(2), "give the strategy accumulate=2, which applies the mean gradient of 2 batches at once"),
    (cnnpar.AsyncPS(2), "give a batch_size 2 times as large")], ids=["mirrored", "async-ps"])
def test_kerass_gradient_accumulation_under_tf_distribute_is_refused_saying_what_works(strategy, instead,
                                                                                        few_digits):
    """Keras's own accumulation failed under tf.distribute with a RuntimeError from deep in a ``Cond``."""
    model = build_small_cnn(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(ValueError) as raised:
        model.fit(*few_digits, batch_size=64, strategy=strategy, results_dir=None, verbose=0)
    assert str(raised.value) == (
        f"{type(strategy).__name__} cannot run Keras's gradient_accumulation_steps (it fails under tf.distribute's "
        f"strategies: a merge_call inside a cond); leave it at None and {instead}. "
        "Received: gradient_accumulation_steps=2")


@pytest.mark.parametrize("strategy", [cnnpar.DataParallel(2), cnnpar.AsyncPS(2)], ids=["mirrored", "async-ps"])
def test_kerass_ema_overwrite_frequency_under_tf_distribute_is_refused_saying_what_works(strategy, few_digits):
    """Keras overwrites the weights with their moving averages every ``ema_overwrite_frequency`` steps in a
    ``Cond`` that fails under tf.distribute (a RuntimeError, "merge_call called while defining a new graph");
    ``use_ema`` alone trains, and fit writes the averages at its end."""
    model = build_small_cnn(optimizer=keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=3))
    with pytest.raises(ValueError) as raised:
        model.fit(*few_digits, batch_size=64, strategy=strategy, results_dir=None, verbose=0)
    assert str(raised.value) == (
        f"{type(strategy).__name__} cannot run Keras's ema_overwrite_frequency (it fails under tf.distribute's "
        "strategies: a merge_call inside a cond); leave it at None and let fit write the moving averages into the "
        "weights at its end, as Keras's fit does. Received: ema_overwrite_frequency=3")


# What a careful operator breaks (issue 71): full disks, read-only mounts, and corrupt or foreign inputs.


@pytest.fixture(scope="module")
def weights_3_3(tmp_path_factory):
    """A 3+3 model's ``.weights.h5`` (2 MB), named as `cnnpar train` names it; untrained weights load alike."""
    model = cnnpar.models.build("3+3")
    model.optimizer.build(model.trainable_variables)
    path = tmp_path_factory.mktemp("weights") / runs.run_file_name(MODEL_NAMES["3+3"], "single", 1, ".weights.h5")
    model.save_weights(path)
    return path


@pytest.mark.parametrize("command, option", [
    (["data", "kaggle"], "--out"), (["report"], "--results"), (["export", "--weights", "w.weights.h5"], "--out"),
    (["predict", "--model-dir", "models/digits/1", "--test", "test.csv"], "--out")])
@pytest.mark.parametrize("place", ["under a file", "on a read-only mount"])
def test_an_output_folder_under_a_file_or_on_a_read_only_mount_is_refused_in_one_line(command, option, place,
                                                                                       tmp_path, monkeypatch):
    """Found by the probe before any work (root's ``os.access`` says yes to a read-only mount)."""
    monkeypatch.chdir(tmp_path)
    with contextlib.ExitStack() as stack:
        if place == "under a file":
            (tmp_path / "a-file").write_text("not a folder\n")
            blocker, reason = tmp_path / "a-file", "Not a directory"
            folder = blocker / "out"
        else:
            blocker = folder = stack.enter_context(tmpfs(tmp_path / "disk", "1m")) / "out"
            folder.mkdir()
            (folder / "runs.csv").write_text(",".join(runs.RUNS_COLUMNS) + "\n")
            read_only(folder.parent)
            reason = "Read-only file system"
        value = folder / "submission.csv" if command[0] == "predict" else folder
        assert one_line_refusal(run(*command, option, value), 2) == (
            f"Error: cannot write into {folder}: {blocker}: {reason}; nothing was done. Received: {option} {value}")


def test_data_kaggle_into_a_full_disk_writes_neither_file_so_a_rerun_is_not_refused(tmp_path):
    with tmpfs(tmp_path / "disk", "8m") as disk:  # train.csv (7.3 MB) fits, test.csv (1.8 MB) then does not
        out = disk / "data"
        for _ in range(2):  # the rerun meets the full disk again, not "train.csv exists; pass --force"
            assert one_line_refusal(run("data", "kaggle", "--out", out), 1) == (
                f"Error: could not write into {out}: No space left on device; neither train.csv nor test.csv was "
                f"written. Received: --out {out}")
            assert list(disk.iterdir()) == []  # nor the folder it created


def write_runs(results, lines, runs_csv=None):
    """A results folder of hand-written runs: ``runs.csv`` of ``lines`` (its header first; default: the
    configurations of ``lines`` as this version writes them) and one epoch CSV per configuration."""
    columns = runs.RUNS_COLUMNS
    rows = [dict(zip(columns, [f"t{n}", "m", strategy, devices, "64", "1", "0.5", "0.8", "0.5", "0.8", "1",
                               speed, "", "", runs.run_file_name("m", strategy, devices)]))
            for n, (strategy, devices, speed) in enumerate(lines)]
    for row in rows:
        write_lines(results / row["epoch_csv"], ["epoch,val_accuracy", "1,0.8"])
    text = runs_csv if runs_csv is not None else runs.csv_text(columns, rows)
    (results / runs.RUNS_CSV).write_text(text)
    return results / runs.RUNS_CSV


SUMMARY_FILES = ["accuracy.png", "efficiency.png", "speedup.png", "summary.csv", "summary.md", "throughput.png"]


def test_report_on_a_full_disk_exits_1_in_one_line_and_leaves_every_summary_file_as_it_was(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as results:
        write_runs(results, [("single", "1", "100")])
        assert run("report", "--results", results).exit_code == 0
        before = {name: (results / name).read_bytes() for name in SUMMARY_FILES}
        write_runs(results, [("single", "1", "100"), ("mirrored", "2", "150")])
        fill(results, leave=16 * 1024)  # room for summary.csv and summary.md, not for the plots
        assert one_line_refusal(run("report", "--results", results), 1) == (
            f"Error: could not write into {results}: No space left on device; the summary files are as they were. "
            f"Received: --results {results}")
        assert {name: (results / name).read_bytes() for name in SUMMARY_FILES} == before
        assert [path.name for path in results.iterdir() if ".partial" in path.name] == []


def without_epoch_csv(line):
    """A line of ``runs.csv`` without its value of the column ``epoch_csv``, as a column removed by hand leaves it."""
    values = line.split(",")
    del values[runs.RUNS_COLUMNS.index("epoch_csv")]
    return ",".join(values)


def unknown_header(path, lacks):
    return (f"Error: {path}, line 1: expected the header of this version's runs.csv or an older version's, whose "
            f"rows a migration keeps; against this version's, it lacks {lacks} and has no column besides. ")


@pytest.mark.parametrize("edit, expected", [
    (lambda header, rows: (header.replace(",epoch_csv", ""), [without_epoch_csv(row) for row in rows]),
     lambda path: unknown_header(path, "epoch_csv")),
    (lambda header, rows: (header.replace(",machine", ""), rows),  # a name removed, the values untouched
     lambda path: unknown_header(path, "machine")),
    (lambda header, rows: (header, [rows[0], rows[1].replace(",150,", ",fast,")]),
     lambda path: f"Error: {path}, line 3, column images_per_second: expected a number or nothing. Received: 'fast'"),
], ids=["a column missing", "a name missing from the header", "text in a column of numbers"])
def test_report_refuses_a_runs_csv_it_cannot_read_in_one_line_naming_the_file_line_and_column(tmp_path, edit,
                                                                                               expected):
    """Keras-free: KeyError: 'epoch_csv', columns shifted silently ("machine unknown"), "could not convert string
    to float: 'fast'"."""
    path = write_runs(tmp_path, [("single", "1", "100"), ("mirrored", "2", "150")])
    header, *rows = path.read_text().splitlines()
    header, rows = edit(header, rows)
    write_lines(path, [header, *rows])
    line = one_line_refusal(run("report", "--results", tmp_path), 2)
    assert line.startswith(expected(path)), line
    assert [name for name in SUMMARY_FILES if (tmp_path / name).exists()] == []


@pytest.mark.parametrize("spoil, expected", [
    (lambda path: (path.unlink(), path.mkdir()),
     lambda path: f"Error: {path}: cannot read it: Is a directory; nothing was written. Received: --results "),
    (lambda path: path.write_bytes(path.read_bytes()[:40] + b"\xff" + path.read_bytes()[41:]),
     lambda path: f"Error: {path}: expected UTF-8 text. Received: byte 0xff at offset 40"),
], ids=["a folder in its place", "a byte that is not UTF-8"])
def test_report_refuses_a_runs_csv_that_does_not_read_as_text_in_one_line_and_writes_nothing(tmp_path, spoil,
                                                                                              expected):
    """Before: "could not write into results: Is a directory", and a UnicodeDecodeError's own words."""
    path = write_runs(tmp_path, [("single", "1", "100")])
    spoil(path)
    line = one_line_refusal(run("report", "--results", tmp_path), 2)
    assert line.startswith(expected(path)), line
    assert [name for name in SUMMARY_FILES if (tmp_path / name).exists()] == []


def test_report_leaves_out_a_row_cut_short_with_a_warning_naming_its_line(tmp_path):
    path = write_runs(tmp_path, [("single", "1", "100"), ("mirrored", "2", "150")])
    text = path.read_text()
    path.write_text(text[:text.rindex(",mirrored,2,") + 11])  # the last row cut short, as a full disk leaves it
    with pytest.warns(UserWarning, match=rf"^{path}, line 3: expected {len(runs.RUNS_COLUMNS)} comma-separated "
                                         rf"values. Received: 4 values; the line is ignored$"):
        result = run("report", "--results", tmp_path)
    assert result.exit_code == 0, result.output
    assert [row["strategy"] for row in read_rows(tmp_path / "summary.csv")] == ["single"]


def test_export_into_a_full_disk_exits_1_in_one_line_and_leaves_no_folder(weights_3_3, tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        base = disk / "models" / "digits"
        assert one_line_refusal(run("export", "--weights", weights_3_3, "--out", base), 1) == (
            f"Error: could not write the export {base / '1'}: No space left on device; nothing was left in its "
            f"place. Received: ResourceExhaustedError")
        assert list(disk.iterdir()) == []  # no empty models/ left


def test_train_export_into_a_full_disk_exits_1_in_one_line_and_keeps_the_run_recorded(small_csv, tmp_path):
    results = tmp_path / "results"
    with tmpfs(tmp_path / "disk", "256k") as disk:
        result = run("train", "--model", "3+3", "--epochs", 1, "--data", small_csv, "--results", results,
                     "--export", disk / "models" / "digits", "--verbose", 0)
        weights = results / runs.run_file_name(MODEL_NAMES["3+3"], "single", 1, ".weights.h5")
        assert one_line_refusal(result, 1) == (
            f"Error: the run is recorded in {results} (its weights: {weights}); could not write the export "
            f"{disk / 'models' / 'digits' / '1'}: No space left on device; nothing was left in its place. "
            f"Received: ResourceExhaustedError")
        assert list(disk.iterdir()) == []
    (row,) = read_rows(results / runs.RUNS_CSV)
    assert (results / runs.RESULTS_LOG).read_text().splitlines()[-1].split()[1] == "end"
    assert weights.is_file() and (results / row["epoch_csv"]).with_suffix("").with_suffix(".weights.h5").is_file()


def test_an_export_interrupted_by_ctrl_c_says_that_the_run_is_kept_and_no_export_left(tmp_path, monkeypatch, capsys):
    """`cnnpar train --export` stopped in its export: click's "Aborted!" alone left the run's fate unsaid."""
    from keras_cnnpar import serving
    from keras_cnnpar.cli.serving import export_model

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "export", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_model(None, tmp_path / "models", 1, force=False, recorded=(tmp_path / "results", "w.weights.h5"))
    assert capsys.readouterr().err == (
        f"Error: the run is recorded in {tmp_path / 'results'} (its weights: w.weights.h5); the export was "
        f"interrupted: nothing of it was left in {tmp_path / 'models'}\n")


@pytest.fixture(scope="module")
def foreign_exports(tmp_path_factory):
    """SavedModels that are not `cnnpar export`'s, by folder name: damaged copies of a small one with its signature,
    one without serving_default and one whose serving_default takes something else."""
    import tensorflow as tf

    class Small(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.zeros([784, 10]))

        @tf.function(input_signature=[tf.TensorSpec([None, 784], tf.float32, name="pixels")])
        def serve(self, pixels):
            probabilities = tf.nn.softmax(pixels @ self.w)
            return {"probabilities": probabilities, "class": tf.argmax(probabilities, -1)}

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def other(self, x):
            return {"y": 2 * x}

    folder, small = tmp_path_factory.mktemp("exports"), Small()
    tf.saved_model.save(small, folder / "no serving_default", signatures={"other": small.other})
    tf.saved_model.save(small, folder / "another signature", signatures={"serving_default": small.other})
    for damaged, part in [("saved_model.pb cut short", "saved_model.pb"),
                          ("variables cut short", "variables/variables.data-00000-of-00001")]:
        tf.saved_model.save(small, folder / damaged, signatures={"serving_default": small.serve})
        content = (folder / damaged / part).read_bytes()
        (folder / damaged / part).write_bytes(content[:len(content) // 2])
    return folder


@pytest.mark.parametrize("case, expected", [
    ("saved_model.pb cut short", "expected a SavedModel as `cnnpar export` writes it, which TensorFlow cannot load "
                                 "from there. Received: OSError: Cannot parse file b'{model_dir}/saved_model.pb': "
                                 "Error parsing message with type 'tensorflow.SavedModel': Wire format was corrupt."),
    ("variables cut short", "expected a SavedModel as `cnnpar export` writes it, which TensorFlow cannot load from "
                            "there. Received: IndexError: Read less bytes than requested"),
    ("no serving_default", "expected a SavedModel with the signature serving_default (pixels float32 [N, 784] -> "
                           "probabilities, class). Received: signatures ['other']"),
    ("another signature", "expected its serving_default signature to take pixels float32 [N, 784] -> "
                          "probabilities, class. Received: x float32 [None, 3] -> y"),
], ids=["saved_model.pb cut short", "variables cut short", "no serving_default", "another signature"])
def test_predict_refuses_a_model_dir_that_is_not_an_export_in_one_line(foreign_exports, kaggle_dir, tmp_path, case,
                                                                        expected):
    model_dir = foreign_exports / case
    result = run("predict", "--model-dir", model_dir, "--test", kaggle_dir / "test.csv", "--out",
                 tmp_path / "submission.csv")
    assert one_line_refusal(result, 2) == f"Error: {model_dir}: " + expected.format(model_dir=model_dir)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["cut short", "not HDF5", "another model kind", "named *.h5", "named by the user"])
def test_export_refuses_weights_it_cannot_load_in_one_short_line(weights_3_3, tmp_path, case):
    """Keras's own: "Layer count mismatch ... found 0 saved layers", 41 lines, or 213 with the arrays dumped."""
    content, path, options = weights_3_3.read_bytes(), tmp_path / weights_3_3.name, []
    if case == "cut short":
        path.write_bytes(content[:len(content) // 2])
        expected = (f"expected an HDF5 file of weights, as `cnnpar train` writes them, which h5py cannot read. "
                    f"Received: OSError: Unable to synchronously open file (truncated file: eof = {len(content) // 2}")
    elif case == "not HDF5":
        path.write_text("label,pixel0\n")
        expected = ("expected an HDF5 file of weights, as `cnnpar train` writes them, which h5py cannot read. "
                    "Received: OSError: Unable to synchronously open file (file signature not found)")
    elif case == "another model kind":
        path.write_bytes(content)
        options = ["--model", "2+2"]
        expected = ("these weights are not the 2+2 model's (asked for: --model, or the file name); they are the 3+3 "
                    "model's: give --model 3+3. Received: model=2+2")
    elif case == "named by the user":
        path = tmp_path / "mymodel.weights.h5"
        path.write_bytes(content)
        expected = ("cannot tell the model from the file name (a run's weights start with its model's name); give "
                    f"--model: 2+2, 3+3, resnet, or the .keras file or package.module:function it was trained from. "
                    f"Received: --weights {path}")
    else:
        path = tmp_path / weights_3_3.name.replace(".weights.h5", ".h5")
        path.write_bytes(content)
        expected = (f"expected a file named *.weights.h5, as `cnnpar train` writes them: Keras reads the weights by "
                    f"that suffix (any other .h5 as a Keras 2 model); rename it. Received: weights={path}")
    line = one_line_refusal(run("export", "--weights", path, *options, "--out", tmp_path / "models"), 2)
    assert line.startswith(f"Error: {path}: {expected}"), line
    assert len(line.replace(str(path), "PATH")) < 300 and not (tmp_path / "models").exists()


def test_an_existing_export_version_is_refused_alike_by_export_and_by_train_export(tmp_path):
    (tmp_path / "models" / "1").mkdir(parents=True)
    expected = (f"Error: {tmp_path / 'models' / '1'} already exists; choose another --version, or replace it with "
                f"`cnnpar export --version 1 --force`. Received: --version 1")
    exported = run("export", "--weights", tmp_path / "absent.weights.h5", "--out", tmp_path / "models", "--version", 1)
    trained = run("train", "--export", tmp_path / "models", "--version", 1, "--results", tmp_path / "results")
    assert one_line_refusal(exported, 2) == one_line_refusal(trained, 2) == expected
    assert sorted(path.name for path in tmp_path.iterdir()) == ["models"]


def test_a_runs_csv_edited_during_the_run_fails_it_in_one_line_and_no_weights_disagree(small_csv, tmp_path,
                                                                                        monkeypatch):
    """``runs.append_run`` warned and returned None, the weights took their place without a row, and the run's
    summary raised a TypeError."""
    results, append_run = tmp_path / "results", runs.append_run
    edited = ",".join(runs.RUNS_COLUMNS).replace(",machine,", ",") + "\n"

    def edited_meanwhile(results_dir, *args, **kwargs):
        (results_dir / runs.RUNS_CSV).write_text(edited)  # as a person edits it while the run trains
        return append_run(results_dir, *args, **kwargs)

    monkeypatch.setattr(runs, "append_run", edited_meanwhile)
    result = run("train", "--model", "3+3", "--epochs", 1, "--data", small_csv, "--results", results, "--verbose", 0)
    line = one_line_refusal(result, 1)
    assert line.startswith(f"Error: the run trained, but its row could not be recorded: {results / 'runs.csv'}, "
                           f"line 1: expected the header of this version's runs.csv"), line
    assert line.endswith("; nothing of it was recorded, and results.log says this run failed"), line  # no run before
    assert (results / runs.RUNS_CSV).read_text() == edited
    assert list(results.rglob("*.weights.h5")) == []
    assert (results / runs.RESULTS_LOG).read_text().splitlines()[-1].split()[1] == "failed"


@pytest.mark.parametrize("args, expected", [
    (["train", "--mesh", "3"], "Error: Invalid value for '--mesh': expected DATAxMODEL with two positive ints, "
                               "e.g. 2x2. Received: --mesh 3"),
    (["train", "--strategy", "nope"], "Error: Invalid value for '--strategy': 'nope' is not one of 'async-ps', "),
    (["train", "--epochs", "many"], "Error: Invalid value for '--epochs': 'many' is not a valid integer range."),
    (["--bogus"], "Error: No such option '--bogus'."),
    (["nosuch"], "Error: No such command 'nosuch'.")])
def test_a_usage_error_is_one_line_without_clicks_usage_block(args, expected):
    assert one_line_refusal(run(*args)).startswith(expected)


def test_plan_into_a_full_disk_exits_1_in_one_line_and_writes_neither_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    assert run("plan", "--model", "3+3", "--devices", 1).exit_code == 0  # measured once: the second plan is cached
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill(disk, leave=8192)  # plan.csv (one page) fits, plan.png (tens of kB) does not
        out = disk / "plan"
        assert one_line_refusal(run("plan", "--model", "3+3", "--devices", 1, "--out", out), 1) == (
            f"Error: could not write into {out}: No space left on device; neither plan.csv nor plan.png was "
            f"written. Received: --out {out}")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
