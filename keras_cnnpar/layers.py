"""Deprecated: the tensor-parallel layers are now :mod:`keras_cnnpar.sharded`."""

import warnings

from keras_cnnpar.sharded import SUPPORTED, ChannelShardedConv2D, ShardedDense, ShardedSequential

__all__ = ["SUPPORTED", "ChannelShardedConv2D", "ShardedDense", "ShardedSequential"]

warnings.warn("keras_cnnpar.layers is now keras_cnnpar.sharded; the old name will go in a later release",
              DeprecationWarning, stacklevel=2)
