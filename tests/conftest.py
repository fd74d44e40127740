"""Fixtures shared by the test modules; plain helpers live in ``tests/helpers.py``."""

import pytest

from keras_cnnpar.zoo import data
from tests import helpers


@pytest.fixture(scope="session")
def digits():
    return data.load("mnist-5k")


@pytest.fixture(scope="session")
def digits_split(digits):
    return data.split(digits, validation_fraction=0.2, seed=0)


@pytest.fixture(scope="session")
def few_digits(digits):
    """320 class-balanced digits for tests about mechanics: 32 of each class."""
    return helpers.balanced(digits, 320)


@pytest.fixture(scope="session")
def batch(few_digits):
    """One batch: the first 64 of ``few_digits``, for the one-step parity tests."""
    return few_digits[0][:64], few_digits[1][:64]


@pytest.fixture(scope="session")
def few_val_digits(digits):
    """64 class-balanced digits, disjoint from ``few_digits``."""
    return helpers.balanced(digits, 64, offset=7)


@pytest.fixture(scope="session")
def kaggle_dir(tmp_path_factory):
    """The default data as ``cnnpar data kaggle`` writes it: ``train.csv`` (4,000 digits) and ``test.csv`` (1,000,
    unlabeled). Tests that need fewer digits cut them with ``helpers.kaggle_head``."""
    folder = tmp_path_factory.mktemp("kaggle")
    result = helpers.run_cli("data", "kaggle", "--out", folder)
    assert result.exit_code == 0, result.output
    return folder


@pytest.fixture(scope="session")
def small_csv(kaggle_dir, tmp_path_factory):
    """A Kaggle train.csv of 400 digits, so an epoch under 2 workers takes a second or two."""
    return helpers.kaggle_head(kaggle_dir / "train.csv", 400, tmp_path_factory.mktemp("data") / "small.csv")


@pytest.fixture
def small_cnn():
    return helpers.build_small_cnn


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Fail the session if a process that the suite started is still alive at its end (and end it)."""
    yield
    try:
        helpers.wait_until(lambda: not helpers.suite_processes(), "every process the suite started to end", 15)
    except AssertionError:
        left = helpers.suite_processes()
        for pid in left:
            helpers.kill_tree(pid)
        raise AssertionError(f"processes started by the test suite outlived it: {left}") from None
