"""Sharded layers for tensor parallelism on DTensor meshes (the only DTensor layer code).

>>> from keras_cnnpar import layers
>>> layers.SUPPORTED[:3]
('Conv2D', 'Dense', 'MaxPooling2D')
"""

from keras_cnnpar.layers.model import SUPPORTED, ShardedSequential
from keras_cnnpar.layers.sharded import ChannelShardedConv2D, ShardedDense

__all__ = ["SUPPORTED", "ChannelShardedConv2D", "ShardedDense", "ShardedSequential"]
