"""Tensor parallel on DTensor meshes: ``ChannelSharded`` (channels over devices) and ``Hybrid`` (batch x channels)."""

import functools
import math
import os

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_cnnpar.keras_compat import graph, losses, rebuild
from keras_cnnpar.runtime import devices as device_lib
from keras_cnnpar.strategies import arguments, base, loop, registry
from keras_cnnpar.strategies.base import Strategy, register
from keras_cnnpar.strategies.tensor_parallel import memory as tp_memory
from keras_cnnpar.strategies.tensor_parallel.layers import activation_layout, to_mesh
from keras_cnnpar.strategies.tensor_parallel.model import ShardedModel
from keras_cnnpar.strategies.tensor_parallel.optimizer import MeshOptimizer


@register("channels")
class ChannelSharded(Strategy):
    """Tensor parallel: every Conv2D and Dense kernel is sharded over the devices' channels, with DTensor.

    The model (``Sequential`` or functional) is rebuilt on a 1-D DTensor mesh
    ``("model",)``. Its Conv2D and Dense layers become ``ChannelShardedConv2D``
    and ``ShardedDense``: every convolution gathers its kernel for the step
    and runs on the batch split over the devices, leaving its output split
    (fully sharded data parallel), so BatchNormalization (statistics
    all-reduced over the split batch), pooling, padding, flatten, dropout,
    activations and merges between convolutions need no communication; the
    Dense layers alternate column and row mode (output or input channels
    sharded, partial sums all-reduced), as Megatron pairs its layers
    (``keras_cnnpar.strategies.tensor_parallel.ShardedModel``). Every weight and every optimizer slot
    is a DVariable laid out like its kernel, so each device holds about
    ``1/devices`` of the parameters at rest. A training step is
    one ``tf.function``; the loss and metrics are computed from its
    predictions, and validation runs the sharded model too. Supported
    optimizers: SGD (with momentum, Nesterov) and Adam. The trained weights
    come back unsharded into the user's model.

    The layer table (mode, kernel layout, parameter bytes per device) is
    printed and logged before training.

    Example:

    >>> import keras_cnnpar as cnnpar
    >>> cnnpar.devices.configure(2)
    ['/device:CPU:0', '/device:CPU:1']
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[::20], digits.y[::20], batch_size=64, verbose=0, results_dir=None,
    ...                     strategy=cnnpar.ChannelSharded(devices=2))

    Args:
        devices: number of devices on the ``"model"`` axis, or a list of device names.
    """

    description = "Conv2D/Dense kernels sharded over --devices with DTensor (tensor parallel)"
    min_devices = 2
    mesh_axes = ("model",)
    sync_batchnorm = True  # every device sees the whole batch

    def __init__(self, devices=2):
        super().__init__(steps_per_execution=1)
        self.devices = arguments.devices(devices)

    def __repr__(self):
        return f"<ChannelSharded devices={self.num_devices}>"

    def memory_split(self, model, batch_size):
        """Kernels sharded over the devices, the whole batch on each (:mod:`.memory`)."""
        return tp_memory.memory_split(model, batch_size, data=1, shards=self.num_devices)

    @property
    def mesh_shape(self):
        return (self.num_devices,)

    def mesh(self):
        """The DTensor mesh over this strategy's devices; an error lists the devices when there are too few."""
        wanted = math.prod(self.mesh_shape)
        try:
            names = device_lib.resolve(self.devices if not isinstance(self.devices, int) else wanted)
        except RuntimeError:
            have = device_lib.logical_names()
            raise ValueError(f"a mesh of {' x '.join(map(str, self.mesh_shape))} needs {wanted} devices, but "
                             f"TensorFlow has {len(have)}: {have}. Call cnnpar.devices.configure({wanted}) before "
                             f"TensorFlow starts, or use fewer devices. Received: {self!r}") from None
        _gather_with_collective_gather()
        return dtensor.create_mesh(list(zip(self.mesh_axes, self.mesh_shape)), devices=names)

    def prepare(self, model, settings=None):
        settings = settings or base.RunSettings()
        float16 = [layer.name for layer in graph.weight_order(model)  # nested blocks' layers too
                   if layer.compute_dtype == "float16" and not isinstance(layer, keras.layers.InputLayer)]
        if settings.precision == "mixed_float16" or float16:
            received = ("precision='mixed_float16'" if settings.precision == "mixed_float16" else
                        f"a model whose layers compute in float16 (Keras's mixed_float16 policy): {float16[:3]}")
            raise ValueError("tensor-parallel training computes in float32 or bfloat16; its mesh optimizer has no "
                             "loss scaling, which float16 needs. Use precision='mixed_bfloat16' (or build the "
                             f"model under that policy). Received: {received}")
        prepared = rebuild.rebuild(model, scope=self.scope())  # the local copy that reports metrics: float32
        compute_dtype = "bfloat16" if settings.precision == "mixed_bfloat16" else None
        sharded_model = ShardedModel(prepared, self.mesh(), compute_dtype, sync_batchnorm=self.sync_batchnorm)
        optimizer = MeshOptimizer(prepared.optimizer, sharded_model.trainable_weights,
                                   rebuild.decayed_by(prepared), use_kernels=settings.fused_optimizer)
        if prepared.optimizer.built:
            optimizer.set_state(rebuild.optimizer_state(prepared.optimizer))
        return MeshRun(self, settings, prepared, sharded_model, optimizer)


