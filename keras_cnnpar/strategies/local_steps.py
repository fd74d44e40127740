"""Local steps across processes or hosts (DiLoCo): each worker trains on its own, the workers meet every H steps."""

import contextlib
import math

import keras
import tensorflow as tf

from keras_cnnpar.cluster import traffic
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.strategies import arguments
from keras_cnnpar.strategies.base import register
from keras_cnnpar.strategies.multi_worker import MultiWorker, MultiWorkerRun

#: The outer optimizers, as ``(learning rate, Nesterov momentum)`` by default: DiLoCo's learning rate (Douillard
#: et al. 2023) with half its momentum of 0.9, which cost the 3+3 1.2 to 15 points of accuracy in 3 epochs (12
#: exchanges; docs/slow_links.md), and plain averaging of the workers' weights (PostLocalSGD's).
OUTERS = {"nesterov": (0.7, 0.5), "average": (1.0, 0.0)}
#: Inner steps between two exchanges by default.
INNER_STEPS = 32
#: Training steps per call into TensorFlow, where ``inner_steps`` is a multiple of it (Single's default).
STEPS_PER_EXECUTION = 8


@register("local-steps")
class LocalSteps(MultiWorker):
    """Data parallel across processes or hosts that exchange their weights every ``inner_steps`` steps (DiLoCo).

    Every worker trains its own copy of the model on its slice of every
    global batch (worker ``i`` the ``i``-th, as under :class:`MultiWorker`)
    with Keras's own ``fit`` and optimizer, outside any ``tf.distribute``
    strategy: nothing crosses the hosts in a step. Every ``inner_steps``
    steps (and at the end of each epoch's training, so validation, the
    weights and the checkpoints see one model) the workers all-reduce their
    change since the last exchange; the mean change is the *outer gradient*
    that the outer optimizer applies to the weights they started from, and
    every worker continues from the result. BatchNormalization's moving
    statistics are averaged at each exchange; each worker's inner optimizer
    state stays its own. Training starts from the chief's weights and
    optimizer state; each worker draws its own dropout masks. The epoch's
    training loss and metrics are the chief's, over its slices; validation
    runs on every worker over the whole validation data.

    This trains differently from Single (docs/slow_links.md has the measured
    accuracy): a worker's step sees ``batch_size / workers`` examples, and the
    outer step applies ``inner_steps`` of them at once. In exchange a host
    sends the weights' bytes once per ``inner_steps`` steps instead of the
    gradient's every step. With ``inner_steps=1``, ``outer="average"`` and SGD
    the step is MultiWorker's. The epoch CSV's ``exchanges`` column counts an
    epoch's exchanges. A preemption checkpoint comes right after an exchange
    (the second after the signal): it keeps every worker's steps, the outer
    momentum and the weights of that exchange.

    Start it as :class:`MultiWorker`: ``cnnpar launch --workers N -- python
    script.py``, or ``cnnpar train --strategy local-steps --workers N``.

    Example (a script run by ``cnnpar launch --workers 2 -- python script.py``):

    >>> import keras_cnnpar as cnnpar                # joins the cluster here
    >>> strategy = cnnpar.LocalSteps(inner_steps=32, compression="bfloat16")  # doctest: +SKIP
    >>> history = model.fit(x, y, batch_size=64, epochs=3, strategy=strategy)  # doctest: +SKIP

    Args:
        cluster: as :class:`MultiWorker`'s.
        inner_steps: H, the steps each worker takes between two exchanges.
        outer: ``"nesterov"`` (SGD with Nesterov momentum, DiLoCo's outer
            optimizer) or ``"average"`` (the workers' weights averaged).
        outer_lr: the outer learning rate (default 0.7, DiLoCo's), for
            ``"nesterov"``.
        outer_momentum: the outer Nesterov momentum (default 0.5 for
            ``"nesterov"``; DiLoCo's 0.9 suits runs of many exchanges).
        compression: ``"bfloat16"`` sends the changes in half the bytes; None
            (default) in float32.
        checkpoint_dir, resume, timeout: as :class:`MultiWorker`'s.
    """

    description = "data parallel across processes that meet every H steps (DiLoCo), see --workers"
    #: Each worker trains alone, outside tf.distribute: the exchange, not the step, crosses the hosts.
    trains_under_tf_distribute = all_reduces_gradients = False
    min_devices = 2  # one worker alone would only add the outer step to Single's training

    @classmethod
    def configurations(cls, devices, batch_size):
        """None: its workers are processes that ``cnnpar launch`` starts, as :class:`MultiWorker`'s."""
        return []

    @classmethod
    def host_step(cls, hosts, compute_seconds, link, gradient_bytes, inner_steps=INNER_STEPS):
        """Each host computes its share of the global batch; every ``inner_steps`` steps the hosts all-reduce the
        weights' change (``gradient_bytes`` as sent) in a ring, as :meth:`MultiWorker.host_step`.

        >>> step = LocalSteps.host_step(2, 0.072, traffic.Link.parse("100mbit"), 13_000_000, inner_steps=16)
        >>> round(step.communication_seconds, 3), round(step.images_per_second(64))
        (0.065, 634)
        """
        ring = traffic.ring_all_reduce(gradient_bytes, hosts)
        return traffic.HostStep(compute_seconds / hosts, link.seconds(ring, rounds=2 * (hosts - 1)) / inner_steps)

    def __init__(self, cluster=None, *, inner_steps=INNER_STEPS, outer="nesterov", outer_lr=None,
                 outer_momentum=None, compression=None, checkpoint_dir="checkpoints", resume=False, timeout=60):
        if compression == "powersgd":
            raise ValueError("local-steps sends its weight changes whole: compression must be None or 'bfloat16'. "
                             "Received: compression='powersgd'")
        self.inner_steps = arguments.positive_int("inner_steps", inner_steps)
        self.outer, self.outer_lr, self.outer_momentum = outer_optimizer(outer, outer_lr, outer_momentum)
        super().__init__(cluster, checkpoint_dir=checkpoint_dir, resume=resume, timeout=timeout,
                         sync_batchnorm=False, compression=compression)
        #: Steps a call into TensorFlow runs (as Single's 8), in whole parts of an exchange's steps.
        self.steps_per_execution = math.gcd(STEPS_PER_EXECUTION, self.inner_steps)
        self.replica_index = int(self._strategy.experimental_local_results(self._strategy.run(
            lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))[0])

    def __repr__(self):
        return (f"<LocalSteps workers={self.task.num_workers} inner_steps={self.inner_steps} outer={self.outer} "
                f"task={self.task.type}:{self.task.index}>")

    def training_record(self):
        return {**super().training_record(), "inner_steps": self.inner_steps, "outer": self.outer,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}

    def scope(self):
        """None: each worker's copy of the model is its own."""
        return contextlib.nullcontext()

    def distribute(self, dataset):
        """This worker's slice of every batch of ``dataset`` (batched by the global batch): the ``i``-th of ``n``
        workers takes examples ``[b i // n, b (i + 1) // n)`` of a batch of ``b`` (MultiWorker's slices where ``n``
        divides ``b``)."""
        workers, index = self.num_replicas, self.replica_index

        def this_workers_slice(*batch):
            size = tf.shape(tf.nest.flatten(batch)[0])[0]
            start, end = size * index // workers, size * (index + 1) // workers
            sliced = tf.nest.map_structure(lambda part: part[start:end], batch)
            return sliced if len(batch) > 1 else sliced[0]

        return dataset.map(this_workers_slice)

    def prepare(self, model, settings=None):
        local = self._strategy.extended.worker_devices
        if len(local) > 1:
            raise ValueError(f"local-steps trains one replica per worker; this worker has {len(local)} "
                             f"({', '.join(local)}): start one worker per GPU (CUDA_VISIBLE_DEVICES). "
                             f"Received: {len(local)} local devices")
        run = super().prepare(model, settings)
        return LocalStepsRun(self, run.settings, run.model, run.checkpoint)


