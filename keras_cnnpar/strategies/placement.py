"""Model parallel: contiguous runs of layers on devices, pipelined over micro-batches (GPipe-style)."""

import dataclasses
import functools
import math
import time

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.keras_compat import graph, rebuild
from keras_cnnpar.keras_compat.accumulation import Wrapper, split_batch
from keras_cnnpar.runtime import devices as device_lib
from keras_cnnpar.strategies import arguments, base
from keras_cnnpar.strategies.base import Strategy, register


@register("layers")
class LayerPlacement(Strategy):
    """Model parallel: each device holds a contiguous run of layers (a stage).

    The layers of a ``keras.Sequential`` or functional model are cut into
    stages, one per device, contiguous in the topological order of the layer
    graph; every layer's ``build`` and ``call`` run under its device, so its
    variables and ops live there and activations flow from stage to stage. A
    tensor that crosses more than one stage boundary (a skip connection) goes
    straight to the stage that uses it; the report lists what each stage
    receives from earlier ones.
    The whole global ``batch_size`` passes through every stage. With
    ``microbatches=m > 1`` each batch is cut into ``m`` micro-batches that flow
    through the stages independently, so different devices can work on
    different micro-batches at once; their predictions are joined before the
    loss, which makes one gradient and one update per batch, equal to
    ``microbatches=1`` (``BatchNormalization`` then normalizes each
    micro-batch with its own statistics, as in GPipe). Before training, a table of the stages (layers,
    parameters, bytes, estimated FLOPs, balance) is printed and logged, and
    the expected bubble ``(p-1)/(m+p-1)`` and each stage's measured time per
    micro-batch go into the epoch CSV.

    Example:

    >>> import keras_cnnpar as cnnpar
    >>> cnnpar.devices.configure(2)
    ['/device:CPU:0', '/device:CPU:1']
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[::20], digits.y[::20], batch_size=64, verbose=0, results_dir=None,
    ...                     strategy=cnnpar.LayerPlacement(devices=2, microbatches=4))

    Args:
        devices: number of devices, or a list of device names.
        placement: ``None`` balances contiguous stages by estimated FLOPs. Or a
            dict from layer names or indexes (in ``model.layers``) to device
            indexes or names; a layer not named goes where the layer before it
            went (the first layer to device 0).
        microbatches: micro-batches per global batch (1: no pipelining).
        steps_per_execution: training steps per call into TensorFlow (default 8).
    """

    description = "layers placed on devices, pipelined over --microbatches (model parallel)"
    min_devices = 2
    idle_remedy = "more micro-batches"
    #: The micro-batch counts the planner tries.
    PLANNED_MICROBATCHES = (1, 2, 4)

    @classmethod
    def configurations(cls, devices, batch_size):
        """All the devices, with each of ``PLANNED_MICROBATCHES`` that divides the batch.

        >>> LayerPlacement.configurations(2, batch_size=6)
        [(('devices', 2), ('microbatches', 1)), (('devices', 2), ('microbatches', 2))]
        """
        return [(*on_devices, ("microbatches", m)) for on_devices in super().configurations(devices, batch_size)
                for m in cls.PLANNED_MICROBATCHES if batch_size % m == 0]

    def __init__(self, devices=2, placement=None, microbatches=1, *, steps_per_execution=8):
        super().__init__(steps_per_execution=steps_per_execution)
        self.devices = arguments.devices(devices)
        if placement is not None and not isinstance(placement, dict):
            raise TypeError(f"placement must be None or a dict of layer -> device. Received: placement={placement!r}")
        self.placement = placement
        self.microbatches = arguments.positive_int("microbatches", microbatches)

    def __repr__(self):
        return f"<LayerPlacement devices={self.num_devices} microbatches={self.microbatches}>"

    def memory_split(self, model, batch_size):
        """Each device holds ``1/devices`` of the weights (its stage's layers), activations as a replica's."""
        return dataclasses.replace(super().memory_split(model, batch_size), state=1 / self.num_devices)

    @property
    def batch_pieces(self):
        return self.microbatches

    def xla_refusal(self):
        return "its stages run on different devices, and XLA compiles a step for one device"

    def prepare(self, model, settings=None):
        if not graph.is_graph(model):
            raise TypeError("LayerPlacement cuts the layer graph of a keras.Sequential or functional model into "
                            "stages; a subclassed model has no graph to cut. Received: model of type "
                            f"{type(model).__name__}")
        names = device_lib.resolve(self.devices)
        layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        owner = assign_stages(layers, len(names), self.placement, names)
        stage_of = _with_operations(model, {layer.name: o for layer, o in zip(layers, owner)})
        stages = [Stage(names[d], [layer for layer, o in zip(layers, owner) if o == d],
                        received=_received(layers, stage_of, d))
                  for d in dict.fromkeys(owner)]  # in layer order
        device_of = {name: names[o] for name, o in stage_of.items()}

        def clone(user_model):
            def place(layer):
                return _placed(layer, device_of[layer.name])

            placed = keras.models.clone_model(user_model, clone_function=place)
            return placed if self.microbatches == 1 else _MicroBatched(placed, self.microbatches)

        settings = settings or base.RunSettings()
        return PlacementRun(self, settings, self.prepared_copy(model, settings, clone=clone), stages,
                            sequential=isinstance(model, keras.Sequential))


