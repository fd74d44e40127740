"""Runs that would lose or corrupt results are refused before they train, in one line; files follow the umask."""

import os
import stat
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar import strategies
from keras_cnnpar.results import checkpoints
from tests.helpers import build_small_cnn
from tests.helpers import run_cli as run


def one_line_refusal(result, exit_code=2):
    """The error line of a CLI ``result`` that exited with ``exit_code``, without a traceback."""
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


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
@pytest.mark.parametrize("place", ["under a file", "in /proc"])
def test_a_folder_that_cannot_be_written_is_refused_before_training(small_csv, tmp_path, option, place):
    """A file where a folder must be, or /proc, where even root creates nothing (``os.access`` says yes)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    blocker, reason = (tmp_path / "a-file", "Not a directory") if place == "under a file" else \
        (Path("/proc"), "No such file or directory")
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
    assert f"cannot write into {folder}: /proc: No such file or directory; nothing was done. Received: {option} " \
           f"{target}" in one_line_refusal(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pair, expected", [
    ("nope=1", "expected NAME=VALUE, NAME one of single's options (steps_per_execution, accumulate). "
               "Received: --option nope=1"),
    ("steps_per_execution", "expected NAME=VALUE, NAME one of single's options (steps_per_execution, accumulate). "
                            "Received: --option steps_per_execution"),
    ("steps_per_execution=0", "steps_per_execution must be a positive int. Received: steps_per_execution=0"),
    ("accumulate='two'", "accumulate must be a positive int. Received: accumulate='two'"),
])
def test_an_option_of_the_strategys_constructor_reaches_it_and_a_bad_one_is_refused(pair, expected, tmp_path):
    result = run("train", "--strategy", "single", "--option", pair, "--results", tmp_path / "r")
    assert expected in one_line_refusal(result)
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
