"""Asynchronous parameter-server training: ``ParameterServerStrategy`` + ``ClusterCoordinator``.

- :mod:`.strategy`: ``AsyncPS``, its cluster connection and its training loop (staleness, the weights' average);
- :mod:`.remote`: the coordinator process that trains while the user's process drives it.

>>> from keras_cnnpar.strategies.async_ps import AsyncPS
>>> AsyncPS(workers=3)
<AsyncPS workers=3 ps=1 cluster=local scale_lr=None>
"""

from keras_cnnpar.strategies.async_ps.strategy import PS_LOSS_SECONDS, AsyncPS, WeightAverage, staleness_power

__all__ = ["PS_LOSS_SECONDS", "AsyncPS", "WeightAverage", "staleness_power"]
