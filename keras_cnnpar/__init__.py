"""keras_cnnpar: parallel CNN training for Keras 3 on TensorFlow through one argument.

Example:

>>> import keras_cnnpar as cnnpar
>>> cnnpar.devices.configure(2)                # before TensorFlow starts its runtime
['/device:CPU:0', '/device:CPU:1']
>>> model = cnnpar.models.cnn("2+2")
>>> digits = cnnpar.data.load("mnist-5k")
>>> x, y = digits.x[::10], digits.y[::10]            # 500 digits, 50 of each class
>>> before = model.evaluate(x, y, verbose=0)[1]
>>> history = model.fit(x, y, epochs=2, batch_size=50,
...                     strategy=cnnpar.DataParallel(devices=2), results_dir=None, verbose=0)
>>> model.evaluate(x, y, verbose=0)[1] > before + 0.3  # the trained weights are back in `model`
True

Names are imported lazily, so ``import keras_cnnpar`` (and the ``cnnpar`` CLI's
``--help``) does not start TensorFlow.
"""

import importlib
import os
import warnings

from keras_cnnpar import moved
from keras_cnnpar.cluster import environments
from keras_cnnpar.cluster.spec import JOIN_AT_IMPORT
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies import registry

# Before TensorFlow starts: oneDNN's kernels where TensorFlow would leave them off; a warning where it started first.
if _onednn_warning := hardware.onednn_warning(hardware.onednn_at_import()):
    warnings.warn(_onednn_warning, stacklevel=2)

__version__ = "0.1.0"

#: Public names and the module that defines them; the strategy classes come from the registry.
_EXPORTS = {
    "fit": "keras_cnnpar.api",
    "parallel": "keras_cnnpar.api",
    "Strategy": "keras_cnnpar.strategies",
    **{entry.class_name: "keras_cnnpar.strategies" for entry in registry.entries(plugins=False)},
}
#: Public submodules and where they live (``cnnpar.models`` is ``keras_cnnpar.zoo.models``).
_SUBMODULES = {
    "callbacks": "keras_cnnpar.results.callbacks",
    "cluster": "keras_cnnpar.cluster",
    "data": "keras_cnnpar.zoo.data",
    "devices": "keras_cnnpar.runtime.devices",
    "fused": "keras_cnnpar.keras_compat.fused",
    "hardware": "keras_cnnpar.runtime.hardware",
    "models": "keras_cnnpar.zoo.models",
    "runs": "keras_cnnpar.results.runs",
    "serving": "keras_cnnpar.serving",
    "sharded": "keras_cnnpar.strategies.tensor_parallel",
    "strategies": "keras_cnnpar.strategies",
    "training": "keras_cnnpar.api",
}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

moved.install()  # the modules' old paths (`keras_cnnpar.runs`, ...) still import, with a deprecation warning


if os.environ.get(JOIN_AT_IMPORT) == "1" and environments.detect() is not None:
    # A worker started by `cnnpar launch` (or set up so on a host, by srun, by a Job): join before any model exists.
    importlib.import_module("keras_cnnpar.strategies.multi_worker").joined(
        timeout=float(os.environ.get("CNNPAR_COLLECTIVE_TIMEOUT", "60")))


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if moved.new_path(name):
        return importlib.import_module(f"keras_cnnpar.{name}")  # through the old path's warning
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'keras_cnnpar' has no attribute {name!r}")


def __dir__():
    return __all__
