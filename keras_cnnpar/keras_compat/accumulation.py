"""Gradient accumulation: one optimizer step, and one gradient sync, per ``K`` micro-batches.

Each training step reads ``K`` micro-batches at once (a batch of ``K *
batch_size``), computes the gradient of each in turn, weighed by its share of
the batch's loss, and applies their sum once. Only one micro-batch's
activations live at a time, and under a ``tf.distribute`` strategy the replicas
all-reduce once per step, not once per micro-batch. The update equals one step
on the ``K``-times larger batch. The mirrored strategies take this step with
``K = 1`` too, for its weighing of replicas that hold parts of unequal size.
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
from keras.src.losses.loss import unscale_loss_for_distribution


class Wrapper(keras.Model):
    """A model that runs ``inner`` its own way (``graph.unwrap`` sees through it), under ``inner``'s name, and
    whose compiled losses and metrics Keras names after ``inner``'s outputs, as it names ``inner``'s."""

    def __init__(self, inner):
        super().__init__(name=inner.name)
        self.inner = inner
        if hasattr(inner, "output_names"):
            self.output_names = inner.output_names


class Accumulating(Wrapper):
    """Trains ``inner`` with the gradient of the whole batch, summed over ``micro_batches`` slices and applied once.

    Each slice's loss is weighed by its share of the whole batch's, as the
    loss's reduction makes it: its examples over the examples of every slice of
    every replica (Keras's default, ``"sum_over_batch_size"``), its sample
    weights over theirs (``"mean_with_sample_weight"``), or whole (``"sum"``);
    examples whose label is the loss's ``ignore_class`` are not counted, as
    Keras's mean leaves them out.
    So a step is one device's step on the whole batch however unevenly the
    slices or the replicas split it. (Keras's own step, under
    ``MirroredStrategy``, weighs every replica's mean alike: of 63 examples on
    2 replicas, one of the 31 weighs 1/62 and one of the 32 weighs 1/64.)
    Losses of several outputs with different reductions are weighed by
    examples.
    """

    def __init__(self, inner, micro_batches, over_replicas=None):
        super().__init__(inner)
        self.micro_batches = micro_batches
        #: ``value -> (its sum over every replica in sync, the replicas)``; None: one replica.
        self.over_replicas = over_replicas or (lambda value: (value, 1))

    def call(self, inputs, training=False):
        return self.inner(inputs, training=training)

    def train_step(self, data):
        total = None
        data = keras.utils.unpack_x_y_sample_weight(data)
        reduction, ignored = loss_reduction(self.loss), _ignored_class(self.loss)
        whole, replicas = self.over_replicas(_denominator(reduction, data, ignored))
        for x, y, sample_weight in split_batch(data, self.micro_batches):
            with tf.GradientTape() as tape:
                y_pred = self.inner(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
                size = tf.shape(tf.nest.flatten(x)[0])[0]
                # The epoch's "loss", as Keras's own train_step tracks it (it read 0.0 without).
                self._loss_tracker.update_state(unscale_loss_for_distribution(loss), sample_weight=size)
                part = _denominator(reduction, (x, y, sample_weight), ignored)
                share = tf.math.divide_no_nan(part * replicas * self.micro_batches, whole)
                scaled_loss = self.optimizer.scale_loss(loss * tf.cast(share, loss.dtype))  # float16's scaling
            gradients = _dense(tape.gradient(scaled_loss, self.trainable_variables))
            total = gradients if total is None else [a if b is None else a + b for a, b in zip(total, gradients)]
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        self.optimizer.apply([None if g is None else g / self.micro_batches for g in total], self.trainable_variables)
        return self.get_metrics_result()


def _dense(gradients):
    """``gradients`` as tensors that add and divide: an ``Embedding``'s, which come as ``tf.IndexedSlices``, made
    dense; a variable's that the loss does not reach stays None (Keras's optimizer leaves it out).

    >>> table = tf.Variable(tf.ones((4, 2)))
    >>> with tf.GradientTape() as tape:
    ...     loss = tf.reduce_sum(tf.gather(table, [1, 1]))
    >>> gradients = tape.gradient(loss, [table])
    >>> type(gradients[0]).__name__, _dense(gradients)[0].numpy().tolist()
    ('IndexedSlices', [[0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    """
    return [None if gradient is None else tf.convert_to_tensor(gradient) for gradient in gradients]


def loss_reduction(loss):
    """The reduction of every loss in ``loss`` (``compile``'s: a loss, or a list or dict of them), or None where
    they differ. A loss given by name or as a function reduces as Keras's default, ``"sum_over_batch_size"``.

    >>> loss_reduction(["mse", keras.losses.MeanSquaredError(reduction="sum")]) is None
    True
    """
    reductions = {getattr(item, "reduction", "sum_over_batch_size") for item in keras.tree.flatten(loss)}
    return reductions.pop() if len(reductions) == 1 else None


def _denominator(reduction, batch, ignored=None):
    """What ``batch`` (``x, y, sample_weight``) adds to what the loss's ``reduction`` divides by: its examples, or
    the sum of its sample weights under ``"mean_with_sample_weight"``, each counted only where its label is not
    the loss's ``ignored`` class (Keras masks those out of the mean). Under ``"sum"``, which divides by nothing
    (and which Keras leaves unscaled by the replicas), 1 for a replica's batch and for each of its slices alike,
    so that every slice's sum weighs whole.

    >>> batch = (tf.zeros((4, 2)), tf.constant([0, 3, 0, 5]), tf.constant([1.0, 2.0, 3.0, 4.0]))
    >>> [float(_denominator(reduction, batch, ignored)) for reduction, ignored in [
    ...     ("sum_over_batch_size", None), ("sum_over_batch_size", 0), ("mean_with_sample_weight", 0)]]
    [4.0, 2.0, 6.0]
    """
    x, y, sample_weight = batch
    if reduction == "sum":
        return tf.constant(1.0)
    counted = None if ignored is None else tf.cast(
        tf.not_equal(tf.reshape(y, [-1]), tf.cast(ignored, y.dtype)), "float32")
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = tf.reshape(tf.cast(sample_weight, "float32"), [-1])
        return tf.reduce_sum(weights if counted is None else weights * counted)
    if counted is not None:
        return tf.reduce_sum(counted)
    return tf.cast(tf.shape(tf.nest.flatten(x)[0])[0], "float32")


def _ignored_class(loss):
    """The label ``loss`` leaves out of its mean (a ``SparseCategoricalCrossentropy``'s ``ignore_class``), or None;
    None for several losses too, whose parts are weighed by their examples."""
    return getattr(loss, "ignore_class", None)


def split_batch(batch, parts):
    """``batch`` (a tensor, or a tuple or dict of them, of one batch) as ``parts`` consecutive slices of its
    examples, as even as they divide.

    >>> [part[1].numpy().tolist() for part in split_batch((tf.zeros((5, 2)), tf.range(5)), 2)]
    [[0, 1], [2, 3, 4]]
    """
    size = tf.shape(tf.nest.flatten(batch)[0])[0]
    bounds = [size * i // parts for i in range(parts + 1)]
    return [tf.nest.map_structure(lambda tensor: None if tensor is None else tensor[start:stop], batch)  # noqa: B023
            for start, stop in itertools.pairwise(bounds)]


def wrap(clone, micro_batches, over_replicas=None):
    """A clone function for ``rebuild``: ``clone``'s copy, accumulating over ``micro_batches`` when above 1, and
    weighing each replica's part of a batch by its share of the loss when given ``over_replicas`` (see
    ``Accumulating``)."""
    if micro_batches == 1 and over_replicas is None:
        return clone
    return lambda model: Accumulating(clone(model), micro_batches, over_replicas)
