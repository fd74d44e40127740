"""Local steps across processes or hosts (DiLoCo): each worker trains on its own, the workers meet every H steps."""

import keras
import tensorflow as tf

from keras_cnnpar.cluster import traffic
from keras_cnnpar.strategies import arguments, base
from keras_cnnpar.strategies.base import register
from keras_cnnpar.strategies.multi_worker import MultiWorker, MultiWorkerRun

#: The outer optimizers, as ``(learning rate, Nesterov momentum)`` by default: DiLoCo's (Douillard et al. 2023),
#: and plain averaging of the workers' weights (PostLocalSGD's).
OUTERS = {"nesterov": (0.7, 0.9), "average": (1.0, 0.0)}
#: Inner steps between two exchanges by default.
INNER_STEPS = 16


@register("local-steps")
class LocalSteps(MultiWorker):
    """Data parallel across processes or hosts that exchange their weights every ``inner_steps`` steps (DiLoCo).

    Every worker trains its own replica on its slice of every global batch,
    as under :class:`MultiWorker`, but applies its own gradient with its own
    optimizer at once: no all-reduce in the step. Every ``inner_steps``
    steps (and at the end of each epoch's training, so validation, the
    weights and the checkpoints see one model) the workers all-reduce their
    change since the last exchange; the mean change is the *outer gradient*
    that the outer optimizer applies to the weights they started from, and
    every worker continues from the result. BatchNormalization's moving
    statistics are averaged at each exchange; each worker's inner optimizer
    state stays its own.

    This trains differently from Single (docs/slow_links.md has the measured
    accuracy): a worker's step sees ``batch_size / workers`` examples, and the
    outer step applies ``inner_steps`` of them at once. In exchange a host
    sends the weights' bytes once per ``inner_steps`` steps instead of the
    gradient's every step. With ``inner_steps=1``, ``outer="average"`` and SGD
    the step is MultiWorker's. The epoch CSV's ``exchanges`` column counts an
    epoch's exchanges. A resumed run starts the outer momentum anew.

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
        outer_lr: the outer learning rate (default 0.7 for ``"nesterov"``, 1.0
            for ``"average"``).
        outer_momentum: the outer Nesterov momentum (default 0.9 for
            ``"nesterov"``, 0 for ``"average"``).
        compression: ``"bfloat16"`` sends the changes in half the bytes; None
            (default) in float32.
        checkpoint_dir, resume, timeout: as :class:`MultiWorker`'s.
    """

    description = "data parallel across processes that meet every H steps (DiLoCo), see --workers"
    #: Each worker applies its own gradient: the exchange, not the optimizer, crosses the hosts.
    all_reduces_gradients = False

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

    def __repr__(self):
        return (f"<LocalSteps workers={self.task.num_workers} inner_steps={self.inner_steps} outer={self.outer} "
                f"task={self.task.type}:{self.task.index}>")

    def training_record(self):
        return {**super().training_record(), "inner_steps": self.inner_steps, "outer": self.outer,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}

    def prepared_copy(self, model, settings, clone=None):
        prepared = super().prepared_copy(model, settings, clone)
        keep_gradients_local(prepared.optimizer)
        base.draw_apart_on_each_replica(prepared)
        return prepared

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

    >>> outer_optimizer("nesterov"), outer_optimizer("average"), outer_optimizer("nesterov", 0.5, 0.8)
    (('nesterov', 0.7, 0.9), ('average', 1.0, 0.0), ('nesterov', 0.5, 0.8))
    >>> outer_optimizer("adam")
    Traceback (most recent call last):
    ValueError: outer must be 'nesterov' or 'average'. Received: outer='adam'
    """
    if outer not in OUTERS:
        raise ValueError(f"outer must be 'nesterov' or 'average'. Received: outer={outer!r}")
    default_lr, default_momentum = OUTERS[outer]
    lr = default_lr if lr is None else lr
    momentum = default_momentum if momentum is None else momentum
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ValueError(f"outer_lr must be a positive number. Received: outer_lr={lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1). Received: outer_momentum={momentum!r}")
    return outer, float(lr), float(momentum)


def keep_gradients_local(optimizer):
    """Make ``optimizer`` apply each replica's own gradient, all-reduced with no other: the gradient of the
    replica's whole batch, which Keras had divided by the replicas in sync (for their sum), before clipping."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    clip = optimizer._clip_gradients

    def clip_own(gradients):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return clip([None if g is None else g * tf.cast(replicas, g.dtype) for g in gradients])

    optimizer._clip_gradients = clip_own
    optimizer._all_reduce_sum_gradients = list


