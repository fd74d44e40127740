"""The strategy contract, the registry's runtime half, and the base of strategies that keep checkpoints.

A strategy is a configuration: it holds what its constructor took, and no
training changes it. A training is a :class:`Run`:

1. ``strategy.prepare(model, settings)``: rebuild the user's model for the
   strategy, carrying its weights, compile settings and optimizer state; return
   the :class:`Run` that owns the prepared copy and everything else of this one
   training (mesh, stages, checkpoint, ...). ``settings`` (:class:`RunSettings`)
   holds what belongs to the ``fit`` call: precision, fused updates, resume.
2. ``run.fit(train, **fit_kwargs)``: train the prepared model; return a ``History``.
3. ``run.finalize(model)``: copy the trained state back into the user's model.

>>> strategy = resolve("single")
>>> strategy.accumulate = 2  # doctest: +ELLIPSIS
Traceback (most recent call last):
AttributeError: <Single devices=1> is a configuration: it does not change after it is created; ...

Strings name strategies through the registry (:mod:`keras_cnnpar.strategies.registry`):

>>> resolve("single")
<Single devices=1>
>>> resolve("nope")  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: unknown strategy 'nope'; valid names are ['async-ps', 'channels', ...]. Received: strategy='nope'
"""

import contextlib
import copy
import dataclasses
import inspect
import types
import warnings
from pathlib import Path

import keras
import tensorflow as tf

from keras_cnnpar.cluster import traffic
from keras_cnnpar.keras_compat import accumulation, rebuild
from keras_cnnpar.results import checkpoints, runs
from keras_cnnpar.strategies import arguments, compression, memory, registry

names = registry.names


class PeerLost(RuntimeError):
    """Training stopped because another task of the cluster (a worker, a parameter server) failed or went silent."""


def register(alias):
    """Class decorator: make ``alias`` the string name of the strategy class.

    The registry finds the decorated classes of this package in their source,
    without importing them; a class defined anywhere else registers when it is
    created. Its facts are the class attributes documented in
    :mod:`keras_cnnpar.strategies.registry`.
    """

    def decorate(cls):
        cls.alias = alias
        if not cls.__module__.startswith(f"{__package__}."):  # a user's strategy: registered now
            registry.add(cls)
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
    rejected = {k: v for k, v in options.items() if k not in entry.options and v is not None
                and not (k == "devices" and type(v) is int and v == 1)}
    if rejected:
        key, value = next(iter(rejected.items()))
        raise ValueError(f"strategy {alias!r} takes no {key}. Received: {key}={value!r}")
    return entry.load()(**{k: v for k, v in options.items() if k in entry.options and v is not None})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What one ``fit`` call adds to a strategy's configuration; a value, never changed.

    Args:
        precision: the Keras dtype policy the prepared model computes in.
        fused_optimizer: whether the prepared optimizer uses TensorFlow's fused kernels.
        resume: restore the checkpoint of an interrupted run (strategies that keep one).
        record: what a checkpoint records of its run (model, data, batch, ...); a resume must match it.
    """

    precision: str = "float32"
    fused_optimizer: bool = True
    resume: bool = False
    record: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        object.__setattr__(self, "record", types.MappingProxyType(dict(self.record)))

    def as_dict(self):
        """The settings as plain values (JSON-ready); ``RunSettings(**settings.as_dict())`` is the same value.

        >>> RunSettings(record={"model": "m"}).as_dict()["record"]
        {'model': 'm'}
        """
        return {**{field.name: getattr(self, field.name) for field in dataclasses.fields(self)},
                "record": dict(self.record)}


class _Configuration(type):
    """Metaclass of strategies: an instance is read-only once its constructor has returned."""

    def __call__(cls, *args, **kwargs):
        instance = super().__call__(*args, **kwargs)
        given = inspect.signature(cls).bind(*args, **kwargs)
        given.apply_defaults()
        object.__setattr__(instance, "given_options", types.MappingProxyType(dict(given.arguments)))
        object.__setattr__(instance, "_configured", True)
        return instance

    @property
    def __signature__(cls):
        """The constructor's parameters (what ``inspect.signature`` and the registry read)."""
        signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


