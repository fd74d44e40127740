"""TensorFlow's fused optimizer kernels behind Keras 3 optimizers.

Keras 3 writes each optimizer's update as a chain of element-wise ops, each a
full pass over the variable's memory. TensorFlow has one kernel per update rule
(``ResourceApplyAdam`` and kin), which tf-keras 2 used. :func:`fuse` makes a
Keras optimizer apply its update through that kernel. Only ``update_step``
changes: gradient clipping, weight decay, gradient accumulation, EMA and
learning-rate schedules run around it as before, and the slots stay the Keras
optimizer's own variables, in its order, so its state moves to and from the
user's optimizer unchanged. The kernels run wherever the variable lives (on
every replica under ``MirroredStrategy``, on the parameter servers under
``ParameterServerStrategy``); DTensor runs them on each device's shard of a
DVariable, so the tensor-parallel mesh optimizer uses them too. Each kernel
holds its variables' locks (``use_locking``): ``AsyncPS``'s workers apply to
the same variables at once, and two unlocked updates interleave, so one
update's decay of a slot is lost while both add its momentum to the weights.

Optimizers, and the kernels they get:

- ``Adam`` and ``AdamW`` (weight decay runs before the kernel, as in Keras):
  ``ResourceApplyAdam``, or ``ResourceApplyAdamWithAmsgrad`` with ``amsgrad``;
- ``SGD``: ``ResourceApplyGradientDescent``, or with momentum (and Nesterov)
  ``ResourceApplyKerasMomentum``;
- ``RMSprop`` with momentum: ``ResourceApplyRMSProp``, or
  ``ResourceApplyCenteredRMSProp`` when ``centered``;
- ``Adagrad``: ``ResourceApplyAdagradV2``, with Keras's epsilon (added under the
  square root, where the kernel adds it outside) folded into the accumulator
  for the duration of the kernel.

Anything else keeps Keras's update: other optimizers, subclasses that override
``update_step``, ``RMSprop`` without momentum (every TensorFlow RMSProp kernel
keeps a momentum slot, which that Keras optimizer does not have), and variables
that are not float32/float64 resource variables.

The kernels take their hyperparameters in the variable's dtype, so they form
``1 - beta`` from float32 ``beta`` where Keras uses Python's double: for Adam's
``beta_2=0.999`` the second moment moves by 0.99998713e-3 of each step instead
of 1.0000000e-3, so it ends 1.3e-5 (relative) below Keras's, as in tf-keras 2.
The learning rate given to the kernel is corrected for it, so the weights, and
the other slots, agree with Keras's update to float32 rounding (1e-6).

>>> import keras, numpy as np
>>> optimizer = keras.optimizers.Adam(0.01)
>>> fuse(optimizer)
True
>>> variable = keras.Variable(np.ones(3, "float32"))
>>> optimizer.apply([np.full(3, 0.5, "float32")], [variable])
>>> variable.numpy().round(4)
array([0.99, 0.99, 0.99], dtype=float32)
>>> fuse(keras.optimizers.Lion())
False
"""

import functools
import typing

import keras
import numpy as np
import tensorflow as tf


class Rule(typing.NamedTuple):
    """A Keras optimizer's update as this package knows it: the slots each variable has, in Keras's order,
    with the Keras attribute that lists each slot's variables, and the TensorFlow kernel that applies the
    update, or None. The fused Keras optimizers (:func:`fuse`) and the tensor-parallel mesh optimizer read
    the same table, :data:`RULES`.

    A kernel is ``kernel(hyper, var, slots, grad, lr, iterations, scalar)``: ``hyper`` the optimizer's
    settings (``beta_1``, ``momentum``, ... as in its config), ``var`` the variable, ``slots`` its slot
    variables by name, ``iterations`` the steps taken before this one, and ``scalar(value)`` a
    hyperparameter as a scalar tensor of the variable's dtype where the kernel runs.
    """

    slots: tuple
    attributes: dict
    kernel: typing.Callable | None = None


def _rules():
    adam = Rule(("momentum", "velocity"),
                {"momentum": "_momentums", "velocity": "_velocities", "velocity_hat": "_velocity_hats"}, _adam)
    return {
        "SGD": Rule(("momentum",), {"momentum": "momentums"}, _sgd),
        "Adam": adam,
        "AdamW": adam,
        "RMSprop": Rule(("velocity", "momentum", "average_gradient"),
                        {"velocity": "_velocities", "momentum": "_momentums", "average_gradient": "_average_gradients"},
                        _rmsprop),
        "Adagrad": Rule(("accumulator",), {"accumulator": "_accumulators"}, _adagrad),
        "Adamax": Rule(("momentum", "norm"), {}),
        "Lion": Rule(("momentum",), {}),
    }


