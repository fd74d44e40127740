"""The strategy contract, the registry's runtime half, and the base of strategies that keep checkpoints.

Every strategy does three things:

1. ``prepare(model)``: rebuild the user's model for the strategy, carrying its
   weights, compile settings and optimizer state.
2. ``fit(prepared, train, **fit_kwargs)``: train the prepared model; return a ``History``.
3. ``finalize(prepared, model)``: copy the trained state back into the user's model.

Strings name strategies through the registry (:mod:`keras_cnnpar.registry`):

>>> resolve("single")
<Single devices=1>
>>> resolve("nope")  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: unknown strategy 'nope'; valid names are ['async-ps', 'channels', ...]. Received: strategy='nope'
"""

import contextlib
import copy
from pathlib import Path

import keras

from keras_cnnpar import accumulation, arguments, rebuild, registry, runs

names = registry.names


class PeerLost(RuntimeError):
    """Training stopped because another task of the cluster (a worker, a parameter server) failed or went silent."""


def register(alias):
    """Class decorator: make ``alias`` the string name of the strategy class.

    The registry finds the decorated class in the source of the strategies
    package; its facts are the class attributes documented in
    :mod:`keras_cnnpar.registry`.
    """

    def decorate(cls):
        cls.alias = alias
        return cls

    return decorate


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
    return alias in names() and option in registry.entry(alias).options


def create(alias, **options):
    """Build the strategy named ``alias`` from the options it accepts (the CLI's path).

    Options the strategy does not take must be unset (None); ``devices`` may be 1
    for a one-device strategy.
    """
    entry = registry.entry(alias)
    rejected = {k: v for k, v in options.items() if k not in entry.options and v not in (None, 1)}
    if rejected:
        key, value = next(iter(rejected.items()))
        raise ValueError(f"strategy {alias!r} takes no {key}. Received: {key}={value!r}")
    return entry.load()(**{k: v for k, v in options.items() if k in entry.options and v is not None})


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
    #: Registry facts (see keras_cnnpar.registry): a one-line description, the valid device counts, the
    #: `cnnpar train` option that sets the count, and whether the strategy keeps checkpoints to resume.
    description = ""
    min_devices, max_devices, device_multiple = 1, None, 1
    device_option = "devices"
    keeps_checkpoints = False
    #: A device count, or a list of device names.
    devices = 1
    num_replicas = 1
    scale_lr = None
    #: Only the chief writes logs, checkpoints and exports.
    is_chief = True
    #: Seed of the input shuffle; None follows TensorFlow's global seed.
    shuffle_seed = None
    #: The Keras dtype policy the prepared model computes in; ``cnnpar.fit(precision=...)`` sets it.
    precision = "float32"
    #: Whether the prepared model's optimizer uses TensorFlow's fused kernels; ``cnnpar.fit(fused_optimizer=...)``.
    fused_optimizer = True
    #: Whether BatchNormalization computes its batch statistics over the global batch (data-parallel strategies).
    sync_batchnorm = False
    #: None when batch-level callbacks run at every step; else how the strategy calls them instead.
    batch_hooks = None

    def __init__(self, *, steps_per_execution=8, accumulate=1):
        self.steps_per_execution = arguments.positive_int("steps_per_execution", steps_per_execution)
        self.accumulate = arguments.positive_int("accumulate", accumulate)

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
        return arguments.SCALE_LR[self.scale_lr](self.num_replicas)

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
        clone = rebuild.clone_synchronized if self.sync_batchnorm else keras.models.clone_model
        return rebuild.rebuild(model, scope=self.scope(), lr_factor=self.lr_factor(),
                               steps_per_execution=self.steps_per_execution, precision=self.precision,
                               fused_optimizer=self.fused_optimizer, clone=accumulation.wrap(clone, self.accumulate))

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

    def reload(self, prepared):
        """Train on from the weights and optimizer state of ``prepared``, changed since ``prepare`` (a
        callback restored a backup into it). ``prepared`` is what trains here, so there is nothing to do."""

    def finalize(self, prepared, model):
        """Copy the trained weights and optimizer state back into the user's ``model``."""
        rebuild.copy_state(prepared, model)


class CheckpointedStrategy(Strategy):
    """Base of strategies that keep a checkpoint of each run and can resume it (``MultiWorker``, ``AsyncPS``).

    It owns the checkpoint's lifecycle: the options (``checkpoint_dir``,
    ``resume``, ``timeout``), one folder per run configuration, the epoch to
    resume at, the "resumed from" line of the report, and the removal of the
    checkpoint once the trained state is back in the user's model. A subclass
    sets ``self.run_checkpoint`` in ``prepare`` (an object with
    ``directory``, ``completed_epochs`` and ``remove()``).
    """

    keeps_checkpoints = True

    def __init__(self, *, checkpoint_dir, resume, timeout, **options):
        super().__init__(**options)
        self.checkpoint_dir = arguments.folder_or_none("checkpoint_dir", checkpoint_dir)
        self.resume = bool(resume)
        self.timeout = arguments.positive_seconds("timeout", timeout)
        self.run_checkpoint = None
        #: What the checkpoint records of the run (``cnnpar.fit`` sets it); resuming must match it.
        self.run_config = {}

    def checkpoint_folder(self, prepared):
        """The folder of this run configuration's checkpoint."""
        return Path(self.checkpoint_dir) / runs.run_file_name(prepared.name, self.alias, self.devices, "")

    def build_optimizer(self, prepared):
        """Create the optimizer's variables under the strategy, so the checkpoint holds them from the start."""
        with self.scope():
            prepared.optimizer.build(prepared.trainable_variables)

    def resume_epoch(self, initial_epoch):
        completed = self.run_checkpoint.completed_epochs if self.run_checkpoint is not None else 0
        return max(initial_epoch, completed)

    def resumed_line(self):
        """The report's line about a restored checkpoint, or None."""
        run = self.run_checkpoint
        if run is None or not run.completed_epochs:
            return None
        return f"resumed from {run.directory} after epoch {run.completed_epochs}"

    def finalize(self, prepared, model):
        super().finalize(prepared, model)
        if self.run_checkpoint is not None:
            self.run_checkpoint.remove()
