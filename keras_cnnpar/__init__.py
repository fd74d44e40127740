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

from keras_cnnpar import hardware, registry
from keras_cnnpar.cluster import JOIN_AT_IMPORT, cluster_in_environment

# Before TensorFlow starts: oneDNN's kernels where TensorFlow would leave them off; a warning where it started first.
if _onednn_warning := hardware.onednn_warning(hardware.onednn_at_import()):
    warnings.warn(_onednn_warning, stacklevel=2)

__version__ = "0.1.0"

#: Public names and the module that defines them; the strategy classes come from the registry.
_EXPORTS = {
    "fit": "keras_cnnpar.training",
    "parallel": "keras_cnnpar.training",
    "Strategy": "keras_cnnpar.strategies",
    **{entry.class_name: "keras_cnnpar.strategies" for entry in registry.entries()},
}
_SUBMODULES = ("callbacks", "cluster", "data", "devices", "fused", "hardware", "models", "runs", "serving",
               "sharded", "strategies", "training")
#: Old names of submodules, still importable with a deprecation warning.
_DEPRECATED = ("layers",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


if os.environ.get(JOIN_AT_IMPORT) == "1" and cluster_in_environment():
    # A worker started by `cnnpar launch` (or set up so on a host, or by srun): join before any model exists.
    importlib.import_module("keras_cnnpar.strategies.multi_worker").joined(
        timeout=float(os.environ.get("CNNPAR_COLLECTIVE_TIMEOUT", "60")))


def __getattr__(name):
    if name in _SUBMODULES or name in _DEPRECATED:
        return importlib.import_module(f"keras_cnnpar.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'keras_cnnpar' has no attribute {name!r}")


def __dir__():
    return __all__
