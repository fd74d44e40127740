"""Rebuilding a Keras model for a strategy, and carrying its state across.

A strategy trains a *prepared* copy of the user's model: built again under the
strategy's scope, with the same weights, the same state of its random layers
(:func:`random_states`), the same compile settings (optimizer config, loss,
metrics) and, when the user's optimizer already took steps, the same optimizer
state. After training the state goes back the other way. The learning rate is
never copied, so a strategy's scaled rate stays its own. What
``optimizer.exclude_from_weight_decay`` set, which Keras keeps out of the
optimizer's config, goes to the copy too (:func:`weight_decay_exclusions`).

Example:

>>> import contextlib, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> copy = rebuild(model, scope=contextlib.nullcontext(), lr_factor=2.0)
>>> float(copy.optimizer.learning_rate.numpy()) == 2 * float(model.optimizer.learning_rate.numpy())
True
"""

import inspect
import re

import keras
from keras import tree
from keras.src.saving import serialization_lib

from keras_cnnpar.keras_compat import fused, graph


def rebuild(model, *, scope, lr_factor=1.0, steps_per_execution=None, clone=keras.models.clone_model,
            precision="float32", fused_optimizer=False, jit_compile=None):
    """Return a compiled copy of ``model`` built inside ``scope``, holding its weights and state.

    Args:
        model: a built, compiled Keras model.
        scope: context manager to build under, e.g. ``strategy.scope()``.
        lr_factor: multiplies the optimizer's learning rate (see ``scale_lr``).
        steps_per_execution: overrides the compiled value when given.
        clone: makes the uncompiled copy; its weights must come in ``model``'s order.
        precision: the Keras dtype policy the copy computes in (see :func:`set_precision`).
        fused_optimizer: apply the copy's updates with TensorFlow's fused kernels (:mod:`.fused`).
        jit_compile: overrides the compiled value when given.
    """
    config = model.get_compile_config()
    config["optimizer"] = _scaled_optimizer(model.optimizer, lr_factor)
    if steps_per_execution is not None:
        config["steps_per_execution"] = steps_per_execution
    if jit_compile is not None:
        config["jit_compile"] = jit_compile
    # A Lambda's Python function comes from the live model in this process, not from a file, which is what
    # Keras's safe mode guards against; Keras's own clone_model refuses it.
    with scope, serialization_lib.SafeModeScope(False):
        copy = clone(model)
        set_precision(copy, precision)
        copy.compile_from_config(config)  # under mixed_float16, Keras wraps the optimizer in a LossScaleOptimizer
        exclude_from_weight_decay(copy, weight_decay_exclusions(model))
        if not copy.optimizer.built and copy.trainable_variables:
            copy.optimizer.build(copy.trainable_variables)  # now, eagerly: each slot on its variable's device
    if fused_optimizer:
        fused.fuse(copy.optimizer)
    copy_state(model, copy)
    return copy


def custom_objects(model):
    """The functions and classes of ``model`` that Keras finds only when registered, by the names it serializes
    them under: its compile arguments (a plain function as the loss, metric classes), its layers' classes
    defined outside Keras, and the functions and objects of other classes that those layers hold (an
    activation function, an initializer or constraint of one's own). In ``keras.saving.custom_object_scope``,
    a copy compiled from ``get_compile_config()`` (as ``keras.models.clone_model`` compiles a ``Sequential``'s),
    or the model saved and loaded, finds them.

    >>> def doubled(y_true, y_pred):
    ...     return 2 * keras.losses.mean_squared_error(y_true, y_pred)
    >>> def clipped(x):
    ...     return keras.ops.minimum(x, 1.0)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation=clipped)])
    >>> model.compile(loss=doubled, metrics=["mae", keras.metrics.RootMeanSquaredError()])
    >>> sorted(custom_objects(model))
    ['RootMeanSquaredError', 'clipped', 'doubled']
    """
    arguments = getattr(getattr(model, "_compile_config", None), "config", {})  # compile's arguments, as given
    found = {}
    for item in tree.flatten([arguments.get(name) for name in ("loss", "metrics", "weighted_metrics")]):
        if inspect.isfunction(item):
            found[item.__name__] = item
        elif isinstance(item, (keras.losses.Loss, keras.metrics.Metric)):
            found[type(item).__name__] = type(item)
    for layer in model._flatten_layers(include_self=False):
        held = [value for name, value in vars(layer).items() if not hasattr(type(layer), name)]  # not its methods
        for item in [layer, *held]:
            kind = item if inspect.isfunction(item) else type(item)
            wanted = (inspect.isfunction(item) and item.__name__ != "<lambda>") or isinstance(item, _KERAS_OBJECTS)
            if wanted and _defined_outside_keras(kind):
                found[keras.saving.get_registered_name(kind)] = kind
    return found


