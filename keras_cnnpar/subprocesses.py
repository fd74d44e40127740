"""How the library starts Python in a subprocess (workers, servers, sweeps, export checks).

>>> python_command("-m", "keras_cnnpar.cli", "--help")[1:]
['-P', '-m', 'keras_cnnpar.cli', '--help']
"""

import sys


def python_command(*args):
    """``[this Python, -P, *args]``: ``-P`` keeps the user's current folder off ``sys.path``, so a ``numpy.py``
    lying there is not imported in place of the real one (Python 3.11 and later)."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), *args]
