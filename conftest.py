"""Test-wide set-up that must run before TensorFlow starts its runtime.

Four logical CPU devices exist for every test and doctest, so multi-device
strategies (2 replicas, a 2 x 2 mesh) run on a CPU-only machine. Single-device
code uses the first one.
"""

import os
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every process the suite starts inherits this mark; tests/conftest.py fails the session if one outlives it.
os.environ["CNNPAR_TEST_SUITE"] = str(os.getpid())

from keras_cnnpar.runtime import devices

devices.configure(4, kind="CPU")

#: Doctests that start processes of their own, left out of the quick tier (``pytest -m "not slow"``) as the
#: slow tests are.
SLOW_DOCTESTS = ("keras_cnnpar/serving.py", "keras_cnnpar/runtime/startup.py::keras_cnnpar.runtime.startup.exit_now",
                 "keras_cnnpar/runtime/startup.py::keras_cnnpar.runtime.startup.keras_extras_skipped")


#: The test files that take longest, longest first (seconds summed over their tests, AMD EPYC with AVX2 only,
#: 2026-12-05, a slow hour: 574, 328, 312, 265, 246, 211, 206, 196; the next 148). pytest-xdist hands files to its
#: workers in collection order; started first, they no longer run on alone at the end while the other workers
#: wait (alphabetically, the longest file came 26th of 28).
LONGEST_FILES_FIRST = ("tests/test_strategies.py", "tests/test_async_ps.py", "tests/test_multi_worker.py",
                       "tests/test_any_order.py", "tests/test_functional_corpus.py", "tests/test_async_path.py",
                       "tests/test_accuracy.py", "tests/test_tensor_parallel.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.startswith(SLOW_DOCTESTS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_longest_files_first)


def _longest_files_first(item):
    path = item.nodeid.partition("::")[0]
    return LONGEST_FILES_FIRST.index(path) if path in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


@pytest.fixture(autouse=True)
def doctest_folders_in_pytest_s(request, monkeypatch, tmp_path_factory):
    """A doctest's ``tempfile.mkdtemp()`` (an example's folder, as a user writes it) goes to a folder of
    pytest's, which pytest removes in time, not to the machine's temporary folder."""
    if request.node.nodeid.startswith("keras_cnnpar/"):
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("doctest")))
