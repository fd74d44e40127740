"""keras_cnnpar: parallel CNN training for Keras 3 on TensorFlow through one argument.

Example:

>>> import keras_cnnpar as cnnpar
>>> cnnpar.devices.configure(2)                # before TensorFlow starts its runtime
['/device:CPU:0', '/device:CPU:1']
>>> model = cnnpar.models.cnn("2+2")
>>> digits = cnnpar.data.load("mnist-5k")
>>> history = model.fit(digits.x[:256], digits.y[:256], epochs=1, batch_size=64,
...                     strategy=cnnpar.DataParallel(devices=2), results_dir=None, verbose=0)
>>> model.evaluate(digits.x[:256], digits.y[:256], verbose=0)[1] > 0.1  # the trained weights are back
True

Names are imported lazily, so ``import keras_cnnpar`` (and the ``cnnpar`` CLI's
``--help``) does not start TensorFlow.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "fit": "keras_cnnpar.training",
    "parallel": "keras_cnnpar.models",
    "Strategy": "keras_cnnpar.strategies",
    "Single": "keras_cnnpar.strategies",
    "DataParallel": "keras_cnnpar.strategies",
    "LayerPlacement": "keras_cnnpar.strategies",
    "MultiWorker": "keras_cnnpar.strategies",
    "AsyncPS": "keras_cnnpar.strategies",
    "ChannelSharded": "keras_cnnpar.strategies",
    "Hybrid": "keras_cnnpar.strategies",
}
_SUBMODULES = ("callbacks", "cluster", "data", "devices", "layers", "models", "serving", "strategies", "training")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_cnnpar.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'keras_cnnpar' has no attribute {name!r}")


def __dir__():
    return __all__
