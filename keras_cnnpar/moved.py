"""Old import paths of modules that moved into the packages by concern: they still import, with a warning.

``import keras_cnnpar.runs`` (or ``from keras_cnnpar.runs import ...``) gives the module that now lives at
``keras_cnnpar.results.runs``, the same object, after a ``DeprecationWarning`` naming the new path. The old paths
go in a later release.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     import keras_cnnpar.runs as old
>>> from keras_cnnpar.results import runs
>>> old is runs, str(caught[0].message)
(True, 'keras_cnnpar.runs is now keras_cnnpar.results.runs; the old path will go in a later release')
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: Old module path (below ``keras_cnnpar``) -> where the module lives now.
MOVED = {
    "accumulation": "keras_compat.accumulation",
    "arguments": "strategies.arguments",
    "atomic": "runtime.atomic",
    "callbacks": "results.callbacks",
    "checkpoints": "results.checkpoints",
    "checks": "plan.checks",
    "devices": "runtime.devices",
    "data": "zoo.data",
    "experiments": "plan.experiments",
    "fitting": "engine.fitting",
    "fused": "keras_compat.fused",
    "graph": "keras_compat.graph",
    "hardware": "runtime.hardware",
    "layers": "strategies.tensor_parallel",
    "local_workers": "cluster.local_workers",
    "memory": "strategies.memory",
    "models": "zoo.models",
    "network": "cluster.network",
    "planner": "plan.planner",
    "precise_bn": "keras_compat.precise_bn",
    "provenance": "results.provenance",
    "rebuild": "keras_compat.rebuild",
    "registry": "strategies.registry",
    "runs": "results.runs",
    "servers": "cluster.servers",
    "sharded": "strategies.tensor_parallel",
    "sharded.layers": "strategies.tensor_parallel.layers",
    "sharded.model": "strategies.tensor_parallel.model",
    "startup": "runtime.startup",
    "strategies.async_remote": "strategies.async_ps.remote",
    "subprocesses": "runtime.subprocesses",
    "timesplit": "plan.timesplit",
    "training": "api",
    "user_callbacks": "engine.user_callbacks",
}


def new_path(old):
    """The module path that ``keras_cnnpar.<old>`` moved to, or None."""
    return f"keras_cnnpar.{MOVED[old]}" if old in MOVED else None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``keras_cnnpar.<old>`` and puts the moved module in its place in ``sys.modules``."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("keras_cnnpar.")
        if fullname == old or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return types.ModuleType(spec.name)  # a stand-in: exec_module replaces it in sys.modules

    def exec_module(self, module):
        old = module.__name__.removeprefix("keras_cnnpar.")
        warnings.warn(f"{module.__name__} is now {new_path(old)}; the old path will go in a later release",
                      DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new_path(old))


def install():
    """Let the old paths import; once per process. The finder goes first: Python's own would find
    ``keras_cnnpar.sharded.layers`` in the moved package's folder and load a second copy of the module under
    the old name (its classes then unlike the real ones)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