class PlacementRun(base.Run):
    """A ``LayerPlacement`` training: the placed copy, its ``stages`` and whether they are chains of layers."""

    def __init__(self, strategy, settings, model, stages, sequential):
        super().__init__(strategy, settings, model)
        self.stages, self.sequential = stages, sequential

    def report(self):
        """The stage table (stage, device, layers, parameters, bytes, estimated MFLOP per image, share)."""
        total = sum(s.flops for s in self.stages) or 1
        lines = [f"{'stage':<6}{'device':<16}{'params':>11}{'bytes':>13}{'MFLOP/img':>11}{'share':>7}  layers"]
        for i, s in enumerate(self.stages):
            lines.append(f"{i:<6}{s.device:<16}{s.params:>11,}{s.bytes:>13,}{s.flops / 1e6:>11.2f}"
                         f"{s.flops / total:>7.2f}  {', '.join(layer.name for layer in s.layers)}")
            if i and s.received:
                lines.append(f"{'':<6}receives: {', '.join(s.received)}")
        p, m = len(self.stages), self.strategy.microbatches
        lines.append(f"balance: the largest stage has {max(s.flops for s in self.stages) / total:.0%} of the FLOPs "
                     f"(even: {1 / p:.0%}); expected bubble (p-1)/(m+p-1) = {bubble_fraction(p, m):.3f}")
        return "\n".join(lines)

    def fit(self, train, **fit_kwargs):
        stats = StageTimes(self, train)
        callbacks = [stats, *fit_kwargs.pop("callbacks", [])]
        return super().fit(train, callbacks=callbacks, **fit_kwargs)


