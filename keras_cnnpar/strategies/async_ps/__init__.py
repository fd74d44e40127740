"""Asynchronous parameter-server training: ``ParameterServerStrategy`` + ``ClusterCoordinator``.

- :mod:`.strategy`: ``AsyncPS``, the configuration;
- :mod:`.run`: its training in the coordinator process (groups of steps, staleness, the weights' average);
- :mod:`.connection`: that process as the cluster's coordinator, and the local cluster's servers;
- :mod:`.remote`: the coordinator process that trains while the user's process drives it.

>>> from keras_cnnpar.strategies.async_ps import AsyncPS
>>> AsyncPS(workers=3)
<AsyncPS workers=3 ps=1 cluster=local scale_lr=None>
"""

from keras_cnnpar.strategies.async_ps.run import PS_LOSS_SECONDS, WeightAverage, staleness_power
from keras_cnnpar.strategies.async_ps.strategy import AsyncPS

__all__ = ["PS_LOSS_SECONDS", "AsyncPS", "WeightAverage", "staleness_power"]