class Strategy(metaclass=_Configuration):
    """Base class of every strategy: one device, Keras's own ``fit``.

    A strategy is a configuration: its attributes are set by its constructor
    and never change after (``replace`` makes a changed copy). Everything of
    one training lives in the :class:`Run` that ``prepare`` returns.
    Subclasses supply ``_tf_strategy()`` (a ``tf.distribute.Strategy`` or None),
    or a ``Run`` subclass when Keras's ``fit`` cannot run them.

    Args:
        steps_per_execution: training steps run per call into TensorFlow;
            Keras then calls batch-level callbacks once per that many steps.
        accumulate: each step takes ``accumulate`` micro-batches of
            ``batch_size`` and applies the mean of their gradients once (see
            ``cnnpar.accumulation``): the update of one step on an
            ``accumulate``-times larger batch, with one gradient sync.
    """

    alias = "strategy"
    #: Registry facts (see keras_cnnpar.strategies.registry): a one-line description, the valid device counts, the
    #: `cnnpar train` option that sets the count, whether the strategy keeps checkpoints to resume, and
    #: whether it trains on a cluster of TensorFlow servers (processes beyond the caller's).
    description = ""
    min_devices, max_devices, device_multiple = 1, None, 1
    device_option = "devices"
    keeps_checkpoints = False
    needs_cluster = False
    #: A device count, or a list of device names.
    devices = 1
    num_replicas = 1
    scale_lr = None
    #: Only the chief writes logs, checkpoints and exports.
    is_chief = True
    #: Seed of the input shuffle; None follows TensorFlow's global seed.
    shuffle_seed = None
    #: Whether every run resumes from its checkpoint (strategies that keep one take it as an option).
    resume = False
    #: Whether BatchNormalization computes its batch statistics over the global batch (data-parallel strategies).
    sync_batchnorm = False
    #: None when batch-level callbacks run at every step; else how the strategy calls them instead.
    batch_hooks = None
    #: Whether the prepared copy trains under a tf.distribute strategy, where Keras's gradient_accumulation_steps
    #: and ema_overwrite_frequency fail, and whether its optimizer's update all-reduces the replicas' gradients
    #: (the mirrored strategies).
    trains_under_tf_distribute = all_reduces_gradients = False
    #: How its gradients travel between replicas (None: whole, in their own dtype), and PowerSGD's rank; see the
    #: ``compression`` options.
    compression = powersgd_rank = None
    #: Whether the training steps run in this process (a profiler here sees them; not so for async-ps's workers).
    steps_run_here = True
    #: Whether this process trains at all (False: a worker that waits for the chief's training and receives its
    #: weights, its callbacks not called).
    trains_here = True
    #: What the planner's advice suggests when the devices sit idle through much of a step.
    idle_remedy = "a larger batch"
    #: The constructor's arguments as given, defaults filled in (set when the object is created).
    given_options = types.MappingProxyType({})

    def memory_split(self, model, batch_size):
        """How this strategy divides ``model``'s memory over its devices at the global ``batch_size`` (a
        :class:`memory.MemorySplit`; :func:`memory.estimate` turns it into bytes): by default each device holds
        the whole model and ``batch_size / devices`` examples of a step.

        >>> import keras_cnnpar as cnnpar
        >>> resolve("mirrored").memory_split(cnnpar.models.cnn("3+3"), batch_size=64).batch
        32.0
        """
        return memory.replicated(model, batch_size / self.num_devices)

    def epoch_events(self, row):
        """What happened in the epoch whose logged figures are ``row``, as lines for ``results.log``; none here."""
        return []

    @classmethod
    def configurations(cls, devices, batch_size):
        """The options of each configuration this strategy offers the planner on ``devices`` devices (tuples of
        ``(option, value)``), none where it cannot run; one on all the devices by default.

        >>> from keras_cnnpar import strategies
        >>> strategies.DataParallel.configurations(2, batch_size=64), strategies.DataParallel.configurations(1, 64)
        ([(('devices', 2),)], [])
        >>> strategies.Single.configurations(2, batch_size=64)
        [()]
        """
        if devices < 2 or registry.invalid(cls, devices):
            return []
        return [((cls.device_option, devices),)]

    @classmethod
    def host_step(cls, hosts, compute_seconds, link, gradient_bytes):
        """One step of this strategy on ``hosts`` hosts joined by ``link`` (a :class:`traffic.Link`), as a
        :class:`traffic.HostStep`, where one host computes the step of the global batch in ``compute_seconds``
        and the model's gradient (and weights) is ``gradient_bytes``; None where it does not train across hosts.
        On one host, every strategy's step is that host's.

        >>> from keras_cnnpar import strategies
        >>> strategies.Single.host_step(1, 0.04, traffic.Link.parse("1gbit"), 10**6)
        HostStep(compute_seconds=0.04, communication_seconds=0.0, parallel_steps=1.0, images_factor=1)
        >>> strategies.Single.host_step(2, 0.04, traffic.Link.parse("1gbit"), 10**6) is None
        True
        """
        return traffic.HostStep(compute_seconds) if hosts == 1 else None

    def __init__(self, *, steps_per_execution=8, accumulate=1):
        self.steps_per_execution = arguments.positive_int("steps_per_execution", steps_per_execution)
        self.accumulate = arguments.positive_int("accumulate", accumulate)

    def __setattr__(self, name, value):
        if getattr(self, "_configured", False):
            raise AttributeError(f"{self!r} is a configuration: it does not change after it is created; create "
                                 f"another strategy, or use strategy.replace({name}=...). Received: {name}={value!r}")
        object.__setattr__(self, name, value)

    def replace(self, **options):
        """A copy of this strategy with other values of some constructor options that it stores as given.

        >>> resolve("single").replace(accumulate=4).accumulate
        4
        """
        unknown = sorted(set(options) - set(inspect.signature(type(self)).parameters))
        if unknown:
            raise ValueError(f"{type(self).__name__} takes no option {unknown[0]!r}. Received: {options}")
        changed = copy.copy(self)
        for name, value in options.items():
            object.__setattr__(changed, name, value)
        object.__setattr__(changed, "given_options", types.MappingProxyType({**self.given_options, **options}))
        return changed

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

    def xla_refusal(self):
        """Why a step of this strategy cannot be compiled by XLA (``jit_compile=True``), or None when it can."""
        return None

    @property
    def batch_pieces(self):
        """Into how many pieces a step cuts each batch, every one computed apart: the replicas tf.distribute
        splits it over (DataParallel, MultiWorker) or the micro-batches of a pipeline (LayerPlacement); 1 here."""
        return 1

    @property
    def smallest_batch(self):
        """The fewest examples a training batch can hold: one per piece (:attr:`batch_pieces`), times the
        micro-batches of ``accumulate``. An empty piece fails TensorFlow's oneDNN gradients (an
        ``InvalidArgumentError``, or the process aborts in ``MklMaxPoolingGradOp``), under Keras's own ``fit`` too.

        >>> resolve("mirrored").smallest_batch, resolve("single").replace(accumulate=4).smallest_batch
        (2, 4)
        """
        return self.batch_pieces * self.accumulate

    def training_record(self):
        """The options that change how this strategy trains, as a checkpoint records them: a resume must keep
        each one.

        >>> resolve("single").training_record()
        {'scale_lr': None, 'accumulate': 1, 'compression': None, 'powersgd_rank': None}
        """
        return {"scale_lr": self.scale_lr, "accumulate": self.accumulate, "compression": self.compression,
                "powersgd_rank": self.powersgd_rank}

    def lr_factor(self):
        """How much ``scale_lr`` multiplies the learning rate for this many replicas."""
        return arguments.SCALE_LR[self.scale_lr](self.num_replicas)

    @property
    def local_devices(self):
        """How many logical devices this process needs (``cnnpar.devices.configure``)."""
        return self.num_devices

    def prepare(self, model, settings=None):
        """Rebuild ``model`` for this strategy (weights, compile settings, state); return the :class:`Run`."""
        settings = settings or RunSettings()
        return Run(self, settings, self.prepared_copy(model, settings))

    def prepared_copy(self, model, settings, clone=None):
        """The prepared copy of ``model``: built under ``scope()``, with ``settings``' precision and updates."""
        if clone is None:
            clone = rebuild.clone_synchronized if self.sync_batchnorm else keras.models.clone_model
        self._refuse_what_fails_under_tf_distribute(model.optimizer)
        refusal = self.xla_refusal() if getattr(model, "jit_compile", False) is True else None
        if refusal:
            warnings.warn(f"{type(self).__name__} trains with jit_compile=False: {refusal}", stacklevel=4)
        over_replicas = summed_over_replicas if self.all_reduces_gradients else None  # parts weighed by share
        prepared = rebuild.rebuild(model, scope=self.scope(), lr_factor=self.lr_factor(),
                                   steps_per_execution=self.steps_per_execution, precision=settings.precision,
                                   fused_optimizer=settings.fused_optimizer, jit_compile=False if refusal else None,
                                   clone=accumulation.wrap(clone, self.accumulate, over_replicas))
        if self.all_reduces_gradients:
            sum_over_replicas(prepared.optimizer, self._gradient_sum(prepared))
            draw_apart_on_each_replica(prepared)
        return prepared

    def _gradient_sum(self, model):
        """The all-reduce of ``model``'s gradients as ``compression`` sends them (None: Keras's own)."""
        if self.compression is None:
            return None
        if self.compression == "bfloat16":
            return compression.reducer("bfloat16")
        optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        clipping = [name for name in ("clipnorm", "global_clipnorm", "clipvalue") if getattr(optimizer, name)]
        if clipping:
            raise ValueError(f"compression='powersgd' cannot clip the summed gradients yet; leave the optimizer's "
                             f"{clipping[0]} at None, or give compression='bfloat16' or None. "
                             f"Received: {clipping[0]}={getattr(optimizer, clipping[0])}")
        compression.check_rank(self.powersgd_rank, model.trainable_variables)
        with self.scope():
            powersgd = compression.PowerSGD(model.trainable_variables, self.powersgd_rank, key=optimizer._var_key)
        powersgd.kept_by(optimizer)  # its state is the optimizer's, as the slots are: the checkpoints hold it
        return powersgd.summed

    def _refuse_what_fails_under_tf_distribute(self, optimizer):
        """Refuse the optimizer's settings that Keras runs in a ``cond`` around a ``merge_call``, which fails under
        tf.distribute: ``gradient_accumulation_steps``, and ``ema_overwrite_frequency`` with ``use_ema``."""
        if not self.trains_under_tf_distribute:
            return
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if steps:
            self._refuse_kerass("gradient_accumulation_steps", steps, (
                f"give the strategy accumulate={steps}, which applies the mean gradient of {steps} batches at once"
                if "accumulate" in inspect.signature(type(self)).parameters
                else f"give a batch_size {steps} times as large"))
        frequency = getattr(optimizer, "use_ema", False) and getattr(optimizer, "ema_overwrite_frequency", None)
        if frequency:
            self._refuse_kerass("ema_overwrite_frequency", frequency,
                                "let fit write the moving averages into the weights at its end, as Keras's fit does")

    def _refuse_kerass(self, setting, value, instead):
        raise ValueError(f"{type(self).__name__} cannot run Keras's {setting} (it fails under tf.distribute's "
                         f"strategies: a merge_call inside a cond); leave it at None and {instead}. "
                         f"Received: {setting}={value}")

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
        """The strategy of a one-step check (``GradientParityCheck``) beside the real run."""
        return self


