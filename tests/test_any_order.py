"""The any-order matrix: a model built and trained first, then fitted under every strategy, in a fresh process;
the strategy object is unchanged by its ``fit``."""

import subprocess
import sys
from pathlib import Path

import pytest

from keras_cnnpar import strategies
from tests.helpers import ENV, cnnpar_command

pytestmark = pytest.mark.slow  # a fresh process per strategy: `pytest -m "not slow"` leaves them out

JOB = Path(__file__).with_name("any_order_job.py")
#: Validation accuracy of the 2+2 after Keras's own epoch and the strategy's two (0.795-0.822 measured under every
#: strategy), which Keras's epoch alone (0.638) is below; and after the last ``single`` epoch (0.860-0.877, each
#: 0.038 or more above the strategy's own figure). Measured once per strategy.
STRATEGY_FLOOR, FINAL_FLOOR = 0.75, 0.84


@pytest.mark.parametrize("alias", strategies.names())
def test_a_model_built_and_trained_first_fits_under_every_strategy_and_then_under_single(alias, tmp_path):
    command = [sys.executable, str(JOB), alias]
    if alias in ("multi-worker", "local-steps"):  # strategies of processes each running the user's script
        command = cnnpar_command("launch", "--workers", "2", "--", *command)
    # A user's script with TensorFlow's log level unset: AsyncPS's coordinator process starts quietly, where its
    # TensorFlow wrote 90 lines of start-up and server logs (ConfigProtos, "Started server") into the user's stderr.
    env = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"} if alias == "async-ps" else ENV
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "grpc_server_lib" not in done.stderr and "device_count {" not in done.stderr, done.stderr[-3000:]
    assert "RuntimeWarning" not in done.stderr, done.stderr[-3000:]  # runpy's: the coordinator's module ran twice
    name, epochs, steps, *accuracies, unchanged = done.stdout.split()[-7:]
    assert (name, epochs) == (alias, "2")  # the callback saw the user's model and its stop ended the run
    assert steps == "16"  # each epoch one pass of the user's 8 batches
    keras_only, trained, final = map(float, accuracies)
    assert keras_only < STRATEGY_FLOOR <= trained  # the strategy's trained weights are in the user's model
    assert final >= FINAL_FLOOR and final > trained  # and the last single fit trained on from them
    assert unchanged == "True"  # fit left the strategy object as it was
