"""A run held between two epochs, for tests that must act on a run that is still training (off by default).

A test that kills a worker, preempts a run or cuts a link "mid-run" needs the
run to still be training when it acts, on a fast machine too. With
``CNNPAR_HOLD_DIR=FOLDER`` in a run's environment (every process of a cluster
inherits it), a run of ``cnnpar.fit`` that writes results (``results_dir`` set:
not the short fits of the checks and the planner) waits after epoch ``N`` for as
long as the file ``FOLDER/N`` exists: the test creates ``FOLDER/1``, starts the
run, acts once the run's epoch-1 row is written, and deletes the file to let it
go on. A SIGTERM ends the wait too, so a preempted run goes on to its next step
and saves its checkpoint there. The hold comes after the run's logging
callbacks, so the epoch's row is in its CSV while it waits. Without the
variable nothing is added to the run.

>>> HoldBetweenEpochs.from_environment({})
[]
>>> HoldBetweenEpochs.from_environment({"CNNPAR_HOLD_DIR": "/tmp/holds"})
[<HoldBetweenEpochs folder='/tmp/holds'>]
"""

import os
import signal
import threading
from pathlib import Path

import keras

#: The environment variable that names the folder of the hold files.
ENVIRONMENT = "CNNPAR_HOLD_DIR"
#: How often a held run looks for its file.
POLL_SECONDS = 0.05


class HoldBetweenEpochs(keras.callbacks.Callback):
    """After epoch ``N`` (1-based, counted over resumes as the epoch CSV counts), wait while ``folder/N`` exists
    or until this process gets SIGTERM; see the module's docstring.

    Args:
        folder: the folder of the hold files.
    """

    def __init__(self, folder):
        super().__init__()
        self.folder = Path(folder)

    @classmethod
    def from_environment(cls, environ=None):
        """``[HoldBetweenEpochs(folder)]`` when ``CNNPAR_HOLD_DIR`` is set in ``environ`` (default: this
        process's), else ``[]``."""
        folder = (os.environ if environ is None else environ).get(ENVIRONMENT)
        return [cls(folder)] if folder else []

    def on_epoch_end(self, epoch, logs=None):
        held = self.folder / str(epoch + 1)
        if not held.exists():
            return
        terminated = threading.Event()
        previous = signal.getsignal(signal.SIGTERM)
        # Only a handler of Python's own is chained (a preemption handler): SIGTERM's default still ends the process.
        chained = callable(previous) and threading.current_thread() is threading.main_thread()
        if chained:
            def on_sigterm(signum, frame):
                terminated.set()
                previous(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)
        try:
            while held.exists() and not terminated.wait(POLL_SECONDS):
                pass
        finally:
            if chained:
                signal.signal(signal.SIGTERM, previous)

    def __repr__(self):
        return f"<HoldBetweenEpochs folder={str(self.folder)!r}>"