def fuse(optimizer):
    """Make ``optimizer`` apply its updates with a fused TensorFlow kernel; return whether it does.

    A ``LossScaleOptimizer`` (mixed_float16) has its inner optimizer fused.
    False means the optimizer keeps Keras's update (see the module's list).
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    kernel = _kernel(optimizer)
    if kernel is None:
        return False
    optimizer.update_step = functools.partial(_fused_update, kernel, optimizer, optimizer.update_step)
    return True


def _kernel(optimizer):
    """The fused update function for ``optimizer``'s rule and options, or None."""
    if isinstance(optimizer, keras.optimizers.RMSprop) and not optimizer.momentum:
        return None  # every TensorFlow RMSProp kernel keeps a momentum slot, which this optimizer lacks
    for keras_class in (keras.optimizers.Adam, keras.optimizers.SGD, keras.optimizers.RMSprop,
                        keras.optimizers.Adagrad):
        if type(optimizer).update_step is keras_class.update_step:
            return RULES[keras_class.__name__]
    return None


def _fused_update(rule, optimizer, keras_update, gradient, variable, learning_rate):
    """``update_step`` through ``rule``'s kernel; Keras's own where the kernel cannot take the variable or
    gradient."""
    dtype = variable.dtype
    if dtype not in (tf.float32, tf.float64) or not hasattr(variable, "handle") or isinstance(
            gradient, tf.IndexedSlices):
        return keras_update(gradient, variable, learning_rate)
    index = optimizer._get_variable_index(variable)
    slots = {name: getattr(optimizer, attribute)[index].value  # this replica's, inside a distributed update
             for name, attribute in rule.attributes.items() if getattr(optimizer, attribute, None)}
    return rule.kernel(vars(optimizer), variable, slots, tf.cast(gradient, dtype), tf.cast(learning_rate, dtype),
                       optimizer.iterations, functools.partial(tf.cast, dtype=dtype))


def _adam(hyper, var, slots, grad, lr, iterations, scalar):
    dtype = grad.dtype
    step = tf.cast(iterations + 1, dtype)
    beta_1, beta_2 = scalar(hyper["beta_1"]), scalar(hyper["beta_2"])
    arguments = {"var": var.handle, "m": slots["momentum"].handle, "v": slots["velocity"].handle,
                 "beta1_power": tf.pow(tf.cast(hyper["beta_1"], dtype), step),
                 "beta2_power": tf.pow(tf.cast(hyper["beta_2"], dtype), step),
                 "lr": lr * second_moment_correction(hyper["beta_2"], dtype), "beta1": beta_1, "beta2": beta_2,
                 "epsilon": scalar(hyper["epsilon"]), "grad": grad, "use_locking": True}
    if hyper.get("amsgrad"):
        return tf.raw_ops.ResourceApplyAdamWithAmsgrad(vhat=slots["velocity_hat"].handle, **arguments)
    return tf.raw_ops.ResourceApplyAdam(**arguments)


def second_moment_correction(beta_2, dtype):
    """The learning-rate factor that makes the kernel's Adam step Keras's, though its ``1 - beta_2`` differs.

    The kernel's second moment is Keras's times ``kernel_rate / keras_rate``
    (both are sums of squared gradients weighted by that rate), and the step
    divides by its square root.

    >>> round(second_moment_correction(0.999, tf.float32), 8), second_moment_correction(0.999, tf.float64)
    (0.99999354, 1.0)
    """
    real = dtype.as_numpy_dtype
    kernel_rate = real(1) - real(beta_2)
    keras_rate = real(1 - beta_2)
    return float(np.sqrt(np.float64(kernel_rate) / np.float64(keras_rate)))


def _sgd(hyper, var, slots, grad, lr, iterations, scalar):
    if not hyper["momentum"]:
        return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=grad, use_locking=True)
    return tf.raw_ops.ResourceApplyKerasMomentum(
        var=var.handle, accum=slots["momentum"].handle, lr=lr, grad=grad, momentum=scalar(hyper["momentum"]),
        use_nesterov=hyper["nesterov"], use_locking=True)


def _rmsprop(hyper, var, slots, grad, lr, iterations, scalar):
    arguments = {"var": var.handle, "ms": slots["velocity"].handle, "mom": slots["momentum"].handle, "lr": lr,
                 "rho": scalar(hyper["rho"]), "momentum": scalar(hyper["momentum"]),
                 "epsilon": scalar(hyper["epsilon"]), "grad": grad, "use_locking": True}
    if hyper["centered"]:
        return tf.raw_ops.ResourceApplyCenteredRMSProp(mg=slots["average_gradient"].handle, **arguments)
    return tf.raw_ops.ResourceApplyRMSProp(**arguments)


def _adagrad(hyper, var, slots, grad, lr, iterations, scalar):
    accumulator = slots["accumulator"]
    epsilon = tf.cast(hyper["epsilon"], grad.dtype)
    shifted = accumulator.assign_add(tf.fill(tf.shape(accumulator), epsilon), read_value=False)
    with tf.control_dependencies([shifted]):
        applied = tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=accumulator.handle, lr=lr,
                                                    epsilon=tf.zeros([], grad.dtype), grad=grad, use_locking=True)
    with tf.control_dependencies([applied]):
        return accumulator.assign_sub(tf.fill(tf.shape(accumulator), epsilon), read_value=False)


#: Every optimizer this package knows the update of, by Keras class name (see :class:`Rule`).
RULES = _rules()