def build_before_fit(model, element_spec):
    """Build ``model``'s compiled state from its batches' ``element_spec``, and skip the build of Keras's ``fit``
    and ``evaluate`` on this instance.

    Under tf.distribute, Keras builds from the first batch, whose replicas' parts
    it averages with ``strategy.reduce``: that fails under
    ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), and under
    ``MirroredStrategy`` when the parts differ in size (63 examples on 2
    replicas: "Inputs to operation AddN of type AddN must have the same size and
    shape"), with Keras's own ``fit`` too.
    """
    rebuild.build_compiled_state(model, element_spec, model.distribute_strategy.scope())
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None


def summed_over_replicas(value):
    """``(value summed over every replica in sync, the replicas)``, from this replica's ``value`` (a count of the
    batch's examples, say)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value, 1
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value), context.num_replicas_in_sync


def sum_over_replicas(optimizer, summed=None):
    """Make ``optimizer`` all-reduce its gradients with ``summed`` (:func:`compression.reducer`; None: whole, in
    their own dtype) and clip their sum, as ``Single`` clips the whole batch's.

    Keras 3 clips (``clipnorm``, ``global_clipnorm``, ``clipvalue``) each
    replica's part of the gradient before its all-reduce sums them, so N
    replicas stepped up to N times as far as one device (tf-keras 2 clipped
    after the sum). With clipping set, the sum moves ahead of it: the
    all-reduce runs in ``_clip_gradients``, and the optimizer's own all-reduce
    passes the summed gradients on (``summed`` then sees no variables: PowerSGD,
    which keeps its state by variable, refuses clipping).
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue:
        summed = summed or compression.reducer(None)
        clip = optimizer._clip_gradients
        optimizer._clip_gradients = lambda gradients: clip([g for g, _ in summed([(g, None) for g in gradients])])
        optimizer._all_reduce_sum_gradients = list  # summed already
    elif summed is not None:
        optimizer._all_reduce_sum_gradients = lambda grads_and_vars: summed(list(grads_and_vars))


