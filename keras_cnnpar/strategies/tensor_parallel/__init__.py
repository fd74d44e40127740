"""Tensor parallel on DTensor meshes: the strategies, the sharded layers and the model rebuilt on a mesh.

- :mod:`.strategy`: ``ChannelSharded`` (channels over devices) and ``Hybrid`` (batch x channels), their run;
- :mod:`.layers`: channel-sharded Conv2D and Dense, and the layers that pass layouts through (the only DTensor
  layer code);
- :mod:`.model`: a Keras CNN rebuilt on a mesh, layer by layer: one entry of ``KINDS`` per layer kind, its
  layout rule beside its converter;
- :mod:`.optimizer`: the Keras optimizer's update on the mesh's DVariables;
- :mod:`.memory`: the memory per device of a channel-sharded model.

The package was ``keras_cnnpar.sharded`` (and before that ``keras_cnnpar.layers``); both old names still import,
with a deprecation warning.

>>> from keras_cnnpar.strategies import tensor_parallel
>>> tensor_parallel.SUPPORTED[:3]
('Conv2D', 'Dense', 'BatchNormalization')
"""

from keras_cnnpar.strategies.tensor_parallel.layers import (
    ChannelShardedConv2D,
    ShardedBatchNormalization,
    ShardedConv2DTranspose,
    ShardedDense,
    ShardedDepthwiseConv2D,
    ShardedNormalization,
)
from keras_cnnpar.strategies.tensor_parallel.model import SUPPORTED, ShardedModel, ShardedSequential

__all__ = ["SUPPORTED", "ChannelShardedConv2D", "ShardedBatchNormalization", "ShardedConv2DTranspose", "ShardedDense",
           "ShardedDepthwiseConv2D", "ShardedModel", "ShardedNormalization", "ShardedSequential"]
