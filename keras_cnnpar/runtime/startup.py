"""How the library's processes start: TensorFlow without C++ chatter, Keras without the extras they never use.

On a CPU-only machine TensorFlow prints, before its logging is set up and so
whatever ``TF_CPP_MIN_LOG_LEVEL`` says, a oneDNN notice, "Could not find cuda
drivers" and an ``E0000 ... failed call to cuInit`` line that reads like an
error. :func:`quiet_start` imports TensorFlow and finds its devices with the
process's standard error captured, then passes on every line that is not such
chatter. A user who sets ``TF_CPP_MIN_LOG_LEVEL`` sees everything, as usual.

>>> is_chatter("I0000 00:00:1796009160.580327   16641 cudart_stub.cc:31] Could not find cuda drivers")
True
>>> is_chatter("E0000 00:00:1796009163.344704   16641 cuda_platform.cc:52] failed call to cuInit: INTERNAL")
True
>>> is_chatter("Traceback (most recent call last):")
False

Keras imports scikit-learn, pandas, matplotlib and IPython at start-up when
they are installed (mlxtend installs the first two), for features no process
of ours uses; :func:`quiet_start` makes those imports find nothing while TensorFlow
(and with it Keras) is imported, in the processes the library starts and in
the command line, whose reports and plans import matplotlib themselves later.
"""

import atexit
import contextlib
import logging
import os
import re
import runpy
import sys
import tempfile

_CHATTER = re.compile(r"WARNING: All log messages before absl::InitializeLog|[IW]\d{4} |E\d{4} .*failed call to cuInit"
                      r"|To enable the following instructions:")


#: What Keras imports at start-up when it is installed, for features no process of ours uses: its scikit-learn
#: wrappers, pandas DataFrames as fit's input, matplotlib's pyplot for its image gallery, IPython for its file
#: editor's notebook display. Skipping them takes seconds off every process's import of TensorFlow (which imports
#: Keras); the figures: docs/measurements/2026-12-03-zen4.md and docs/measurements/2026-12-05-avx2.md.
KERAS_EXTRAS = ("sklearn", "pandas", "matplotlib", "IPython")


@contextlib.contextmanager
def keras_extras_skipped():
    """Inside, imports of the ``KERAS_EXTRAS`` not imported yet fail, as if they were not installed; after it,
    they import as usual.

    Keras imports each of them inside ``try``/``except ImportError`` and does
    without; so import Keras inside, in a process that never uses those
    features of Keras's. Once Keras is imported it changes nothing, so a
    user's process that imported Keras keeps them all.

    >>> import subprocess, sys
    >>> code = ("import sys\\nfrom keras_cnnpar import startup\\n"
    ...         "with startup.keras_extras_skipped(): import keras\\n"
    ...         "print(sorted(set(startup.KERAS_EXTRAS) & set(sys.modules)))\\n"
    ...         "import matplotlib; print('matplotlib', matplotlib.__name__ in sys.modules)")
    >>> print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip())
    []
    matplotlib True
    """
    skipped = [] if "keras" in sys.modules else [name for name in KERAS_EXTRAS if name not in sys.modules]
    sys.modules.update(dict.fromkeys(skipped))
    try:
        yield
    finally:
        for name in skipped:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def run_module(argv):
    """``python -m keras_cnnpar.runtime.startup MODULE ARGS...``: run ``MODULE`` as ``python -m MODULE ARGS...`` would,
    with :func:`quiet_start` first (the AsyncPS coordinator processes the library starts: a coordinator's
    TensorFlow wrote 90 lines of start-up and server logs into the standard error of a user's script)."""
    module, *args = argv
    quiet_start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def exit_now(code=0):
    """End this process with ``code`` after its exit handlers and with its output flushed, skipping the
    interpreter's teardown of TensorFlow's modules, which costs every process that loaded TensorFlow about a
    CPU-second more (docs/measurements/2026-12-05-avx2.md): every ``cnnpar`` command and coordinator process. For
    a process's last line, once its files are closed: ``atexit`` handlers (temporary folders' finalizers among
    them) and the logging module's shutdown still run.

    >>> import subprocess, sys
    >>> code = "from keras_cnnpar import startup; print('written', end=''); startup.exit_now(3)"
    >>> done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    >>> done.returncode, done.stdout
    (3, 'written')
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a pipe whose reader is gone
            stream.flush()
    os._exit(code)


def is_chatter(line):
    """Whether ``line`` is TensorFlow start-up chatter: info and warning lines, and the CUDA probe's failure."""
    return bool(_CHATTER.match(line))


#: Set beside ``TF_CPP_MIN_LOG_LEVEL`` where :func:`quiet_start` set it, not the user: the processes the library
#: starts inherit it, and filter the chatter as their parent did.
_LEVEL_OURS = "CNNPAR_QUIET_LOG_LEVEL"


def quiet_start(keras=True):
    """Import TensorFlow, with :func:`keras_extras_skipped`, and list its devices without start-up chatter (unless
    ``TF_CPP_MIN_LOG_LEVEL`` is set): a process of the library's own, or the command line's.

    ``keras=False``: without Keras at all, for a process that only runs the
    graphs sent to its TensorFlow server, which then imports TensorFlow
    about a second faster (docs/measurements/2026-12-05-avx2.md).
    """
    if "tensorflow" in sys.modules:
        return
    if not keras:
        sys.modules.setdefault("keras", None)  # TensorFlow imports Keras inside try/except ImportError
    chatter_shown = "TF_CPP_MIN_LOG_LEVEL" in os.environ and os.environ.get(_LEVEL_OURS) != "1"
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:  # later info and warning lines, once logging is set up
        os.environ.update({"TF_CPP_MIN_LOG_LEVEL": "2", _LEVEL_OURS: "1"})  # our processes inherit both
    with keras_extras_skipped(), contextlib.nullcontext() if chatter_shown else _standard_error_filtered():
        import tensorflow as tf

        tf.config.list_physical_devices()  # probes CUDA, which is when the cuInit line comes


@contextlib.contextmanager
def _standard_error_filtered():
    """Capture file descriptor 2 (C++ writes there directly); on leaving, write back the lines that matter."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines() if not is_chatter(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


if __name__ == "__main__":
    run_module(sys.argv[1:])
