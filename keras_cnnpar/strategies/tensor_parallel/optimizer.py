"""The optimizer of a DTensor mesh: a Keras optimizer's update rule on DVariables, its slots laid out like their
variables, its state moved to and from the Keras optimizer (:class:`MeshOptimizer`)."""

import typing

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_cnnpar.keras_compat import fused, rebuild
from keras_cnnpar.strategies.tensor_parallel.layers import to_mesh, to_numpy


class MeshOptimizer:
    """The update rule of a Keras SGD, Adam, AdamW, RMSprop, Adagrad, Adamax or Lion optimizer, on DVariables; each
    slot is laid out like its variable.

    Its state (``iterations``, then the slots in Keras's order: each
    variable's for SGD and Adam, each kind's for RMSprop) moves to and from
    the Keras optimizer, so training continues across strategies. The
    learning rate is read from the Keras optimizer every epoch, so schedules
    set by callbacks apply; a ``LearningRateSchedule`` given as the rate is
    evaluated at every step. Weight decay (AdamW's, or ``weight_decay`` of any
    of them) shrinks each variable the Keras optimizer decays (its
    ``exclude_from_weight_decay`` kept) before the update, as Keras does, after
    Keras's clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``). With
    ``use_kernels`` the updates of SGD and Adam run as TensorFlow's fused kernels
    (``ResourceApplyAdam``, ``ResourceApplyKerasMomentum``), which DTensor runs
    on each device's shard of a DVariable, with Keras's results (see
    ``cnnpar.fused``); RMSprop's, and a decayed variable's, are element-wise,
    each variable assigned once.

    Args:
        optimizer: the Keras optimizer whose rule and settings to run.
        variables: the DVariables it updates, in the Keras model's trainable order.
        decayed: for each of ``variables``, whether weight decay applies to it.
        use_kernels: whether SGD and Adam run as fused kernels.
    """

    #: The optimizers whose update runs as a fused kernel (``fused.RULES``) with ``use_kernels``; the others' are
    #: element-wise here. The slots of every optimizer come from ``fused.RULES``.
    FUSED: typing.ClassVar = ("SGD", "Adam", "AdamW")
    #: The optimizers whose slots Keras orders by kind (every variable's first slot, then every second), not by
    #: variable.
    BY_KIND: typing.ClassVar = ("RMSprop",)
    #: Settings these rules do not implement, with the value they must keep.
    DEFAULTS: typing.ClassVar = {
        "use_ema": False, "loss_scale_factor": None, "gradient_accumulation_steps": None, "amsgrad": False}

    def __init__(self, optimizer, variables, decayed=None, use_kernels=True):
        kind = type(optimizer).__name__
        if kind not in fused.RULES:
            raise ValueError(f"tensor-parallel training implements the optimizers {sorted(fused.RULES)}. "
                             f"Received: optimizer={kind}")
        self.kind, self.config, self.use_kernels = kind, optimizer.get_config(), use_kernels
        #: Keras's own clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``): on DVariables' gradients its
        #: norms are DTensor reductions over every shard, so a sharded gradient is clipped as a whole one is.
        self.clip = optimizer._clip_gradients
        for key, default in self.DEFAULTS.items():
            if self.config.get(key, default) != default:
                raise ValueError(f"tensor-parallel training does not implement {kind}'s {key}; leave it at "
                                 f"{default!r}. Received: {key}={self.config[key]!r}")
        #: A ``LearningRateSchedule`` given as the rate: evaluated at every step, as Keras does (else None).
        self.schedule = rebuild.learning_rate_schedule(optimizer)
        decays = decayed is not None and self.config["weight_decay"]
        self.decayed = list(decayed) if decays else [False] * len(variables)
        mesh = dtensor.fetch_layout(variables[0]).mesh
        self.scalar = dtensor.Layout.replicated(mesh, 0)
        self.iterations = dtensor.DVariable(to_mesh(np.int64(0), self.scalar), name="iterations")
        start = self.config.get("initial_accumulator_value", 0.0)  # Adagrad's accumulators start there
        self.slots = [{name: dtensor.DVariable(to_mesh(np.full(v.shape, start if name == "accumulator" else 0.0,
                                                               v.dtype.as_numpy_dtype), dtensor.fetch_layout(v)))
                       for name in self._slot_names()} for v in variables]

    def _slot_names(self):
        """The slots each variable has: SGD's momentum only with a momentum, RMSprop's only with a momentum and
        its average gradient only when centered."""
        names = fused.RULES[self.kind].slots
        if self.kind == "SGD":
            return names if self.config["momentum"] else ()
        if self.kind == "RMSprop":
            return tuple(name for name in names if name == "velocity" or (
                self.config["momentum"] if name == "momentum" else self.config["centered"]))
        return names

    def _slots_in_keras_order(self):
        if self.kind in self.BY_KIND:
            return [slots[name] for name in self._slot_names() for slots in self.slots]
        return [slot for slots in self.slots for slot in slots.values()]

    def get_state(self):
        """``[iterations, *slots]`` as numpy, in the Keras optimizer's order."""
        return [to_numpy(self.iterations), *(to_numpy(slot) for slot in self._slots_in_keras_order())]

    def set_state(self, state):
        """Load ``[iterations, *slots]`` (Keras's optimizer variables, learning rate excluded)."""
        self.iterations.assign(to_mesh(np.int64(state[0]), self.scalar))
        for variable, value in zip(self._slots_in_keras_order(), state[1:]):
            variable.assign(to_mesh(np.reshape(value, variable.shape), dtensor.fetch_layout(variable)))

    def apply(self, gradients, variables, learning_rate):
        """One update of ``variables`` (inside the training step's ``tf.function``).

        The rules compute each slot's new value as a tensor and use that, never
        read a slot back after assigning it: under DTensor a read on the 2-D mesh
        was not ordered after the assignment, and the variable missed its update.
        """
        iterations = self.iterations.read_value()
        gradients = self.clip(gradients)
        if self.schedule is not None:  # the epoch's rate passed in is the schedule's value at the epoch's start
            learning_rate = self.schedule(iterations)
        rule = {"SGD": self._sgd, "RMSprop": self._rmsprop, "Adagrad": self._adagrad, "Adamax": self._adamax,
                "Lion": self._lion}.get(self.kind, self._adam)
        fusable = self.use_kernels and self.kind in self.FUSED
        for gradient, variable, slots, decayed in zip(gradients, variables, self.slots, self.decayed):
            rate = tf.cast(learning_rate, variable.dtype)
            if fusable and not decayed:
                self._fused(gradient, variable, slots, rate, iterations)
                continue
            step = rule(gradient, slots, rate, iterations, variable.dtype)
            value = variable.read_value()
            if decayed:
                value = value - value * tf.cast(self.config["weight_decay"], variable.dtype) * rate
            variable.assign(value + step)
        self.iterations.assign(iterations + 1)

    def _sgd(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's SGD (its momentum slot assigned)."""
        if not slots:
            return -gradient * learning_rate
        momentum = self.config["momentum"]
        m = slots["momentum"] * momentum - gradient * learning_rate
        slots["momentum"].assign(m)
        return m * momentum - gradient * learning_rate if self.config["nesterov"] else m

    def _adam(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's Adam (its slots assigned)."""
        beta_1, beta_2 = self.config["beta_1"], self.config["beta_2"]
        beta_1_power, beta_2_power = self._beta_powers(iterations, dtype)
        alpha = learning_rate * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = slots["momentum"] + (gradient - slots["momentum"]) * (1 - beta_1)
        v = slots["velocity"] + (tf.square(gradient) - slots["velocity"]) * (1 - beta_2)
        slots["momentum"].assign(m)
        slots["velocity"].assign(v)
        return -m * alpha / (tf.sqrt(v) + self.config["epsilon"])

    def _rmsprop(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's RMSprop (its slots assigned)."""
        rho, epsilon = self.config["rho"], self.config["epsilon"]
        velocity = rho * slots["velocity"] + (1 - rho) * tf.square(gradient)
        slots["velocity"].assign(velocity)
        denominator = velocity + epsilon
        if "average_gradient" in slots:
            average = rho * slots["average_gradient"] + (1 - rho) * gradient
            slots["average_gradient"].assign(average)
            denominator = velocity - tf.square(average) + epsilon
        increment = learning_rate * gradient / tf.sqrt(denominator)
        if "momentum" in slots:
            increment = self.config["momentum"] * slots["momentum"] + increment
            slots["momentum"].assign(increment)
        return -increment

    def _adagrad(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's Adagrad (its accumulator assigned)."""
        accumulator = slots["accumulator"] + tf.square(gradient)
        slots["accumulator"].assign(accumulator)
        return -learning_rate * gradient / tf.sqrt(accumulator + self.config["epsilon"])

    def _adamax(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's Adamax (its slots assigned)."""
        beta_1 = self.config["beta_1"]
        beta_1_power = tf.pow(tf.cast(beta_1, dtype), tf.cast(iterations + 1, dtype))
        m = slots["momentum"] + (gradient - slots["momentum"]) * (1 - beta_1)
        u = tf.maximum(self.config["beta_2"] * slots["norm"], tf.abs(gradient))
        slots["momentum"].assign(m)
        slots["norm"].assign(u)
        return -learning_rate * m / ((1 - beta_1_power) * (u + self.config["epsilon"]))

    def _lion(self, gradient, slots, learning_rate, iterations, dtype):
        """The change of the variable by Keras's Lion (its momentum assigned)."""
        beta_1, beta_2, m = self.config["beta_1"], self.config["beta_2"], slots["momentum"]
        step = -learning_rate * tf.sign(m * beta_1 + gradient * (1.0 - beta_1))
        m.assign(m * beta_2 + gradient * (1.0 - beta_2))
        return step

    def _fused(self, gradient, variable, slots, learning_rate, iterations):
        """SGD's or Adam's update of ``variable`` by TensorFlow's fused kernel (``fused.RULES``)."""
        dtype = variable.dtype
        fused.RULES[self.kind].kernel(self.config, variable, slots, gradient, learning_rate, iterations,
                                      lambda value: self._scalar(value, dtype))

    def _beta_powers(self, iterations, dtype):
        """Adam's ``beta_1`` and ``beta_2`` to the power of the step being taken (``iterations + 1``)."""
        step = tf.cast(iterations + 1, dtype)
        return (tf.pow(tf.cast(self.config[beta], dtype), step) for beta in ("beta_1", "beta_2"))

    def _scalar(self, value, dtype):
        """A hyperparameter as a replicated scalar of ``dtype`` on the mesh, as the kernels take it."""
        return to_mesh(np.asarray(value, dtype.as_numpy_dtype), self.scalar)