#: The kinds of objects a layer holds that Keras serializes by their class's name.
_KERAS_OBJECTS = (keras.layers.Layer, keras.initializers.Initializer, keras.regularizers.Regularizer,
                  keras.constraints.Constraint)


def _defined_outside_keras(thing):
    return getattr(thing, "__module__", "keras").split(".")[0] not in ("keras", "tf_keras", "tensorflow")


def clone_with(model, change):
    """``keras.models.clone_model`` of ``model`` and of the models nested in it (a ``Sequential`` block used as a
    layer), each layer made from its config after ``change(layer, config)`` edited it, or replaced by the layer
    that ``change`` returns.

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5)])
    >>> clone_with(model, lambda layer, config: config.update(rate=0.1)).layers[0].rate
    0.1
    >>> block = keras.Sequential([keras.layers.Dropout(0.5)], name="block")
    >>> nested = keras.Sequential([keras.Input((4,)), block])
    >>> clone = clone_with(nested, lambda layer, config: keras.layers.Identity(name=layer.name))
    >>> type(clone.get_layer("block").layers[0]).__name__
    'Identity'
    """
    def clone_layer(layer):
        config = layer.get_config()
        replacement = change(layer, config)
        return replacement if replacement is not None else layer.__class__.from_config(config)

    return keras.models.clone_model(model, clone_function=clone_layer, recursive=True)


def clone_synchronized(model):
    """``keras.models.clone_model``, with every ``BatchNormalization`` synchronized across replicas.

    Under a ``tf.distribute`` strategy, a synchronized layer computes the batch
    mean and variance over the global batch (all-reduced sums), so a step is
    one device's step on the whole batch, up to float32 rounding.

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    >>> clone_synchronized(model).layers[0].synchronized
    True
    """
    def synchronize(layer, config):
        if isinstance(layer, keras.layers.BatchNormalization):
            config["synchronized"] = True

    return clone_with(model, synchronize)


def set_precision(model, precision):
    """Make ``model`` compute under the Keras dtype policy ``precision``, its output layers in float32.

    Variables (and so the optimizer's state) stay float32 under every mixed
    policy; each layer casts its inputs to the compute dtype (bfloat16 or
    float16). The layers that make the model's outputs (the softmax) compute
    in float32, as Keras's mixed-precision guide recommends.

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    >>> set_precision(model, "mixed_bfloat16")
    >>> [layer.compute_dtype for layer in model.layers], model.layers[0].kernel.dtype
    (['bfloat16', 'float32'], 'float32')
    """
    if precision == "float32":
        return
    for layer in model._flatten_layers(include_self=True, recursive=True):
        layer.dtype_policy = precision
    for layer in graph.output_layers(model):
        for part in layer._flatten_layers(include_self=True, recursive=True):
            part.dtype_policy = "float32"


def set_weights(model, weights):
    """``model.set_weights(weights)``, then what adapted preprocessing layers derive from their weights (a
    ``Normalization``'s mean and variance, which it computes once from them), as Keras's loading does.

    >>> import numpy as np
    >>> norm = keras.layers.Normalization()
    >>> norm.adapt(np.array([[1.0], [3.0]]))
    >>> copy = keras.Sequential([keras.Input((1,)), keras.layers.Normalization()])
    >>> set_weights(copy, [np.array([2.0]), np.array([1.0]), np.array(2)])
    >>> copy.predict(np.array([[3.0]]), verbose=0).tolist()
    [[1.0]]
    """
    model.set_weights(weights)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if hasattr(layer, "finalize_state"):
            layer.finalize_state()


def copy_state(source, target):
    """Copy weights, the random layers' states, and optimizer state once ``source``'s optimizer is built,
    into ``target``."""
    set_weights(target, source.get_weights())
    set_random_states(target, [state.numpy() for state in random_states(source)])
    if not source.optimizer.built:
        return
    if not target.optimizer.built:
        target.optimizer.build(target.trainable_variables)
    source_state, target_state = optimizer_state(source.optimizer), optimizer_state(target.optimizer)
    if len(source_state) != len(target_state):
        raise ValueError(f"optimizer states differ: {len(source_state)} variables in the source, "
                         f"{len(target_state)} in the target. Received: source={source.name}, "
                         f"target={target.name}")
    for value, variable in zip(source_state, target_state):
        variable.assign(value)


def weight_decay_exclusions(model):
    """What ``model.optimizer.exclude_from_weight_decay`` set, as ``(positions, pattern)``: the positions of the
    excluded variables in ``model.trainable_variables``, and the pattern of excluded names (or None).

    Keras keeps them out of the optimizer's config, so a copy compiled from it, or a
    saved and loaded model, decays every variable (a silent difference from the user's run).

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer=keras.optimizers.AdamW(weight_decay=0.1))
    >>> model.optimizer.exclude_from_weight_decay(var_list=[model.layers[0].kernel], var_names=["bias"])
    >>> weight_decay_exclusions(model)
    ([0], 'bias')
    """
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    keys = getattr(optimizer, "_exclude_from_weight_decay", set())
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    positions = [i for i, variable in enumerate(model.trainable_variables) if optimizer._var_key(variable) in keys]
    return positions, None if pattern is None else pattern.pattern