def outer_optimizer(outer, lr=None, momentum=None):
    """The outer optimizer's ``(name, learning rate, momentum)``, its defaults filled in (:data:`OUTERS`).

    >>> outer_optimizer("nesterov"), outer_optimizer("average"), outer_optimizer("nesterov", 0.5, 0.9)
    (('nesterov', 0.7, 0.5), ('average', 1.0, 0.0), ('nesterov', 0.5, 0.9))
    >>> outer_optimizer("adam")
    Traceback (most recent call last):
    ValueError: outer must be 'nesterov' or 'average'. Received: outer='adam'
    >>> outer_optimizer("average", momentum=0.5)
    Traceback (most recent call last):
    ValueError: outer_momentum is for outer='nesterov'; 'average' takes the mean of the weights. Received: \
outer='average', outer_momentum=0.5
    """
    if outer not in OUTERS:
        raise ValueError(f"outer must be 'nesterov' or 'average'. Received: outer={outer!r}")
    given = [(name, value) for name, value in (("outer_lr", lr), ("outer_momentum", momentum)) if value is not None]
    if outer == "average" and given:
        name, value = given[0]
        raise ValueError(f"{name} is for outer='nesterov'; 'average' takes the mean of the weights. Received: "
                         f"outer='average', {name}={value!r}")
    default_lr, default_momentum = OUTERS[outer]
    lr = default_lr if lr is None else lr
    momentum = default_momentum if momentum is None else momentum
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ValueError(f"outer_lr must be a positive number. Received: outer_lr={lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1). Received: outer_momentum={momentum!r}")
    return outer, float(lr), float(momentum)