def draw_apart_on_each_replica(model):
    """Make each replica draw its own random numbers in ``model``'s random layers (``Dropout`` and kin).

    A layer's seed state is one mirrored variable, so under Keras's own
    ``MirroredStrategy`` every replica drew the same seed and gave its part of
    the batch the same mask: with 2 replicas, example i and example i + 32 of a
    batch of 64 lost the same units, where ``Single`` draws a mask per example.
    Each replica's seed is offset by its index in the first of the seed's two
    numbers (the second counts the draws), so the replicas' streams stay
    apart and the same seed gives the same run.
    """
    for generator in rebuild.seed_generators(model):
        generator.next = _offset_by_replica(generator.next)


def _offset_by_replica(draw):
    def next_on_this_replica(ordered=True):
        seed = draw(ordered)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return seed
        return seed + tf.cast(tf.stack([context.replica_id_in_sync_group, 0]), seed.dtype)

    return next_on_this_replica


class Run:
    """One training of a user's model under a strategy: the prepared copy and all state of that training.

    ``Strategy.prepare`` makes it; ``cnnpar.fit`` trains with it and then
    drops it, so nothing of one training reaches the next. This base trains
    with Keras's own ``fit``; strategies with a loop of their own subclass it.

    Attributes:
        strategy: the configuration it was prepared for.
        settings: the ``fit`` call's :class:`RunSettings`.
        model: the prepared copy of the user's model, which trains.
        checkpoint: the run's checkpoint (``directory``, ``completed_epochs``, ``remove()``), or None.
    """

    def __init__(self, strategy, settings, model, checkpoint=None):
        self.strategy, self.settings, self.model, self.checkpoint = strategy, settings, model, checkpoint

    def __repr__(self):
        return f"<{type(self).__name__} of {self.strategy!r} model={self.model.name}>"

    def report(self):
        """Text that describes the prepared layout (printed and logged before training), or None."""
        return "\n".join(line for line in (self.changes_line(), self.resumed_line()) if line) or None

    def changes_line(self):
        """The report's line on how the strategy's options make this run train differently from Single (its
        gradients compressed, its batches accumulated), with the measured cost; None where they do not."""
        strategy, lines = self.strategy, []
        if strategy.accumulate > 1:
            lines.append(f"accumulate={strategy.accumulate}: each update the mean gradient of {strategy.accumulate} "
                         f"batches, {strategy.accumulate} times Single's: another training")
        lines.append(compression.changes(strategy.compression, strategy.powersgd_rank))
        return "; ".join(line for line in lines if line) or None

    def resume_epoch(self, initial_epoch):
        """The epoch to start at: ``initial_epoch``, or later when a checkpoint was restored."""
        completed = self.checkpoint.completed_epochs if self.checkpoint is not None else 0
        return max(initial_epoch, completed)

    def resumed_line(self):
        """The report's line about a restored checkpoint (and what changed since, on an elastic strategy), or
        None."""
        if self.checkpoint is None or not self.checkpoint.completed_epochs:
            return None
        line = f"resumed from {self.checkpoint.directory} after epoch {self.checkpoint.completed_epochs}"
        changes = self.checkpoint.changes
        if changes:
            line += (f"; changed since: {'; '.join(changes)}; "
                     f"{self.strategy.batch_division(self.settings.record.get('global_batch'))}, and the learning "
                     f"rate and its schedule go on from the checkpoint")
        return line

    def fit(self, train, **fit_kwargs):
        """Train the prepared model on the batched dataset ``train``; return Keras's ``History``."""
        if self.strategy._tf_strategy() is not None:
            build_before_fit(self.model, train.element_spec)
        return self.model.fit(self.strategy.distribute(train), shuffle=False, **fit_kwargs)

    def reload(self):
        """Train on from the weights and optimizer state of ``self.model``, changed since ``prepare`` (a
        callback restored a backup into it). The prepared model is what trains here, so there is nothing to do."""

    def finalize(self, model):
        """Copy the trained weights and optimizer state back into the user's ``model``; drop the checkpoint."""
        rebuild.copy_state(self.model, model)
        if self.checkpoint is not None:
            self.checkpoint.remove()

    def close(self):
        """Release what the run holds beyond its model (processes, temporary files); ``cnnpar.fit`` calls it
        last, after an error too."""