def decayed_by(model):
    """For each of ``model.trainable_variables``, whether its optimizer's weight decay shrinks it (none without one,
    else all but those ``exclude_from_weight_decay`` names).

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer=keras.optimizers.AdamW(weight_decay=0.1))
    >>> model.optimizer.exclude_from_weight_decay(var_names=["bias"])
    >>> decayed_by(model)
    [True, False]
    """
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return [optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)
            for variable in model.trainable_variables]


def exclude_from_weight_decay(model, exclusions):
    """Give ``model``'s optimizer, built or not, the ``exclusions`` of :func:`weight_decay_exclusions`."""
    positions, pattern = exclusions
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    variables = model.trainable_variables
    optimizer._exclude_from_weight_decay = {optimizer._var_key(variables[i]) for i in positions}
    optimizer._exclude_from_weight_decay_pattern = None if pattern is None else re.compile(pattern)
    optimizer._exclude_from_weight_decay_cache = {}


def seed_generators(model):
    """The ``keras.random.SeedGenerator`` of each random layer of ``model`` (``Dropout`` and kin), in order."""
    return [generator for layer in model._flatten_layers() for generator in layer._seed_generators]


def draws_at_random(layer):
    """Whether ``layer`` (called in a model) draws random numbers in training and leaves its input's shape, with no
    weights: dropout, noise, a random flip or rotation; not a random crop, which changes the shape.

    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.RandomFlip(), keras.layers.GaussianNoise(0.1),
    ...                           keras.layers.RandomCrop(4, 4), keras.layers.Dense(2)])
    >>> [draws_at_random(layer) for layer in model.layers]
    [True, True, False, False]
    """
    if graph.is_operation(layer) or not layer._seed_generators or layer.weights:
        return False
    shape = tuple(layer.input.shape)
    return tuple(layer.compute_output_shape(shape)) == shape


def random_states(model):
    """The state variables of ``model``'s random layers (their :func:`seed_generators`), in order.

    Keras keeps them out of ``get_weights()`` and out of a saved model, and a
    clone draws new seeds from Python's ``random``, so without them a strategy's
    copy drops other units than ``fit`` would from the same
    ``keras.utils.set_random_seed``, and AsyncPS's coordinator process (whose
    Python ``random`` nobody seeded) others in every run.

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    >>> [(state.name, tuple(state.shape)) for state in random_states(model)]
    [('seed_generator_state', (2,))]
    """
    return [generator.state for generator in seed_generators(model)]


def set_random_states(model, values):
    """Assign ``values`` (from :func:`random_states` of a model of the same layers) to ``model``'s states."""
    states = random_states(model)
    if len(states) != len(values):
        raise ValueError(f"random layer states differ: {len(values)} given, {len(states)} in the model. "
                         f"Received: model={model.name}")
    for state, value in zip(states, values):
        state.assign(value)


def optimizer_state(optimizer):
    """The optimizer's variables (iterations, then each variable's slots), the learning rate excluded.

    A ``LossScaleOptimizer`` (mixed_float16) contributes its inner optimizer's
    state: the loss scale belongs to the run, not to the user's optimizer.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    return [v for v in optimizer.variables if v.name != "learning_rate"]


def learning_rate_schedule(optimizer):
    """The ``LearningRateSchedule`` that ``optimizer`` was given as its rate, else None (a rate to set).

    >>> schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    >>> learning_rate_schedule(keras.optimizers.SGD(schedule)) is schedule
    True
    >>> learning_rate_schedule(keras.optimizers.SGD(0.1)) is None
    True
    """
    rate = getattr(optimizer, "_learning_rate", None)  # Keras keeps the schedule there; `learning_rate` is its value
    return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else None


def _scaled_optimizer(optimizer, factor):
    config = keras.optimizers.serialize(optimizer)
    if factor == 1.0:
        return config
    learning_rate = config["config"]["learning_rate"]
    if not isinstance(learning_rate, (int, float)):
        raise ValueError("scale_lr needs an optimizer with a constant learning rate; pass scale_lr=None "
                         f"to keep a schedule. Received: learning_rate={learning_rate!r}")
    config["config"]["learning_rate"] = learning_rate * factor
    return config


def build_compiled_state(model, element_spec, scope):
    """Build ``model``'s compiled loss and metrics for batches like ``element_spec``, inside ``scope``.

    Keras builds them on the first batch it sees; strategies that cannot let it
    (their variables must exist before training, under the strategy) build them
    here from the dataset's element spec instead.
    """
    def symbolic(spec):
        return keras.KerasTensor(spec.shape, spec.dtype.name)

    with scope:
        model._symbolic_build(data_batch=tree.map_structure(symbolic, element_spec))
