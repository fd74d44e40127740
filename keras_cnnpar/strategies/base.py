"""The strategy contract and the registry of string aliases.

Every strategy does three things (design §4):

1. ``prepare(model)``: rebuild the user's model for the strategy, carrying its
   weights, compile settings and optimizer state.
2. ``fit(prepared, train, **fit_kwargs)``: train the prepared model; return a ``History``.
3. ``finalize(prepared, model)``: copy the trained state back into the user's model.

Strings name strategies through a small registry:

>>> resolve("single")
<Single devices=1>
>>> resolve("nope")
Traceback (most recent call last):
ValueError: unknown strategy 'nope'; valid names are ['async-ps', 'channels', 'hybrid', 'layers', 'mirrored', 'multi-worker', 'single']. Received: strategy='nope'
"""

import contextlib
import copy
import inspect
import math

import keras

from keras_cnnpar import accumulation, rebuild

_REGISTRY = {}
SCALE_LR = {"linear": lambda n: float(n), "sqrt": math.sqrt, None: lambda n: 1.0}


class PeerLost(RuntimeError):
    """Training stopped because another task of the cluster (a worker, a parameter server) failed or went silent."""


def register(alias):
    """Class decorator: make ``alias`` a string name for the strategy class."""

    def decorate(cls):
        cls.alias = alias
        _REGISTRY[alias] = cls
        return cls

    return decorate


def names():
    """The registered aliases, sorted."""
    return sorted(_REGISTRY)


def resolve(strategy):
    """Return a strategy object for an object or an alias (built with its defaults)."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        return create(strategy)
    raise TypeError(f"strategy must be a cnnpar strategy object or one of {names()}. "
                    f"Received: strategy={strategy!r} of type {type(strategy).__name__}")


def accepts(alias, option):
    """Whether the strategy named ``alias`` takes ``option``.

    >>> accepts("mirrored", "devices"), accepts("single", "devices")
    (True, False)
    """
    return alias in _REGISTRY and option in inspect.signature(_REGISTRY[alias]).parameters


def create(alias, **options):
    """Build the strategy named ``alias`` from the options it accepts (the CLI's path).

    Options the strategy does not take must be unset (None); ``devices`` may be 1
    for a one-device strategy.
    """
    if alias not in _REGISTRY:
        raise ValueError(f"unknown strategy {alias!r}; valid names are {names()}. Received: strategy={alias!r}")
    rejected = {k: v for k, v in options.items() if not accepts(alias, k) and v not in (None, 1)}
    if rejected:
        key, value = next(iter(rejected.items()))
        raise ValueError(f"strategy {alias!r} takes no {key}. Received: {key}={value!r}")
    return _REGISTRY[alias](**{k: v for k, v in options.items() if accepts(alias, k) and v is not None})


def check_devices(devices):
    """Validate a ``devices`` option: a positive int or a non-empty list of device names."""
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(f"devices must be an int or a list of device names. Received: devices={devices!r}")
    if isinstance(devices, int) and devices < 1:
        raise ValueError(f"devices must be at least 1. Received: devices={devices}")
    if not isinstance(devices, int) and not devices:
        raise ValueError("devices must name at least one device. Received: devices=[]")
    return devices if isinstance(devices, int) else list(devices)


def check_scale_lr(scale_lr):
    """Validate a ``scale_lr`` option: ``"linear"``, ``"sqrt"`` or ``None`` (also spelled ``"none"``)."""
    scale_lr = None if scale_lr == "none" else scale_lr
    if scale_lr not in SCALE_LR:
        raise ValueError(f"scale_lr must be 'linear', 'sqrt' or None. Received: scale_lr={scale_lr!r}")
    return scale_lr


class Strategy:
    """Base class of every strategy: one device, Keras's own ``fit``.

    Subclasses supply ``_tf_strategy()`` (a ``tf.distribute.Strategy`` or None),
    or override ``prepare``/``fit``/``finalize`` when Keras's ``fit`` cannot
    run them.

    Args:
        steps_per_execution: training steps run per call into TensorFlow;
            Keras then calls batch-level callbacks once per that many steps.
        accumulate: each step takes ``accumulate`` micro-batches of
            ``batch_size`` and applies the mean of their gradients once (see
            ``cnnpar.accumulation``): the update of one step on an
            ``accumulate``-times larger batch, with one gradient sync.
    """

    alias = "strategy"
    #: A device count, or a list of device names.
    devices = 1
    num_replicas = 1
    scale_lr = None
    #: Only the chief writes logs, checkpoints and exports.
    is_chief = True
    #: Seed of the input shuffle; None follows TensorFlow's global seed.
    shuffle_seed = None

    def __init__(self, *, steps_per_execution=8, accumulate=1):
        for name, value in (("steps_per_execution", steps_per_execution), ("accumulate", accumulate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
        self.steps_per_execution = steps_per_execution
        self.accumulate = accumulate

    @property
    def num_devices(self):
        return self.devices if isinstance(self.devices, int) else len(self.devices)

    def __repr__(self):
        return f"<{type(self).__name__} devices={self.num_devices}>"

    def _tf_strategy(self):
        return None

    def scope(self):
        """The context under which the prepared model is built."""
        tf_strategy = self._tf_strategy()
        return tf_strategy.scope() if tf_strategy is not None else contextlib.nullcontext()

    def lr_factor(self):
        """How much ``scale_lr`` multiplies the learning rate for this many replicas."""
        return SCALE_LR[self.scale_lr](self.num_replicas)

    @property
    def local_devices(self):
        """How many logical devices this process needs (``cnnpar.devices.configure``)."""
        return self.num_devices

    def resume_epoch(self, initial_epoch):
        """The epoch to start at: ``initial_epoch``, or later when a checkpoint was restored."""
        return initial_epoch

    def report(self):
        """Text that describes the prepared layout (printed and logged before training), or None."""
        return None

    def prepare(self, model):
        """Rebuild ``model`` for this strategy, with its weights, compile settings and state."""
        return rebuild.rebuild(model, scope=self.scope(), lr_factor=self.lr_factor(),
                               steps_per_execution=self.steps_per_execution,
                               clone=accumulation.wrap(keras.models.clone_model, self.accumulate))

    def fit(self, prepared, train, **fit_kwargs):
        """Train ``prepared`` on the batched dataset ``train``; return Keras's ``History``."""
        return prepared.fit(self.distribute(train), shuffle=False, **fit_kwargs)

    def distribute(self, dataset):
        """``dataset`` (batched by the global batch) as this strategy's replicas read it in training."""
        tf_strategy = self._tf_strategy()
        return dataset if tf_strategy is None else tf_strategy.experimental_distribute_dataset(dataset)

    def replica_batches(self, dataset):
        """The images each replica of this process gets in the first step of ``dataset``, as numpy arrays."""
        x = next(iter(self.distribute(dataset)))[0]
        tf_strategy = self._tf_strategy()
        return [part.numpy() for part in (tf_strategy.experimental_local_results(x) if tf_strategy else [x])]

    def probe(self):
        """A copy of this strategy for a one-step check (``GradientParityCheck``) beside the real run."""
        return copy.copy(self)

    def finalize(self, prepared, model):
        """Copy the trained weights and optimizer state back into the user's ``model``."""
        rebuild.copy_state(prepared, model)