class CheckpointedStrategy(Strategy):
    """Base of strategies that keep a checkpoint of each run and can resume it (``MultiWorker``, ``AsyncPS``).

    It holds the checkpoint options (``checkpoint_dir``, ``resume``,
    ``timeout``) and names one folder per run configuration; the run owns
    the checkpoint itself (``Run.checkpoint``), its epoch to resume at and
    its removal once the trained state is back in the user's model.
    """

    keeps_checkpoints = True
    #: Whether a run may resume on another number of devices (workers); its checkpoint's name then holds none.
    elastic = False

    def __init__(self, *, checkpoint_dir, resume, timeout, **options):
        super().__init__(**options)
        self.checkpoint_dir = arguments.folder_or_none("checkpoint_dir", checkpoint_dir)
        self.resume = bool(resume)
        self.timeout = arguments.positive_seconds("timeout", timeout)

    def checkpoint_folder(self, prepared):
        """The folder of this run configuration's checkpoint."""
        devices = None if self.elastic else self.devices
        return Path(self.checkpoint_dir) / runs.run_file_name(prepared.name, self.alias, devices, "")

    def run_checkpoint(self, prepared, settings):
        """The :class:`~keras_cnnpar.results.checkpoints.RunCheckpoint` of a run of ``prepared`` with ``settings``, in
        :meth:`checkpoint_folder`; an elastic strategy's accepts another device count."""
        return checkpoints.RunCheckpoint(prepared, self.checkpoint_folder(prepared), settings.resume,
                                         dict(settings.record), may_change=("devices",) if self.elastic else ())

    def batch_division(self, global_batch):
        """How a step's ``global_batch`` is divided now, for the line of a resume on another device count."""
        return f"the global batch {global_batch} is divided among the {self.num_replicas} replicas now"

    def build_optimizer(self, prepared):
        """Create the optimizer's variables under the strategy, so the checkpoint holds them from the start."""
        with self.scope():
            prepared.optimizer.build(prepared.trainable_variables)
