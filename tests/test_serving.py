import csv
import re
import subprocess

import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar import serving
from tests.helpers import kaggle_head, one_line_refusal
from tests.helpers import run_cli as run

pytestmark = pytest.mark.slow  # exports verified in fresh TensorFlow processes: `pytest -m "not slow"` leaves them out

STRATEGIES = {"single": "single", "mirrored": "mirrored",
              "layers": cnnpar.LayerPlacement(2, microbatches=2)}


@pytest.fixture(scope="module")
def trained(digits_split):
    """The 3+3 CNN after one epoch under each landed strategy (the weights are back in the user's model)."""
    train, _ = digits_split
    models = {}
    for name, strategy in STRATEGIES.items():
        model = cnnpar.models.cnn("3+3")
        model.fit(train.x[:1024], train.y[:1024], batch_size=64, verbose=0, strategy=strategy, results_dir=None)
        models[name] = model
    return models


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    base = tmp_path_factory.mktemp("models") / "digits"
    return base, serving.export(trained["single"], base)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_export_after_each_strategy_matches_in_a_fresh_tensorflow_process(trained, strategy, tmp_path):
    model = trained[strategy]
    target = serving.export(model, tmp_path / "digits", verify=False)  # checked here, in one fresh process
    assert target == tmp_path / "digits" / "1"
    assert sorted(p.name for p in (tmp_path / "digits").iterdir()) == ["1"]  # no partial folder left
    for part in ["saved_model.pb", "variables", "assets.extra/tf_serving_warmup_requests"]:
        assert (target / part).exists()
    pixels = serving.sample_pixels()
    served = serving.load_in_fresh_process(target, pixels)
    expected = model.predict(pixels.reshape(-1, 28, 28, 1) / 255.0, verbose=0)
    assert np.max(np.abs(served["probabilities"] - expected)) < 1e-5
    np.testing.assert_array_equal(served["class"], expected.argmax(axis=1))


def test_saved_model_cli_shows_the_signature_and_runs_it(exported, trained, tmp_path):
    _, target = exported
    shown = subprocess.run(["saved_model_cli", "show", "--all", "--dir", str(target)], capture_output=True,
                           text=True, timeout=120).stdout
    signature = shown[shown.index("signature_def['serving_default']"):]
    for line in ["inputs['pixels'] tensor_info:", "outputs['probabilities'] tensor_info:",
                 "outputs['class'] tensor_info:", "shape: (-1, 784)", "shape: (-1, 10)", "shape: (-1)"]:
        assert line in signature
    np.save(tmp_path / "sample.npy", serving.sample_pixels()[:5])
    subprocess.run(["saved_model_cli", "run", "--dir", str(target), "--tag_set", "serve", "--signature_def",
                    "serving_default", "--inputs", f"pixels={tmp_path / 'sample.npy'}", "--outdir",
                    str(tmp_path / "out")], capture_output=True, timeout=120, check=True)
    probabilities = np.load(tmp_path / "out" / "probabilities.npy")
    expected = trained["single"].predict(serving.sample_pixels()[:5].reshape(-1, 28, 28, 1) / 255.0, verbose=0)
    assert probabilities.shape == (5, 10) and np.max(np.abs(probabilities - expected)) < 1e-5
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "class.npy"), expected.argmax(axis=1))


def test_a_second_export_of_a_version_needs_force_and_keeps_the_first(exported, trained):
    base, target = exported
    first = (target / "saved_model.pb").read_bytes()
    with pytest.raises(FileExistsError, match=r"1 already exists; pass force=True \(--force\) to replace it"):
        serving.export(trained["mirrored"], base, version=1)
    assert (target / "saved_model.pb").read_bytes() == first
    assert serving.export(trained["single"], base, version=1, force=True, verify=False) == target
    assert sorted(p.name for p in base.iterdir()) == ["1"]


def test_a_forced_export_that_fails_verification_keeps_the_old_version(trained, tmp_path, monkeypatch):
    base = tmp_path / "digits"
    target = serving.export(trained["single"], base, version=1, verify=False)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    monkeypatch.setattr(serving, "load_in_fresh_process", lambda export_dir, pixels: {
        "probabilities": np.zeros((len(pixels), 10), np.float32), "class": np.zeros(len(pixels), np.int64)})
    with pytest.raises(serving.ExportError):
        serving.export(trained["mirrored"], base, version=1, force=True)
    after = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after == before and len(before) > 2
    assert sorted(p.name for p in base.iterdir()) == ["1"]  # no staging folder left behind


