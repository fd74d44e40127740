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

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.keras_compat import graph, rebuild


class PreciseBatchNorm:
    """Recomputes the moving statistics of a model's BatchNormalization layers, those of its nested blocks too,
    except frozen ones (``trainable = False``: Keras normalizes with their moving statistics and keeps them).

    The statistics are computed on a local copy of the model (so that a model
    whose variables live elsewhere, on parameter servers, is only read and
    written, not run): each layer's input is read where the layer runs, then
    the means are assigned to the model's moving variables.

    Args:
        model: a ``keras.Sequential`` or functional model; one without
            BatchNormalization layers, or without a graph to read (subclassed),
            is left as it is (``update`` returns 0).
    """

    def __init__(self, model):
        self.norms = [i for i, layer in enumerate(graph.weight_order(model)) if _recomputed(layer)]
        self.copy = self.statistics = None
        if not self.norms or not graph.is_graph(model):
            return
        self.copy = keras.models.clone_model(model)
        norms = [layer for layer in graph.weight_order(self.copy) if _recomputed(layer)]

        @tf.function(autograph=False)
        def statistics(x):
            moments = {}
            with _reading_inputs(norms, moments):
                self.copy(x, training=True)
            return [moments[index] for index in range(len(norms))]

        self.statistics = statistics

    def update(self, model, batches):
        """Set ``model``'s moving statistics from its current weights and ``batches`` (images, or
        ``(images, labels)`` pairs); return how many batches were used."""
        if self.statistics is None:
            return 0
        rebuild.set_weights(self.copy, model.get_weights())
        sums, count = None, 0
        for batch in batches:
            x = batch[0] if isinstance(batch, tuple | list) else batch
            moments = [(mean.numpy(), variance.numpy()) for mean, variance in self.statistics(x)]
            sums = moments if sums is None else [(m + m2, v + v2) for (m, v), (m2, v2) in zip(sums, moments)]
            count += 1
        layers = graph.weight_order(model)
        for index, (mean, variance) in zip(self.norms, sums or ()):
            layer = layers[index]
            layer.moving_mean.assign(np.reshape(mean / count, layer.moving_mean.shape))
            layer.moving_variance.assign(np.reshape(variance / count, layer.moving_variance.shape))
        return count


def _recomputed(layer):
    return isinstance(layer, keras.layers.BatchNormalization) and layer.trainable


@contextlib.contextmanager
def _reading_inputs(norms, moments):
    """Have each of ``norms`` (BatchNormalization layers of a private copy) put the batch mean and variance of its
    input into ``moments`` under its index when it runs."""
    def reading(index, norm, call):
        def call_and_read(inputs, *args, **kwargs):
            moments[index] = tf.nn.moments(tf.cast(inputs, tf.float32), axes=norm._reduction_axes)
            return call(inputs, *args, **kwargs)

        return call_and_read

    for index, norm in enumerate(norms):
        norm.call = reading(index, norm, type(norm).call.__get__(norm))
    try:
        yield
    finally:
        for norm in norms:
            del norm.call