def bubble_fraction(stages, microbatches):
    """GPipe's idle share of a step: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


class Stage:
    """One device's run of layers, with its parameter count, bytes, estimated forward FLOPs per image and the
    tensors it receives from earlier stages (``"layer (stage i)"``)."""

    def __init__(self, device, layers, received=()):
        self.device, self.layers, self.received = device, layers, list(received)
        self.params = sum(layer.count_params() for layer in layers)
        self.bytes = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for layer in layers for w in layer.weights)
        self.flops = sum(layer_flops(layer) for layer in layers)


def _with_operations(model, stage_of):
    """``stage_of`` (layer name -> stage) with the operations ``model`` calls on tensors (``a + b``,
    ``x[:, ::-1]``, ``keras.ops.mean(x)``: no layers, so not in ``model.layers``), each in the latest stage of the
    tensors it takes (the first stage for the model's input), where the last of them is made.

    >>> inputs = keras.Input((4,))
    >>> hidden = keras.layers.Dense(4, name="hidden")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden + inputs[:, ::-1]))
    >>> sorted(_with_operations(model, {"hidden": 0, "out": 1}).values())
    [0, 0, 0, 1]
    """
    stage_of = dict(stage_of)
    for call in graph.read(model).calls:  # in topological order: what an operation takes has its stage
        if graph.is_operation(call.layer):
            stage_of[call.layer.name] = max((stage_of.get(source.name, 0) for source in graph.sources(call.layer)),
                                            default=0)
    return stage_of


def _received(layers, stage_of, stage):
    """The outputs of earlier stages that the layers of ``stage`` take: ``"name (stage i)"``, in layer order."""
    received = {}
    for layer in layers:
        if stage_of[layer.name] != stage:
            continue
        for source in graph.sources(layer):
            origin = stage_of.get(source.name)
            if origin is not None and origin < stage:
                received.setdefault(source.name, f"{source.name} (stage {origin})")
    return list(received.values())


def layer_flops(layer):
    """Estimated forward FLOPs per image: 2 per multiply-add of Conv2D and Dense, 1 per output value elsewhere; an
    axis of a size Keras does not know until it runs (a ``Reshape`` to ``-1`` in a user's layer) counts as 1."""
    out = [size or 1 for size in layer.output.shape[1:]]
    if isinstance(layer, keras.layers.Conv2D):
        return 2 * math.prod(out) * math.prod(layer.kernel_size) * (layer.input.shape[-1] or 1)
    if isinstance(layer, keras.layers.Dense):
        return 2 * math.prod(out) * (layer.input.shape[-1] or 1)
    return math.prod(out)


def assign_stages(layers, n_devices, placement, names):
    """Stage index of each layer: balanced by FLOPs, or from ``placement``; checked for contiguity."""
    if placement is None:
        return balanced_stages([layer_flops(layer) for layer in layers], n_devices)
    index = {layer.name: i for i, layer in enumerate(layers)}
    chosen = {}
    for key, device in placement.items():
        position = key if isinstance(key, int) and 0 <= key < len(layers) else index.get(key)
        if position is None:
            raise ValueError(f"placement names unknown layer {key!r}; the layers are {list(index)} (or indexes "
                             f"0..{len(layers) - 1}). Received: placement={placement!r}")
        chosen[position] = _device_index(device, names, placement)
    owner, current = [], 0
    for i in range(len(layers)):
        current = chosen.get(i, current)
        owner.append(current)
    runs = [d for i, d in enumerate(owner) if i == 0 or owner[i - 1] != d]
    if len(runs) != len(set(runs)):
        raise ValueError(f"placement makes non-contiguous stages: device order along the layers is {runs}; each "
                         f"device must hold one unbroken run of layers. Received: placement={placement!r}")
    return owner


def _device_index(device, names, placement):
    if isinstance(device, int) and not isinstance(device, bool):
        if not 0 <= device < len(names):
            raise ValueError(f"placement uses device {device}, but there are {len(names)} devices "
                             f"(0..{len(names) - 1}): more stages than devices. Received: placement={placement!r}")
        return device
    try:
        return names.index(device_lib.resolve([device])[0])
    except (TypeError, ValueError):
        raise ValueError(f"placement uses device {device!r}, which is not one of this strategy's devices "
                         f"{names}. Received: placement={placement!r}") from None


def balanced_stages(costs, n_stages):
    """Cut ``costs`` into at most ``n_stages`` contiguous runs minimising the largest run; return each item's run.

    >>> balanced_stages([4, 1, 1, 1, 5], 2)
    [0, 0, 0, 1, 1]
    """
    n = len(costs)
    k = min(n_stages, n)
    prefix = np.concatenate([[0], np.cumsum(costs)])
    best = {(0, 0): (0.0, None)}  # (items, stages) -> (largest run, cut)
    for stages in range(1, k + 1):
        for items in range(stages, n + 1):
            best[items, stages] = min(
                (max(best[cut, stages - 1][0], prefix[items] - prefix[cut]), cut)
                for cut in range(stages - 1, items) if (cut, stages - 1) in best)
    owner, items = [], n
    for stage in range(k, 0, -1):
        cut = best[items, stage][1]
        owner[:0] = [stage - 1] * (items - cut)
        items = cut
    return owner


def _placed(layer, device):
    """A fresh copy of ``layer`` (or of an operation on tensors, which has no ``build``) whose ``build`` and
    ``call`` run under ``tf.device(device)``."""
    copy = layer.__class__.from_config(layer.get_config())
    if hasattr(copy, "build"):
        copy.build = _on_device(copy.build, device)
    copy.call = _on_device(copy.call, device)
    return copy


def _on_device(method, device):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with tf.device(device):
            return method(*args, **kwargs)

    return run


class _MicroBatched(Wrapper):
    """Runs ``inner`` on ``microbatches`` slices of each batch and joins the outputs.

    Each slice's chain of stages is independent of the others', so TensorFlow's
    executor overlaps them across devices, forward and backward; the joined
    predictions make the loss, gradient and update of the whole batch.
    """

    def __init__(self, inner, microbatches):
        super().__init__(inner)
        self.microbatches = microbatches

    def call(self, inputs, training=False):
        whole = _examples(inputs)
        outputs = [_losses_weighed(self.inner, lambda part=part: self.inner(part, training=training),
                                   _examples(part) / whole)
                   for part in split_batch(inputs, self.microbatches)]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)


