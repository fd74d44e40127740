"""Parallel training strategies; each module registers its string alias.

>>> from keras_cnnpar import strategies
>>> strategies.names()
['async-ps', 'channels', 'hybrid', 'layers', 'mirrored', 'multi-worker', 'single']
"""

from keras_cnnpar.strategies.async_ps import AsyncPS
from keras_cnnpar.strategies.base import (
                                          CheckpointedStrategy,
                                          PeerLost,
                                          Strategy,
                                          accepts,
                                          create,
                                          names,
                                          register,
                                          resolve,
)
from keras_cnnpar.strategies.mirrored import DataParallel
from keras_cnnpar.strategies.multi_worker import MultiWorker, Preempted
from keras_cnnpar.strategies.placement import LayerPlacement
from keras_cnnpar.strategies.single import Single
from keras_cnnpar.strategies.tensor_parallel import ChannelSharded, Hybrid

__all__ = ["AsyncPS", "ChannelSharded", "CheckpointedStrategy", "DataParallel", "Hybrid", "LayerPlacement",
           "MultiWorker", "PeerLost", "Preempted", "Single", "Strategy", "accepts", "create", "names", "register",
           "resolve"]
