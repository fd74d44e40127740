"""A quiet start of TensorFlow for the command line: no C++ start-up chatter unless the user asks for it.

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
"""

import contextlib
import os
import re
import sys
import tempfile

_CHATTER = re.compile(r"WARNING: All log messages before absl::InitializeLog|[IW]\d{4} |E\d{4} .*failed call to cuInit"
                      r"|To enable the following instructions:")


def is_chatter(line):
    """Whether ``line`` is TensorFlow start-up chatter: info and warning lines, and the CUDA probe's failure."""
    return bool(_CHATTER.match(line))


def quiet_start():
    """Import TensorFlow and list its devices without start-up chatter (unless ``TF_CPP_MIN_LOG_LEVEL`` is set)."""
    if "tensorflow" in sys.modules:
        return
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"  # later info and warning lines, once logging is set up
    with _standard_error_filtered():
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