def test_a_mismatching_export_is_removed_and_fails(trained, tmp_path, monkeypatch):
    real = serving.load_in_fresh_process

    def off_by_a_bit(export_dir, pixels):
        outputs = real(export_dir, pixels)
        return {**outputs, "probabilities": outputs["probabilities"] + 1e-3}

    monkeypatch.setattr(serving, "load_in_fresh_process", off_by_a_bit)
    with pytest.raises(serving.ExportError, match=r"differ from the model's by 0.001 \(tolerance 1e-05\); "
                                                  r"nothing was written"):
        serving.export(trained["single"], tmp_path / "digits")
    assert list(tmp_path.iterdir()) == []  # nor the base folder it created


def test_train_export_predict_round_trip_on_the_kaggle_files(kaggle_dir, tmp_path, digits):
    small = kaggle_head(kaggle_dir / "train.csv", 1600, tmp_path / "small.csv")
    result = run("train", "--model", "2+2", "--epochs", 2, "--data", small, "--results", tmp_path / "results",
                 "--export", tmp_path / "models" / "digits", "--verbose", 0)
    assert result.exit_code == 0, result.output
    assert f"exported {tmp_path / 'models' / 'digits' / '1'}" in result.output
    weights = tmp_path / "results" / "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.weights.h5"
    result = run("export", "--weights", weights, "--out", tmp_path / "models" / "digits")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "models" / "digits").iterdir()) == ["1", "2"]
    submission = tmp_path / "submission.csv"
    result = run("predict", "--model-dir", tmp_path / "models" / "digits" / "2", "--test",
                 kaggle_dir / "test.csv", "--out", submission)
    assert result.exit_code == 0, result.output
    with open(submission, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["ImageId", "Label"]
    assert [int(r[0]) for r in rows[1:]] == list(range(1, 1001))
    _, test = cnnpar.data.split(digits, validation_fraction=0.2, seed=0)  # the labels test.csv leaves out
    accuracy = np.mean(np.array([int(r[1]) for r in rows[1:]]) == test.y)
    assert accuracy > 0.8


def test_train_refuses_an_existing_export_version_before_training(exported, tmp_path):
    base, _ = exported
    result = run("train", "--export", base, "--version", 1, "--results", tmp_path / "results")
    assert result.exit_code == 2
    assert f"{base / '1'} already exists; choose another --version, or replace it with `cnnpar export --version 1 " \
           f"--force`" in " ".join(result.output.split())
    assert not (tmp_path / "results").exists()


def test_export_refuses_an_existing_version_in_one_line_before_reading_the_weights(exported, tmp_path):
    base, _ = exported
    result = run("export", "--weights", tmp_path / "absent.weights.h5", "--out", base, "--version", 1)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{base / '1'} already exists; choose another --version, or replace it with `cnnpar export --version 1 " \
           f"--force`. Received: --version 1" in " ".join(result.output.split())


def test_predict_on_bad_input_exits_2_and_writes_nothing(exported, tmp_path):
    _, target = exported
    bad = tmp_path / "test.csv"
    bad.write_text(",".join(f"pixel{i}" for i in range(784)) + "\n" + ",".join(["300"] * 784) + "\n")
    result = run("predict", "--model-dir", target, "--test", bad, "--out", tmp_path / "submission.csv")
    assert result.exit_code == 2
    assert "line 2, column pixel0: expected an integer pixel value in 0..255. Received: 300" in \
        " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.csv"]


def test_export_of_weights_that_do_not_exist_exits_2(tmp_path):
    missing = tmp_path / "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.weights.h5"
    result = run("export", "--weights", missing, "--out", tmp_path / "models")
    assert result.exit_code == 2 and "file not found" in result.output
    assert not (tmp_path / "models").exists()