class LocalStepsRun(MultiWorkerRun):
    """A :class:`LocalSteps` training on this worker: MultiWorker's, with the exchange between its steps."""

    def report(self):
        strategy = self.strategy
        return "\n".join(filter(None, [
            super().report(), f"local steps: each worker steps alone, the workers exchange their weight changes "
                              f"every {strategy.inner_steps} steps ({strategy.compression or 'float32'}); outer "
                              f"{strategy.outer}, lr {strategy.outer_lr:g}, momentum {strategy.outer_momentum:g}"]))

    def fit(self, train, *, callbacks=(), **fit_kwargs):
        strategy = self.strategy
        exchange = Exchange(strategy._tf_strategy(), self.model, strategy.inner_steps, strategy.outer_lr,
                            strategy.outer_momentum, strategy.compression)
        return super().fit(train, callbacks=[exchange, *callbacks], **fit_kwargs)


class Exchange(keras.callbacks.Callback):
    """The workers' exchange: every ``every`` training steps, before each validation and at each epoch's end.

    Every replica sends its weights' change since the last exchange; the
    mean change is the outer gradient, which an SGD step (Nesterov momentum,
    ``lr``) applies to the weights of the last exchange (the *anchor*); every
    replica continues from the result. The moving statistics are averaged.
    It adds ``exchanges`` (this epoch's) to the epoch's logs.
    """

    def __init__(self, tf_strategy, model, every, lr, momentum, compression=None):
        super().__init__()
        self.tf_strategy, self.every, self.lr, self.momentum = tf_strategy, every, lr, momentum
        self.sent_dtype = tf.bfloat16 if compression == "bfloat16" else None  # None: each in its own dtype
        self.weights = [v.value for v in model.trainable_variables]
        self.statistics = [v.value for v in model.non_trainable_variables if v.value.dtype.is_floating]
        with tf_strategy.scope():
            self.anchors = [tf.Variable(w.read_value(), trainable=False) for w in self.weights]
            self.momenta = [tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False) for w in self.weights]
        self.since = self.count = 0
        self._exchange = tf.function(self._exchange_now)

    def exchange(self):
        """Exchange now, unless no step was taken since the last exchange."""
        if self.since:
            self._exchange()
            self.since, self.count = 0, self.count + 1

    def _exchange_now(self):
        anchors, momenta, statistics = self.tf_strategy.run(self._outer_step)
        for variable, value in zip([*self.anchors, *self.weights, *self.momenta, *self.statistics],
                                   [*anchors, *anchors, *momenta, *statistics]):
            variable.assign(value)

    def _outer_step(self):
        context = tf.distribute.get_replica_context()
        replicas = float(context.num_replicas_in_sync)
        changes = [tf.cast(a - w, self.sent_dtype or w.dtype) for a, w in zip(self.anchors, self.weights)]
        summed = context.all_reduce("SUM", [*changes, *(tf.identity(s) for s in self.statistics)])
        means = [tf.cast(s, v.dtype) / tf.cast(replicas, v.dtype)
                 for s, v in zip(summed, [*self.weights, *self.statistics])]
        anchors, momenta = [], []
        for anchor, momentum, change in zip(self.anchors, self.momenta, means):
            momentum = self.momentum * momentum + change
            anchors.append(anchor - self.lr * (change + self.momentum * momentum))
            momenta.append(momentum)
        return anchors, momenta, means[len(changes):]

    def on_epoch_begin(self, epoch, logs=None):
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.since += 1
        if self.since == self.every:
            self.exchange()

    def on_test_begin(self, logs=None):
        self.exchange()

    def on_epoch_end(self, epoch, logs=None):
        self.exchange()
        if logs is not None:
            logs["exchanges"] = self.count
