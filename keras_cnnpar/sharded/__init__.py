"""Sharded layers for tensor parallelism on DTensor meshes (the only DTensor layer code).

The package is ``keras_cnnpar.sharded`` (tensor parallel), so that it cannot be
confused with the ``"layers"`` strategy (layer placement); the old name
``keras_cnnpar.layers`` still works, with a deprecation warning.

>>> from keras_cnnpar import sharded
>>> sharded.SUPPORTED[:3]
('Conv2D', 'Dense', 'BatchNormalization')
"""

from keras_cnnpar.sharded.layers import (
    ChannelShardedConv2D,
    ShardedBatchNormalization,
    ShardedConv2DTranspose,
    ShardedDense,
    ShardedDepthwiseConv2D,
    ShardedNormalization,
)
from keras_cnnpar.sharded.model import SUPPORTED, ShardedModel, ShardedSequential

__all__ = ["SUPPORTED", "ChannelShardedConv2D", "ShardedBatchNormalization", "ShardedConv2DTranspose", "ShardedDense",
           "ShardedDepthwiseConv2D", "ShardedModel", "ShardedNormalization", "ShardedSequential"]
