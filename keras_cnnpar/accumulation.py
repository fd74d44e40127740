"""Gradient accumulation: one optimizer step, and one gradient sync, per ``K`` micro-batches.

Each training step reads ``K`` micro-batches at once (a batch of ``K *
batch_size``), computes the gradient of each in turn, and applies their mean
once. Only one micro-batch's activations live at a time, and under a
``tf.distribute`` strategy the replicas all-reduce once per step, not once per
micro-batch. The update equals one step on the ``K``-times larger batch.
(Keras's own ``gradient_accumulation_steps`` fails under ``MirroredStrategy``:
its ``merge_call`` inside a ``cond``.)

Example:

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> history = model.fit(digits.x[:256], digits.y[:256], batch_size=32, verbose=0, results_dir=None,
...                     strategy=cnnpar.Single(accumulate=2))   # 4 updates of 2 x 32 images
"""

import itertools

import keras
import tensorflow as tf


class Accumulating(keras.Model):
    """Trains ``inner`` with the mean gradient of ``micro_batches`` slices of each batch, applied once."""

    def __init__(self, inner, micro_batches):
        super().__init__(name=inner.name)
        self.inner, self.micro_batches = inner, micro_batches

    def call(self, inputs, training=False):
        return self.inner(inputs, training=training)

    def train_step(self, data):
        x, y = data[:2]
        size = tf.shape(x)[0]
        bounds = [size * i // self.micro_batches for i in range(self.micro_batches + 1)]
        total = None
        for start, stop in itertools.pairwise(bounds):
            with tf.GradientTape() as tape:
                y_pred = self.inner(x[start:stop], training=True)
                loss = self.compute_loss(x=x[start:stop], y=y[start:stop], y_pred=y_pred, training=True)
                scaled_loss = self.optimizer.scale_loss(loss)  # float16's loss scaling; else the loss itself
            gradients = tape.gradient(scaled_loss, self.trainable_variables)
            total = gradients if total is None else [a + b for a, b in zip(total, gradients)]
            self.compute_metrics(x[start:stop], y[start:stop], y_pred)
        self.optimizer.apply([g / self.micro_batches for g in total], self.trainable_variables)
        return self.get_metrics_result()


def wrap(clone, micro_batches):
    """A clone function for ``rebuild``: ``clone``'s copy, accumulating over ``micro_batches`` when above 1."""
    return clone if micro_batches == 1 else (lambda model: Accumulating(clone(model), micro_batches))
