"""Every touch of Keras's or TensorFlow's private API: the layer-graph reader, rebuilding a model for a strategy,
gradient accumulation, fused optimizer kernels, precise BatchNormalization statistics.

Only modules of this package read ``_inbound_nodes``, ``_keras_history`` or import ``keras.src``
(``tests/test_architecture.py`` holds that), so a Keras upgrade is mended here.
"""
