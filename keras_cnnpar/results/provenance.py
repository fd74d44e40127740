"""What produced a result: this package's version (and git commit), TensorFlow's version, the machine.

Every row of ``runs.csv`` records them, so a table that mixes machines or code
versions can say so (``cnnpar report``), and a speedup is only ever measured
against a Single run of the same machine.

>>> version().startswith("0.")
True
"""

import functools
import subprocess
from pathlib import Path

#: The ``keras_cnnpar`` package folder; its parent is the checkout's root when it runs from one.
PACKAGE = Path(__file__).parents[1]


@functools.cache
def version():
    r"""``"0.1.0"``, with ``+g<commit>`` when the package runs from a git checkout (``.dirty`` with changes).

    >>> import re, shutil, keras_cnnpar
    >>> root = Path(keras_cnnpar.__file__).parents[1]
    >>> from_checkout = (root / ".git").exists() and shutil.which("git") is not None
    >>> bool(re.fullmatch(r"\d+\.\d+\.\d+\+g[0-9a-f]+(\.dirty)?", version())) == from_checkout
    True
    """
    from keras_cnnpar import __version__

    if not (PACKAGE.parent / ".git").exists():
        return __version__
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", str(PACKAGE))
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+g{commit}" + (".dirty" if dirty else "") if commit else __version__


def _git(*args):
    done = subprocess.run(["git", "-C", str(PACKAGE.parent), *args], capture_output=True, text=True, timeout=10)
    return done.stdout.strip() if done.returncode == 0 else ""


def tensorflow_version():
    """TensorFlow's version (this starts TensorFlow)."""
    import tensorflow as tf

    return tf.__version__


def machine():
    """The machine in a few words: its GPUs' names where it has GPUs, else its CPU model."""
    from keras_cnnpar.runtime import hardware

    return ", ".join(hardware.gpu_names()) or hardware.cpu().model
