"""Fused optimizer kernels: Keras's results, in Keras's state layout, under every strategy that uses them."""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import fused
from tests.helpers import build_small_cnn, max_weight_difference

#: Float32 rounding: the kernel and Keras round the same formula in different places (a fused multiply-add,
#: ``m + (g - m) * (1 - b)`` against ``b * m + (1 - b) * g``), each op to half an ulp (6e-8 relative).
ROUNDING = 1e-6
#: Adam's second moment: TensorFlow's kernel forms ``1 - beta_2`` from float32 ``beta_2`` (0.99998713e-3 for
#: 0.999) where Keras rounds Python's ``1 - beta_2`` (1.0000000e-3), so the kernel's ``v`` is 1.3e-5 smaller by
#: construction (see ``cnnpar.fused``); everything else agrees to ``ROUNDING``.
ADAM_SECOND_MOMENT = 2e-5

SCHEDULE = {"class_name": "ExponentialDecay",
            "config": {"initial_learning_rate": 0.05, "decay_steps": 3, "decay_rate": 0.5}}
OPTIMIZERS = {
    "adam": (keras.optimizers.Adam, {"learning_rate": 0.01}),
    "adam-amsgrad": (keras.optimizers.Adam, {"learning_rate": 0.01, "amsgrad": True}),
    "adam-schedule": (keras.optimizers.Adam, {"learning_rate": SCHEDULE}),
    "adamw": (keras.optimizers.AdamW, {"learning_rate": 0.01, "weight_decay": 0.1}),
    "adam-clipnorm-ema": (keras.optimizers.Adam, {"learning_rate": 0.01, "clipnorm": 0.1, "use_ema": True,
                                                  "ema_overwrite_frequency": 4}),
    "adam-accumulate": (keras.optimizers.Adam, {"learning_rate": 0.01, "gradient_accumulation_steps": 2}),
    "sgd": (keras.optimizers.SGD, {"learning_rate": 0.1}),
    "sgd-momentum": (keras.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9}),
    "sgd-nesterov": (keras.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "sgd-nesterov-schedule": (keras.optimizers.SGD, {"learning_rate": SCHEDULE, "momentum": 0.9, "nesterov": True}),
    "rmsprop-momentum": (keras.optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.5}),
    "rmsprop-centered": (keras.optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
    "adagrad": (keras.optimizers.Adagrad, {"learning_rate": 0.1}),
    "adagrad-schedule": (keras.optimizers.Adagrad, {"learning_rate": SCHEDULE}),
}
SHAPES = [(5, 5, 1, 8), (8,), (200, 10)]


def train(kind, steps, fuse):
    """``steps`` updates of ``kind`` on fixed weights and gradients; the weights and the optimizer's variables."""
    cls, config = OPTIMIZERS[kind]
    config = {**config, "learning_rate": keras.optimizers.schedules.deserialize(config["learning_rate"])
              if isinstance(config["learning_rate"], dict) else config["learning_rate"]}
    optimizer = cls(**config)
    if fuse:
        assert fused.fuse(optimizer)
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(0, 0.1, shape).astype("float32")) for shape in SHAPES]
    gradients = [[rng.normal(0, 0.01, shape).astype("float32") for shape in SHAPES] for _ in range(steps)]
    apply = tf.function(lambda grads: optimizer.apply(grads, variables))
    for step in gradients:
        apply([tf.constant(g) for g in step])
    slots = [(re.sub(r"^variable(_\d+)?_", "", v.name), v.numpy()) for v in optimizer.variables]  # "momentum", ...
    return [v.numpy() for v in variables], slots


def relative(fused_value, keras_value):
    keras_value = np.asarray(keras_value, "float64")
    scale = np.max(np.abs(keras_value)) or 1.0
    return float(np.max(np.abs(np.asarray(fused_value, "float64") - keras_value)) / scale)


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_fused_update_matches_keras(kind, steps):
    keras_weights, keras_slots = train(kind, steps, fuse=False)
    fused_weights, fused_slots = train(kind, steps, fuse=True)
    assert max(relative(f, k) for f, k in zip(fused_weights, keras_weights)) <= ROUNDING
    moved = max(relative(f, k) for f, k in zip(fused_weights, train(kind, 0, fuse=False)[0]))
    assert moved > 1e-3 or (kind == "adam-accumulate" and steps == 1)  # its first step only accumulates
    # Keras's layout: the same variables, in the same order, of the same shapes
    assert [(name, value.shape) for name, value in fused_slots] == [(name, value.shape) for name, value in keras_slots]
    for (name, value), (_, keras_value) in zip(fused_slots, keras_slots):
        tolerance = ADAM_SECOND_MOMENT if kind.startswith("adam") and "velocity" in name else ROUNDING
        assert relative(value, keras_value) <= tolerance, name


