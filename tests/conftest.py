"""Fixtures shared by the test modules; plain helpers live in ``tests/helpers.py``."""

import time

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
def small_csv(tmp_path_factory):
    """A Kaggle train.csv of 400 digits, so an epoch under 2 workers takes a second or two."""
    folder = tmp_path_factory.mktemp("data")
    train_path, _ = data.write_kaggle(folder, test_fraction=0.2, seed=0)
    return helpers.write_lines(folder / "small.csv", train_path.read_text().splitlines()[:401])


@pytest.fixture
def small_cnn():
    return helpers.build_small_cnn


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Fail the session if a process that the suite started is still alive at its end (and end it)."""
    yield
    deadline = time.monotonic() + 15
    while (left := helpers.suite_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        helpers.kill_tree(pid)
    assert not left, f"processes started by the test suite outlived it: {left}"