def changes(inner_steps, share=None):
    """What local steps exchanging every ``inner_steps`` steps change in the training, each worker stepping on
    ``share`` examples of a batch (None: not known yet), with their measured cost (docs/slow_links.md), said
    wherever a plan or a run's log names them.

    >>> changes(8, 32)[:66]
    'inner_steps=8: each host steps alone on its 32 examples of a batch'
    >>> changes(8)[:60]
    'inner_steps=8: each host steps alone on its slice of a batch'
    """
    examples = "slice" if share is None else f"{share} examples"
    return (f"inner_steps={inner_steps}: each host steps alone on its {examples} of a batch, and the hosts "
            f"meet every {inner_steps} steps: another training (its validation accuracy measured at most 1.6 points "
            f"below Single's in 18 runs, 14 of them within 1, docs/slow_links.md)")


class LocalStepsRun(MultiWorkerRun):
    """A :class:`LocalSteps` training on this worker: MultiWorker's, with the exchange between its steps."""

    #: The workers step apart; they meet at each exchange, where a preemption checkpoint is saved.
    steps_together = False

    def changes_line(self):
        batch = self.settings.record.get("global_batch")
        return changes(self.strategy.inner_steps, batch // self.strategy.num_replicas if batch else None)

    def report(self):
        strategy = self.strategy
        return "\n".join(filter(None, [
            super().report(), f"local steps: each worker steps alone, the workers exchange their weight changes "
                              f"every {strategy.inner_steps} steps ({strategy.compression or 'float32'}); outer "
                              f"{strategy.outer}, lr {strategy.outer_lr:g}, momentum {strategy.outer_momentum:g}"]))

    def fit(self, train, *, callbacks=(), **fit_kwargs):
        strategy = self.strategy
        self.start_from_the_chiefs_state()
        exchange = Exchange(strategy._tf_strategy(), self.model, strategy.inner_steps, strategy.outer_lr,
                            strategy.outer_momentum, strategy.compression,
                            then=self.checkpoint.save_if_preempted if self.checkpoint is not None else None)
        exchange.kept_by(self.model.optimizer)  # the checkpoint holds the outer state; a resume restores it here
        return super().fit(train, callbacks=[exchange, *callbacks], **fit_kwargs)

    def start_from_the_chiefs_state(self):
        """Give every worker the chief's weights and optimizer state, then its own stream of random numbers (its
        index added to each seed, as ``DataParallel``'s replicas)."""
        model, strategy = self.model, self.strategy
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        variables = [*model.weights, *model.optimizer.variables]
        for variable, value in zip(variables, strategy.broadcast([v.numpy() for v in variables])):
            variable.assign(value)
        for generator in rebuild.seed_generators(model):
            offset = tf.constant([strategy.replica_index, 0], generator.state.dtype)
            generator.state.assign(generator.state.value + offset)

    def inputs(self, train, validation=None):
        """This worker's slice of every training batch; the whole validation data, which every worker evaluates
        with the same weights (an exchange comes before each validation)."""
        return self.strategy.distribute(train), validation


class Exchange(keras.callbacks.Callback):
    """The workers' exchange: every ``every`` training steps, before each validation and at each epoch's end.

    Every replica sends its weights' change since the last exchange; the
    mean change is the outer gradient, which an SGD step (Nesterov momentum,
    ``lr``) applies to the weights of the last exchange (the *anchor*); every
    replica continues from the result. The moving statistics are averaged.
    It adds ``exchanges`` (this epoch's) to the epoch's logs, and calls
    ``then`` after each exchange, where the workers have met.
    """

    def __init__(self, tf_strategy, model, every, lr, momentum, compression=None, then=None):
        super().__init__()
        self.then = then or (lambda: None)
        self.tf_strategy, self.every, self.lr, self.momentum = tf_strategy, every, lr, momentum
        self.sent_dtype = tf.bfloat16 if compression == "bfloat16" else None  # None: each in its own dtype
        self.weights = [v.value for v in model.trainable_variables]
        self.statistics = [v.value for v in model.non_trainable_variables if v.value.dtype.is_floating]
        self.anchors = [tf.Variable(w.read_value(), trainable=False) for w in self.weights]
        self.momenta = [tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False) for w in self.weights]
        self.steps = self.exchanged_at = self.count = 0  # this epoch's steps, at the last exchange, exchanges
        self._exchange = tf.function(self._exchange_now)

    def kept_by(self, optimizer):
        """Make ``optimizer``'s checkpoints hold the weights of the last exchange and the outer momentum (the
        same on every worker) as they hold its slots; where a checkpoint was restored into it, they take its
        values now (TensorFlow restores what is tracked after the restore)."""
        optimizer._track_trackable(tf.train.Checkpoint(anchors=self.anchors, momenta=self.momenta), "outer")

    def exchange(self):
        """Exchange now, unless no step was taken since the last exchange."""
        if self.steps > self.exchanged_at:
            self._exchange()
            self.exchanged_at, self.count = self.steps, self.count + 1
            self.then()

    def _exchange_now(self):
        changes = [tf.cast(a - w, self.sent_dtype or w.dtype) for a, w in zip(self.anchors, self.weights)]
        summed = self.tf_strategy.experimental_local_results(self.tf_strategy.run(
            lambda *sent: tf.distribute.get_replica_context().all_reduce("SUM", [tf.identity(t) for t in sent]),
            args=(*changes, *(s.read_value() for s in self.statistics))))[0]
        replicas = self.tf_strategy.num_replicas_in_sync
        means = [tf.cast(s, v.dtype) / replicas for s, v in zip(summed, [*self.weights, *self.statistics])]
        for anchor, momentum, weight, change in zip(self.anchors, self.momenta, self.weights, means):
            momentum.assign(self.momentum * momentum + change)
            anchor.assign_sub(self.lr * (change + self.momentum * momentum))
            weight.assign(anchor)
        for statistic, mean in zip(self.statistics, means[len(changes):]):
            statistic.assign(mean)

    def on_epoch_begin(self, epoch, logs=None):
        self.steps = self.exchanged_at = self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1  # Keras calls it after each call into TensorFlow, with the last step's index
        if self.steps - self.exchanged_at >= self.every:
            self.exchange()

    def on_test_begin(self, logs=None):
        self.exchange()

    def on_epoch_end(self, epoch, logs=None):
        self.exchange()
        if logs is not None:
            logs["exchanges"] = self.count
