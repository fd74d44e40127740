"""Parallel training strategies: one module or package each, found through the registry (:mod:`.registry`).

Every name here is imported when it is first used, so ``import keras_cnnpar`` (and reading the registry) stays
light; the strategy classes load with TensorFlow:

>>> from keras_cnnpar import strategies
>>> strategies.names()
['async-ps', 'channels', 'hybrid', 'layers', 'local-steps', 'mirrored', 'multi-worker', 'single']
>>> strategies.Hybrid
<class 'keras_cnnpar.strategies.tensor_parallel.strategy.Hybrid'>
"""

import importlib

from keras_cnnpar.strategies import registry

#: The contract's names and the module that defines each.
_CONTRACT = {**dict.fromkeys(["CheckpointedStrategy", "PeerLost", "Run", "RunSettings", "Strategy", "accepts",
                              "create", "names", "register", "resolve"], "keras_cnnpar.strategies.base"),
             **dict.fromkeys(["Preempted", "SingleOnChief"], "keras_cnnpar.strategies.multi_worker")}

__all__ = sorted([*_CONTRACT, *(entry.class_name for entry in registry.entries(plugins=False))])


def __getattr__(name):
    if name in _CONTRACT:
        return getattr(importlib.import_module(_CONTRACT[name]), name)
    classes = {entry.class_name: entry for entry in registry.entries(plugins=False)}
    if name in classes:
        return classes[name].load()
    raise AttributeError(f"module 'keras_cnnpar.strategies' has no attribute {name!r}")


def __dir__():
    return __all__