#: DTensor's switch from its default all-gather (a zero tensor of the gathered shape, the local shard written
#: into it, then an all-reduce) to TensorFlow's ``CollectiveGatherV2``; read when a mesh function is compiled.
GATHER_SWITCH = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


def _gather_with_collective_gather():
    """Have DTensor all-gather with ``CollectiveGatherV2`` (unless the user set ``GATHER_SWITCH``).

    The default's zero tensor is a constant of the gathered activation's shape, which TensorFlow keeps on every
    device for as long as the step function lives, and its all-reduce moves ``devices`` times the data. With
    ``CollectiveGatherV2`` a channel-sharded model holds less memory between steps and at its peak, and spends a
    smaller share of its step communicating, with the same first-step gradients
    (docs/measurements/2026-12-02-zen5.md).
    """
    os.environ.setdefault(GATHER_SWITCH, "1")


class MeshRun(base.Run):
    """A tensor-parallel training: the local Keras copy (``model``, which reports metrics), the ``sharded``
    model on the mesh and its mesh ``optimizer``. Each epoch's weights and optimizer state are copied into
    ``model``."""

    def __init__(self, strategy, settings, model, sharded_model, optimizer):
        super().__init__(strategy, settings, model)
        self.sharded, self.optimizer = sharded_model, optimizer
        self.loss = losses.weighted_loss(model)

    def report(self):
        return self.sharded.report()

    def fit(self, train, *, epochs=1, validation_data=None, callbacks=None, initial_epoch=0, verbose=1,
            steps_per_epoch=None, validation_steps=None, validation_freq=1, **unsupported):
        prepared = self.model
        steps = loop.epoch_steps(self.strategy, train, steps_per_epoch, unsupported)
        batches = iter(train.repeat())  # one pass per epoch of a finite dataset, one iterator for all epochs
        train_step, test_step = _steps(self.sharded, self.optimizer, self.loss)
        update_metrics = _metrics_update(prepared)

        def train_epoch(epoch, callback_list):
            learning_rate = to_mesh(np.float64(prepared.optimizer.learning_rate), self.optimizer.scalar)
            step = functools.partial(train_step, learning_rate=learning_rate)
            logs = _run_batches(prepared, update_metrics, batches, steps, step, self.sharded, callback_list)
            self._sync()
            return logs

        def validate(callback_list):
            return _run_batches(prepared, update_metrics, iter(validation_data), validation_steps
                                or loop.finite_steps(validation_data, "validation"), test_step, self.sharded,
                                callback_list, phase="test")

        return loop.run_epochs(prepared, train_epoch, epochs=epochs, steps=steps, callbacks=callbacks,
                               verbose=verbose, initial_epoch=initial_epoch, validation_freq=validation_freq,
                               validate=validate if validation_data is not None else None)

    def reload(self):
        self.sharded.set_weights(self.model.get_weights())
        self.optimizer.set_state(rebuild.optimizer_state(self.model.optimizer))

    def _sync(self):
        """Copy the sharded weights and optimizer state into ``model`` (the local Keras copy)."""
        rebuild.set_weights(self.model, self.sharded.get_weights())
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        for variable, value in zip(rebuild.optimizer_state(self.model.optimizer), self.optimizer.get_state()):
            variable.assign(np.reshape(value, variable.shape))