@pytest.mark.parametrize("optimizer", [keras.optimizers.Lion(), keras.optimizers.RMSprop(),
                                       keras.optimizers.Adamax(), keras.optimizers.Nadam()],
                         ids=lambda optimizer: type(optimizer).__name__)
def test_optimizers_without_a_kernel_keep_the_keras_update(optimizer):
    assert not fused.fuse(optimizer)
    assert not isinstance(optimizer.update_step, functools.partial)


def test_a_subclass_that_overrides_the_update_keeps_it():
    class Custom(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient, variable, learning_rate)

    assert not fused.fuse(Custom())
    assert fused.fuse(type("Plain", (keras.optimizers.SGD,), {})())  # a subclass that keeps the rule is fused


@pytest.mark.parametrize("strategy", ["single", "mirrored", cnnpar.LayerPlacement(2)], ids=str)
def test_strategies_train_with_the_fused_kernel_unless_told_not_to(strategy):
    for fused_optimizer in (True, False):
        model = build_small_cnn(optimizer=keras.optimizers.Adam(0.01))
        settings = cnnpar.strategies.RunSettings(fused_optimizer=fused_optimizer)
        prepared = cnnpar.strategies.resolve(strategy).prepare(model, settings).model
        assert isinstance(prepared.optimizer.update_step, functools.partial) == fused_optimizer


@pytest.mark.parametrize("strategy", ["single", "mirrored", cnnpar.LayerPlacement(2, microbatches=2),
                                      cnnpar.ChannelSharded(2), cnnpar.Hybrid(2, 2)], ids=str)
def test_one_fused_step_under_a_strategy_matches_the_keras_update(strategy, few_digits):
    x, y = few_digits[0][:64], few_digits[1][:64]
    models = {}
    for fused_optimizer in (True, False):
        models[fused_optimizer] = build_small_cnn(seed=1, optimizer=keras.optimizers.Adam(0.01))
        cnnpar.fit(models[fused_optimizer], x, y, strategy=strategy, batch_size=64, shuffle=False, verbose=0,
                   results_dir=None, fused_optimizer=fused_optimizer)
    step = max_weight_difference(models[True], build_small_cnn(seed=1))
    assert max_weight_difference(models[True], models[False]) <= 1e-5 * step


@pytest.mark.parametrize("kind", ["adam", "adam-amsgrad", "sgd", "sgd-nesterov", "rmsprop-centered", "adagrad"])
def test_every_fused_kernel_holds_its_variables_locks(kind):
    """AsyncPS's workers apply to the same variables at once: unlocked, one update's slot decay gets lost."""
    cls, config = OPTIMIZERS[kind]
    optimizer = cls(**config)
    assert fused.fuse(optimizer)
    variables = [keras.Variable(np.zeros(shape, "float32")) for shape in SHAPES]
    apply = tf.function(lambda grads: optimizer.apply(grads, variables))
    graph = apply.get_concrete_function([tf.TensorSpec(shape, tf.float32) for shape in SHAPES]).graph
    kernels = [op for op in graph.get_operations() if op.type.startswith("ResourceApply")]
    assert len(kernels) == len(SHAPES), [op.type for op in graph.get_operations()]
    assert [op.get_attr("use_locking") for op in kernels] == [True] * len(SHAPES)


def test_fit_applies_the_fused_kernels_by_default_and_keras_update_when_told(few_digits, monkeypatch):
    """README: every strategy applies the optimizer's update with TensorFlow's fused kernels; fused_optimizer=False
    keeps Keras's element-wise update."""
    prepared, prepare = [], cnnpar.Single.prepare

    def recorded(strategy, model, settings=None):
        prepared.append(prepare(strategy, model, settings))
        return prepared[-1]

    monkeypatch.setattr(cnnpar.Single, "prepare", recorded)
    x, y = few_digits[0][:64], few_digits[1][:64]
    for given in ({}, {"fused_optimizer": False}):
        cnnpar.fit(build_small_cnn(optimizer=keras.optimizers.Adam(0.01)), x, y, strategy="single", batch_size=64,
                   verbose=0, results_dir=None, **given)
    assert [isinstance(run.model.optimizer.update_step, functools.partial) for run in prepared] == [True, False]