def _examples(batch):
    """The number of examples in ``batch`` (a tensor, or a structure of them), as a float32 tensor."""
    return tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], "float32")


def _losses_weighed(model, call, share):
    """``call()``, with each loss that ``model``'s layers add while it runs multiplied by ``share``.

    Keras divides a layer's activity regularization by the examples of the
    batch it saw, so the losses of ``m`` micro-batches summed to ``m`` times the
    whole batch's (the weights 0.0054 off Keras's after 8 steps of 2
    micro-batches); weighed by their share of the batch they sum to it. A
    layer keeps the losses it adds in ``_losses`` (cleared when the next
    outermost call begins), where Keras's ``compute_loss`` sums them.
    """
    layers = list(model._flatten_layers())
    counts = [len(layer._losses) for layer in layers]
    result = call()
    for layer, count in zip(layers, counts):
        layer._losses[count:] = [loss * tf.cast(share, loss.dtype) for loss in layer._losses[count:]]
    return result


class StageTimes(keras.callbacks.Callback):
    """Adds ``bubble_fraction`` and each stage's measured seconds per micro-batch to the epoch logs.

    Before training it times forward and backward of every stage alone on one
    micro-batch of the first batch (for a Sequential model, whose stages are
    chains of layers). It must come before ``EpochLogger``, which
    writes what the logs hold; ``PlacementRun.fit`` puts it first.
    """

    def __init__(self, run, train):
        super().__init__()
        self.run, self.train = run, train
        self.seconds = []

    def on_train_begin(self, logs=None):
        self.seconds = []
        if not self.run.sequential:
            return  # a stage of a graph is not a chain of layers to time alone; the bubble is still logged
        model = graph.unwrap(self.model)
        x = next(iter(self.train))[0]
        x = tf.cast(x[: max(1, int(x.shape[0]) // self.run.strategy.microbatches)], model.inputs[0].dtype)  # as Keras
        layers = {layer.name: layer for layer in model.layers}
        # The timing runs the layers in training mode: its dropout draws and BatchNormalization updates (of the
        # moving statistics, 0.056 off Keras's after 4 steps before they were put back) leave training's as they were.
        random_states = [state.numpy() for state in rebuild.random_states(model)]
        statistics = [weight.numpy() for weight in model.non_trainable_weights]
        for stage in self.run.stages:
            seconds, x = _time_stage([layers[layer.name] for layer in stage.layers], x)
            self.seconds.append(seconds)
        rebuild.set_random_states(model, random_states)
        for weight, value in zip(model.non_trainable_weights, statistics):
            weight.assign(value)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["bubble_fraction"] = bubble_fraction(len(self.run.stages), self.run.strategy.microbatches)
            logs.update({f"stage{i}_seconds": s for i, s in enumerate(self.seconds)})


def _time_stage(layers, x, repeats=5):
    """Median seconds of forward + backward through ``layers`` on ``x``; and the stage's output. The gradient
    reaches ``x`` where it is a float (not the input of a model whose ``Input`` takes integers)."""
    variables, floating = [w for layer in layers for w in layer.trainable_weights], x.dtype.is_floating

    @tf.function(autograph=False)
    def step(inputs):
        with tf.GradientTape() as tape:
            if floating:
                tape.watch(inputs)
            out = inputs
            for layer in layers:
                out = layer(out, training=True)
            total = tf.reduce_sum(out)
        return out, tape.gradient(total, [inputs, *variables] if floating else variables)

    out, _ = step(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, grads = step(x)
        for gradient in grads:  # wait for the results (of mixed dtypes under mixed precision)
            if gradient is not None:
                float(tf.reduce_sum(gradient))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out