def test_predict_refuses_to_overwrite_a_file_without_force(exported, tmp_path):
    _, target = exported
    test_csv = tmp_path / "test.csv"
    test_csv.write_text(",".join(f"pixel{i}" for i in range(784)) + "\n" + ",".join(["0"] * 784) + "\n")
    out = tmp_path / "submission.csv"
    out.write_text("mine\n")
    refused = run("predict", "--model-dir", target, "--test", test_csv, "--out", out)
    assert refused.exit_code == 2
    assert f"{out} exists; pass --force to replace it, or choose another path." in " ".join(refused.output.split())
    assert out.read_text() == "mine\n"
    forced = run("predict", "--model-dir", target, "--test", test_csv, "--out", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert out.read_text().splitlines()[0] == "ImageId,Label"


def test_the_librarys_subprocesses_ignore_modules_in_the_current_folder(trained, tmp_path, monkeypatch):
    (tmp_path / "numpy.py").write_text("raise ImportError('numpy.py of the current folder imported')\n")
    monkeypatch.chdir(tmp_path)
    target = serving.export(trained["single"], tmp_path / "digits")  # verified in a fresh `python -P` process
    assert (target / "saved_model.pb").exists()


def test_the_signature_gives_float32_probabilities_and_int64_classes_in_plain_tensorflow(exported):
    """docs/serving.md: input `pixels`, float32 [N, 784]; outputs `probabilities`, float32 [N, 10], and `class`,
    int64 [N] (TF Serving's JSON carries the class as an integer)."""
    _, target = exported
    served = serving.load_in_fresh_process(target, serving.sample_pixels()[:3])
    assert (served["probabilities"].dtype, served["probabilities"].shape) == (np.float32, (3, 10))
    assert (served["class"].dtype, served["class"].shape) == (np.int64, (3,))


@pytest.mark.parametrize("link", [False, True])
def test_predict_refuses_an_output_that_is_its_test_file_and_keeps_it(tmp_path, link):
    test_csv = tmp_path / "test.csv"
    test_csv.write_text(",".join(f"pixel{i}" for i in range(784)) + "\n" + ",".join(["0"] * 784) + "\n")
    before = test_csv.read_text()
    out = tmp_path / "out.csv"
    if link:
        out.symlink_to(test_csv)
    result = run("predict", "--model-dir", tmp_path, "--test", test_csv, "--out", out if link else test_csv, "--force")
    assert one_line_refusal(result) == f"Error: --out is the file that --test reads; choose another path: nothing " \
        f"was written. Received: --out {out if link else test_csv}, --test {test_csv}"
    assert test_csv.read_text() == before


@pytest.fixture
def diverged():
    """The 3+3 CNN whose last Dense kernel holds 100 NaNs, and that kernel's path."""
    model = cnnpar.models.cnn("3+3")
    kernel = model.layers[-1].kernel
    values = kernel.numpy()
    values.flat[:100] = np.nan
    kernel.assign(values)
    return model, kernel.path


def test_export_refuses_weights_that_are_not_finite_and_writes_nothing(diverged, tmp_path):
    model, path = diverged
    weights = serving.save_weights(model, tmp_path / "cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev"
                                                      ".weights.h5")
    result = run("export", "--weights", weights, "--out", tmp_path / "models")
    expected = (f"Error: {weights}: the weight cnn2d_3layer_fullconnected_3layer/dense_N/kernel holds 100 "
                f"non-finite values (NaN or infinity): a damaged file, or a run that diverged. Received: "
                f"weights={weights}")
    assert re.sub(r"dense_\d+", "dense_N", one_line_refusal(result)) == expected  # as the rebuilt model numbers it
    with pytest.raises(ValueError, match=f"^the model's weight {path} holds 100 non-finite values"):
        serving.export(model, tmp_path / "models")
    assert sorted(p.name for p in tmp_path.iterdir()) == [weights.name]


def test_predict_refuses_probabilities_that_are_not_finite_and_writes_nothing(diverged, tmp_path, monkeypatch):
    model, _ = diverged
    monkeypatch.setattr(serving, "_check_finite", lambda model: None)  # an export whose variables were damaged since
    target = serving.export(model, tmp_path / "models", verify=False)
    test_csv = kaggle_head_of_zeros(tmp_path / "test.csv", rows=3)
    result = run("predict", "--model-dir", target, "--test", test_csv, "--out", tmp_path / "submission.csv")
    line = one_line_refusal(result)
    assert line.startswith(f"Error: {target}: its probabilities are not finite (NaN or infinity) for 3 of the 3 rows "
                           f"of {test_csv}, the first at line 2 (ImageId 1): its weights are damaged; nothing was "
                           f"written. Received: [nan"), line
    assert not (tmp_path / "submission.csv").exists()


def kaggle_head_of_zeros(path, rows):
    """An unlabeled Kaggle test CSV of ``rows`` blank images."""
    path.write_text(",".join(f"pixel{i}" for i in range(784)) + "\n" + (",".join(["0"] * 784) + "\n") * rows)
    return path
