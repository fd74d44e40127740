"""Precise BatchNormalization statistics: the moving mean and variance recomputed from the current weights.

A BatchNormalization layer's moving statistics are an exponential average of
the batch statistics of past steps, each computed with that step's weights.
Under asynchronous training those weights are stale versions, from several
workers, so the averages describe none of them, and the model's inference
accuracy suffers while its training does not (training normalizes with the
batch's own statistics). "Precise BN" (Wu and Johnson, *Rethinking "Batch" in
BatchNorm*, 2021) recomputes them with the weights held fixed: the mean of the
batch means and of the batch variances of a few training-mode batches.

Example:

>>> import keras, numpy as np
>>> inputs = keras.Input((4,))
>>> model = keras.Model(inputs, keras.layers.BatchNormalization(name="norm")(inputs))
>>> batches = [np.full((8, 4), 3.0, "float32"), np.full((8, 4), 5.0, "float32")]
>>> PreciseBatchNorm(model).update(model, batches)
2
>>> model.get_layer("norm").moving_mean.numpy()
array([4., 4., 4., 4.], dtype=float32)
"""

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar import graph


class PreciseBatchNorm:
    """Recomputes the moving statistics of a model's top-level BatchNormalization layers, except frozen ones
    (``trainable = False``: Keras normalizes with their moving statistics and keeps them).

    The statistics are computed on a local copy of the model (so that a model
    whose variables live elsewhere, on parameter servers, is only read and
    written, not run), then assigned to the model's moving variables.

    Args:
        model: a ``keras.Sequential`` or functional model; one without
            BatchNormalization layers, or without a graph to read (subclassed),
            is left as it is (``update`` returns 0).
    """

    def __init__(self, model):
        self.norms = [i for i, layer in enumerate(model.layers)
                      if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]
        self.copy = self.statistics = None
        if not self.norms or not graph.is_graph(model):
            return
        self.copy = keras.models.clone_model(model)
        norms = [self.copy.layers[i] for i in self.norms]
        probe = keras.Model(self.copy.inputs, [norm.input for norm in norms])

        @tf.function
        def statistics(x):
            inputs = keras.tree.flatten(probe(x, training=True))
            return [tf.nn.moments(tf.cast(value, tf.float32), axes=norm._reduction_axes)
                    for value, norm in zip(inputs, norms)]

        self.statistics = statistics

    def update(self, model, batches):
        """Set ``model``'s moving statistics from its current weights and ``batches`` (images, or
        ``(images, labels)`` pairs); return how many batches were used."""
        if self.statistics is None:
            return 0
        self.copy.set_weights(model.get_weights())
        sums, count = None, 0
        for batch in batches:
            x = batch[0] if isinstance(batch, tuple | list) else batch
            moments = [(mean.numpy(), variance.numpy()) for mean, variance in self.statistics(x)]
            sums = moments if sums is None else [(m + m2, v + v2) for (m, v), (m2, v2) in zip(sums, moments)]
            count += 1
        for index, (mean, variance) in zip(self.norms, sums or ()):
            layer = model.layers[index]
            layer.moving_mean.assign(np.reshape(mean / count, layer.moving_mean.shape))
            layer.moving_variance.assign(np.reshape(variance / count, layer.moving_variance.shape))
        return count
