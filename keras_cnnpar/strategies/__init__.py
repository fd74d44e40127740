"""Parallel training strategies: one module each, found through the registry (``keras_cnnpar.registry``).

A strategy class is imported when it is first used, so ``import keras_cnnpar``
stays light:

>>> from keras_cnnpar import strategies
>>> strategies.names()
['async-ps', 'channels', 'hybrid', 'layers', 'mirrored', 'multi-worker', 'single']
>>> strategies.Hybrid
<class 'keras_cnnpar.strategies.tensor_parallel.Hybrid'>
"""

from keras_cnnpar import registry
from keras_cnnpar.strategies.base import (
    CheckpointedStrategy,
    PeerLost,
    Run,
    RunSettings,
    Strategy,
    accepts,
    create,
    names,
    register,
    resolve,
)
from keras_cnnpar.strategies.multi_worker import Preempted

#: The registered strategy classes by class name (``"DataParallel"``), imported on first use.
CLASSES = {entry.class_name: entry for entry in registry.entries()}

__all__ = ["CheckpointedStrategy", "PeerLost", "Preempted", "Run", "RunSettings", "Strategy", "accepts", "create",
           "names", "register", "resolve"]
__all__ += sorted(CLASSES)


def __getattr__(name):
    if name in CLASSES:
        return CLASSES[name].load()
    raise AttributeError(f"module 'keras_cnnpar.strategies' has no attribute {name!r}")


def __dir__():
    return __all__
