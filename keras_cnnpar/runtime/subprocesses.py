"""How the library starts Python in a subprocess (workers, servers, sweeps, export checks).

>>> python_command("-m", "keras_cnnpar.cli", "--help")[1:]
['-P', '-m', 'keras_cnnpar.cli', '--help']
>>> library_command("keras_cnnpar.strategies.async_ps.remote", "FOLDER", "PID")[1:]
['-P', '-m', 'keras_cnnpar.runtime.startup', 'keras_cnnpar.strategies.async_ps.remote', 'FOLDER', 'PID']
"""

import shutil
import sys


def python_command(*args):
    """``[this Python, -P, *args]``: ``-P`` keeps the user's current folder off ``sys.path``, so a ``numpy.py``
    lying there is not imported in place of the real one (Python 3.11 and later)."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), *args]


def library_command(module, *args):
    """The command that runs the library's ``module`` as ``python -m module args`` would, without the libraries
    Keras imports for features it never uses (``startup.quiet_start``): an AsyncPS coordinator."""
    return python_command("-m", "keras_cnnpar.runtime.startup", module, *args)


def dying_with_parent(command):
    """``command`` (an argv list) made to get SIGKILL when the thread that starts it ends, or the process.

    Linux's ``PR_SET_PDEATHSIG`` is set by ``setpriv --pdeathsig`` between
    fork and exec, so no Python code runs in the child of a multi-threaded
    process (which ``preexec_fn`` would do, and Python's documentation warns
    against). A launcher that is killed outright then leaves no child behind.
    Where ``setpriv`` is missing the command is returned as it is.

    >>> dying_with_parent(["python", "job.py"])[-2:]
    ['python', 'job.py']
    """
    if sys.platform.startswith("linux") and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "KILL", "--", *command]
    return list(command)