@register("hybrid")
class Hybrid(ChannelSharded):
    """A 2-D DTensor mesh: the batch split over ``data`` replicas, the channels over ``model`` shards.

    Each of the ``data * model`` devices holds ``1/model`` of every kernel (as
    in ``ChannelSharded``) and computes ``batch_size / data`` of the global
    batch; the gradients of the replicated parameters are all-reduced over the
    ``"batch"`` axis by DTensor. A batch that ``data`` does not divide (a short
    last batch) is computed whole by every replica, which gives the same
    gradient. BatchNormalization takes its batch statistics over the global
    batch (DTensor all-reduces them over ``"batch"``), so a step is
    ``ChannelSharded``'s and ``Single``'s; ``sync_batchnorm=False`` makes
    each replica normalize its own slice, as ``DataParallel`` then does.

    Example:

    >>> import keras_cnnpar as cnnpar
    >>> cnnpar.Hybrid(data=2, model=2)
    <Hybrid data=2 model=2>

    Args:
        data: replicas on the ``"batch"`` axis.
        model: shards on the ``"model"`` axis.
        sync_batchnorm: BatchNormalization statistics over the global batch
            (True, the default) or per replica.
    """

    description = "a DTensor mesh of batch x channels, see --mesh"
    min_devices, device_multiple = 4, 2
    device_option = "mesh"
    mesh_axes = ("batch", "model")

    @classmethod
    def configurations(cls, devices, batch_size):
        """Every mesh of ``data x model = devices`` with at least 2 on each axis.

        >>> Hybrid.configurations(8, batch_size=64)
        [(('data', 2), ('model', 4)), (('data', 4), ('model', 2))]
        """
        if registry.invalid(cls, devices):
            return []
        return [(("data", d), ("model", devices // d)) for d in range(2, devices // 2 + 1) if devices % d == 0]

    def __init__(self, data=2, model=2, *, sync_batchnorm=True):
        super().__init__(devices=arguments.positive_int("data", data) * arguments.positive_int("model", model))
        self.data, self.model = data, model
        self.sync_batchnorm = arguments.flag("sync_batchnorm", sync_batchnorm)

    def __repr__(self):
        return f"<Hybrid data={self.data} model={self.model}>"

    def memory_split(self, model, batch_size):
        return tp_memory.memory_split(model, batch_size, data=self.data, shards=self.model)

    @property
    def mesh_shape(self):
        return (self.data, self.model)

    @property
    def num_replicas(self):
        return self.data

    def replica_batches(self, dataset):
        """The batch-axis shards of the first batch: contiguous rows, as the ``"batch"`` layout splits them."""
        x = next(iter(dataset))[0].numpy()
        return np.array_split(x, self.data) if len(x) % self.data == 0 else [x] * self.data


def _steps(sharded, optimizer, loss_fn):
    """The training and test steps, each one ``tf.function`` on the mesh (the training step followed by a second
    for the weights' constraints, where the model has any); both return (loss, predictions)."""
    mesh = sharded.mesh

    def loss_and_predictions(x, y, sample_weight, training):
        y_pred, regularization = sharded.call_with_losses(x, training=training)
        y, sample_weight = (None if t is None else dtensor.relayout(t, activation_layout(mesh, t.shape))
                            for t in (y, sample_weight))
        loss = loss_fn(y, y_pred, sample_weight=sample_weight)
        whole = dtensor.relayout(y_pred, dtensor.Layout.replicated(mesh, y_pred.shape.rank))  # for the metrics
        return tf.add_n([loss, *(tf.cast(term, loss.dtype) for term in regularization)]), whole

    @tf.function(autograph=False)
    def train_step(x, y, sample_weight, learning_rate):
        with tf.GradientTape() as tape:
            loss, y_pred = loss_and_predictions(x, y, sample_weight, True)
        # Laid out like their variables, the gradients are all-reduced over "batch" before the update reads them.
        variables = sharded.trainable_weights
        gradients = [dtensor.relayout(g, v.layout) for g, v in zip(tape.gradient(loss, variables), variables)]
        optimizer.apply(gradients, variables, learning_rate)
        return loss, y_pred

    @tf.function(autograph=False)
    def test_step(x, y, sample_weight):
        return loss_and_predictions(x, y, sample_weight, False)

    if not sharded.constrained:
        return train_step, test_step
    constrain = tf.function(sharded.apply_constraints, autograph=False)

    def constrained_step(*args, **kwargs):
        # The weights' constraints after the update, in a function of their own: inside the step, DTensor did not
        # order their read after the optimizer's assignment, and they undid the update (tests/test_functional_corpus).
        result = train_step(*args, **kwargs)
        constrain()
        return result

    return constrained_step, test_step


def _run_batches(model, update_metrics, batches, steps, step, sharded, callback_list=None, phase="train"):
    """Run ``step`` on ``steps`` batches, each preprocessed on the host (``sharded.preprocess``) and put on
    ``sharded``'s mesh; update ``model``'s compiled metrics from the predictions; return the logs.

    The loss is the batch-size-weighted mean, as Keras reports it;
    ``update_metrics`` is ``_metrics_update(model)``. The batch hooks of
    ``phase`` (``"train"``, or ``"test"`` for validation) are called, and the
    logs read back after a step, only when a callback overrides one of them
    (reading them costs a few ms a step).
    """
    model.reset_metrics()
    per_batch = callback_list is not None and loop.reads_batch_logs(callback_list.callbacks, phase)
    begin, end = (getattr(callback_list, f"on_{phase}_batch_{when}", None) for when in ("begin", "end"))
    total, count = 0.0, 0

    def logs():
        return {**{k: float(v) for k, v in model.get_metrics_result().items()}, "loss": total / count}

    for index in range(steps):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(next(batches))
        x = _only_input(x)
        if per_batch:
            begin(index)
        inputs = (sharded.preprocess(x, training=phase == "train"), y, sample_weight)
        loss, y_pred = step(*(None if a is None else to_mesh(a, dtensor.Layout.replicated(sharded.mesh, len(a.shape)))
                              for a in inputs))
        total, count = total + float(dtensor.unpack(loss)[0]) * len(y), count + len(y)
        update_metrics(x, y, dtensor.unpack(y_pred)[0], sample_weight)
        if per_batch:
            end(index, logs())
    return logs()


def _only_input(x):
    """The one input of a batch for the mesh's one-input model: ``x`` itself, or the tensor of a dict or list that
    holds one (Keras's ``fit`` takes ``{"image": x}`` for an input named ``"image"``).

    >>> _only_input({"image": 1.0})
    1.0
    >>> _only_input({"image": 1.0, "label": 2.0})
    Traceback (most recent call last):
    ValueError: channel sharding trains a model with one input, so a batch's x is one tensor. Received: x of 2 tensors
    """
    tensors = tf.nest.flatten(x)
    if len(tensors) != 1:
        raise ValueError("channel sharding trains a model with one input, so a batch's x is one tensor. "
                         f"Received: x of {len(tensors)} tensors")
    return tensors[0]


def _metrics_update(model):
    """``model.compute_metrics`` as one traced function (run eagerly, it cost a few ms a step)."""

    @tf.function(autograph=False)
    def update(x, y, y_pred, sample_weight=None):
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return update
