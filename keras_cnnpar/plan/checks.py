"""The parity protocol as Keras callbacks: gradient parity with Single, input sharding, and the step-time split.

The original project checked parity before it trusted a speedup: a first-step
gradient difference near 1e-6 is float noise, one near 1e-2 is a bug. These
callbacks make the checks part of a run (``cnnpar train --checks``, and every
run of ``cnnpar sweep``). Each measures before training starts and adds its
figures to every epoch's logs, so they land in the run's CSV; put them before
``EpochLogger`` (``cnnpar.fit`` adds it last, with the ``RunRecorder``).

Example:

>>> import keras_cnnpar as cnnpar
>>> cnnpar.devices.configure(2)
['/device:CPU:0', '/device:CPU:1']
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> x, y = digits.x[:256], digits.y[:256]
>>> strategy = cnnpar.DataParallel(devices=2)
>>> checks = [GradientParityCheck(model, strategy, x[:64], y[:64]), ShardCheck(strategy, x, y, 64),
...           StepTimeSplit(model, strategy, x[:64], y[:64])]
>>> history = model.fit(x, y, batch_size=64, strategy=strategy, callbacks=checks, results_dir=None, verbose=0)
>>> history.history["grad_parity_verdict"], history.history["shard_overlap"]
(['pass'], [0.0])
>>> history.history["time_split"], history.history["communication_share"][0] > 0  # the gradients' all-reduce
(['trace'], True)
"""

import contextlib
import shutil
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar import strategies
from keras_cnnpar.engine import fitting
from keras_cnnpar.keras_compat import graph, rebuild
from keras_cnnpar.plan import timesplit
from keras_cnnpar.zoo import data as data_lib

#: Largest max-abs first-step gradient difference that passes (float noise is ~1e-6; a bug is ~1e-2).
PARITY_TOLERANCE = 1e-4
#: A difference up to this many times the model's own float noise also passes (see ``float_noise``).
NOISE_FACTOR = 4


class ShardCheckFailed(RuntimeError):
    """Two replicas received the same examples: the input is not sharded."""


class GradientParityCheck(keras.callbacks.Callback):
    """Compares the strategy's first-step gradients with Single's, from the same weights and batch.

    Before training, a copy of ``model`` (plain SGD with learning rate 1, its
    dropout, noise and augmentation layers passing their input through) takes
    one step on ``(x, y)`` under a probe copy of ``strategy``; the change of
    its weights, divided by the strategy's learning-rate factor,
    is the gradient the strategy applied. The reference is the gradient of the
    same loss on one device. Some models round far more than 1e-6 in float32
    (BatchNormalization after a convolution: its gradient cancels heavily), so
    the check also measures the model's own float noise: the difference
    between Single's float32 gradient and the same gradient in float64. The
    logs get ``grad_parity_max_abs_diff``, ``grad_parity_float_noise`` and
    ``grad_parity_verdict`` (``pass`` within ``tolerance`` or within
    ``NOISE_FACTOR`` times the float noise, else ``FAIL``, with
    the reason when it is expected: BatchNormalization per replica, printed too;
    ``n/a`` for a strategy that cannot run a probe, such as multi-worker;
    ``error: ...`` when the probe failed, which is also printed).

    Args:
        model: the user's model, before training.
        strategy: the strategy of the run (an object or an alias).
        x, y: one batch.
        tolerance: the largest max-abs difference that passes.
    """

    def __init__(self, model, strategy, x, y, tolerance=PARITY_TOLERANCE):
        super().__init__()
        self.reference, self.strategy, self.x, self.y = model, strategies.resolve(strategy), x, y
        self.tolerance = tolerance
        self.difference, self.noise, self.verdict = float("nan"), float("nan"), "n/a"

    def on_train_begin(self, logs=None):
        try:
            probe = self.strategy.probe()
        except NotImplementedError:
            return
        try:
            self.difference = gradient_difference(self.reference, probe, self.x, self.y)
        except Exception as error:  # the check must not end the run it checks
            self.verdict = f"error: {type(error).__name__}"
            print(f"GradientParityCheck could not run a probe step under {self.strategy!r}: {error}", file=sys.stderr)
            return
        try:
            self.noise = float_noise(self.reference, self.x, self.y)
        except Exception as error:  # e.g. a custom layer that takes no dtype: the tolerance alone decides
            print(f"GradientParityCheck could not copy the model in float64 to measure its float noise: {error}",
                  file=sys.stderr)
        allowed = self.tolerance if np.isnan(self.noise) else max(self.tolerance, NOISE_FACTOR * self.noise)
        self.verdict = "pass" if self.difference <= allowed else "FAIL"
        expected = _expected_difference(self.reference, self.strategy) if self.verdict == "FAIL" else None
        if expected:
            reason, why = expected
            self.verdict = f"FAIL (expected: {reason})"
            print(f"GradientParityCheck: the step under {self.strategy!r} differs from Single's by "
                  f"{self.difference:.3g}, as expected: {why}", file=sys.stderr)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(grad_parity_max_abs_diff=self.difference, grad_parity_float_noise=self.noise,
                        grad_parity_verdict=self.verdict)


def _expected_difference(model, strategy):
    """Why ``strategy``'s step on ``model`` is meant to differ from Single's, as ``(reason, explanation)``, or None:
    gradients all-reduced in bfloat16, or BatchNormalization over parts of the batch (replicas without
    ``sync_batchnorm``, or pipeline micro-batches)."""
    if strategy.compression == "bfloat16":
        return ("gradients all-reduced in bfloat16", "its replicas sum their gradients in bfloat16 "
                "(compression='bfloat16'), which rounds them to 8 significant bits; with compression=None the step "
                "is Single's")
    if strategy.compression == "powersgd":
        return (f"gradients compressed by PowerSGD of rank {strategy.powersgd_rank}", f"its replicas sum rank "
                f"{strategy.powersgd_rank} approximations of their large gradients (compression='powersgd'), with "
                f"error feedback; with compression=None the step is Single's")
    if not any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers(include_self=False, recursive=True)):
        return None
    if strategy.num_replicas > 1 and strategies.accepts(strategy.alias, "sync_batchnorm") \
            and not strategy.sync_batchnorm:
        return ("BatchNormalization per replica", "its BatchNormalization layers normalize each replica's slice of "
                "the batch with that slice's statistics (sync_batchnorm=False); with sync_batchnorm=True they use "
                "the global batch's, and the step is Single's")
    if getattr(strategy, "microbatches", 1) > 1:
        return ("BatchNormalization per micro-batch", "its BatchNormalization layers normalize each micro-batch "
                "with that micro-batch's statistics, as in GPipe; with microbatches=1 the step is Single's")
    return None


def gradient_difference(model, strategy, x, y):
    """Max abs difference between the gradient ``strategy`` applies in one step on ``(x, y)`` and Single's."""
    expected = _single_gradient(_sgd_copy(model), x, y)
    probe = _sgd_copy(model)
    before = [v.numpy() for v in probe.trainable_variables]
    fitting.fit(probe, x, y, strategy=strategy, batch_size=_examples(x), epochs=1, shuffle=False, verbose=0,
                results_dir=None)
    applied = [(b - v.numpy()) / strategy.lr_factor() for b, v in zip(before, probe.trainable_variables)]
    return max(float(np.max(np.abs(a - e))) for a, e in zip(applied, expected))


def float_noise(model, x, y):
    """Max abs difference between Single's float32 gradient on ``(x, y)`` and the same gradient in float64.

    This is how far Single's own gradient is from exact arithmetic: the floor
    under which no strategy that sums in another order can be compared with it.
    Both copies leave the regularizers out: Keras cannot add a float64 model's
    penalties to its float32 loss (a ``TypeError``), and the float noise is the loss's.
    """
    exact = _sgd_copy(model, dtype="float64", regularized=False)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(
        _single_gradient(_sgd_copy(model, regularized=False), x, y),
        _single_gradient(exact, _float64(x), y)))


def _examples(x):
    """How many examples ``x`` holds: an array, or a tuple or dict of them (a model's several inputs)."""
    return len(tf.nest.flatten(x)[0])


def _float64(x):
    """``x`` (an array, or a tuple or dict of them) in float64, for a copy of the model that computes in it."""
    return tf.nest.map_structure(lambda leaf: np.asarray(leaf, "float64"), x)


def _single_gradient(model, x, y):
    """The gradient of ``model``'s loss on ``(x, y)`` on one device, in training mode, as dense arrays (an
    ``Embedding``'s comes as ``tf.IndexedSlices``; a variable the loss does not reach has zeros)."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True)
    return [np.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g).numpy()
            for g, v in zip(tape.gradient(loss, variables), variables)]


def _sgd_copy(model, dtype=None, regularized=True):
    """A copy of ``model`` with its weights, compiled with plain SGD (learning rate 1) and its loss, whose random
    layers (dropout, noise, augmentation: ``rebuild.draws_at_random``) pass their input through, so that every
    copy's step is the same function of the weights; with ``dtype``, every layer computes and keeps its weights in
    it; without ``regularized``, no weight or activity regularizer adds to its loss."""
    def deterministic(layer, config):
        if dtype is not None and not graph.is_operation(layer):  # an operation takes its tensors' dtype
            config["dtype"] = dtype
        if not regularized:
            config.update({key: None for key in config if key.endswith("_regularizer")})
        penalty_only = not regularized and isinstance(layer, keras.layers.ActivityRegularization)
        if rebuild.draws_at_random(layer) or penalty_only:
            return keras.layers.Identity(name=layer.name, dtype=config["dtype"])

    copy = rebuild.clone_with(model, deterministic)
    rebuild.set_weights(copy, [np.asarray(w, dtype or w.dtype) for w in model.get_weights()])
    copy.compile(optimizer=keras.optimizers.SGD(1.0), loss=model.loss)
    return copy


class ShardCheck(keras.callbacks.Callback):
    """Proves that the replicas of a step see different examples; raises ``ShardCheckFailed`` when they do not.

    Before training it reads the first batch of the run's input pipeline the
    way ``strategy`` distributes it, and compares the examples of every pair of
    replicas. Overlap means the replicas compute the same gradient, so the
    extra devices add no data. The logs get ``shard_overlap``: the largest
    share of one replica's examples that another replica also got (0.0 when
    the input is sharded; NaN for one replica, or for a strategy whose steps
    each run on one worker with the whole batch, such as async-ps).

    Args:
        strategy: the strategy of the run.
        x, y: the training data.
        batch_size: the global batch.
    """

    def __init__(self, strategy, x, y, batch_size):
        super().__init__()
        self.strategy, self.x, self.y, self.batch_size = strategies.resolve(strategy), x, y, batch_size
        self.overlap = float("nan")

    def on_train_begin(self, logs=None):
        dataset = data_lib.pipeline(self.x, self.y, self.batch_size, seed=self.strategy.shuffle_seed)
        try:
            batches = self.strategy.replica_batches(dataset)
        except NotImplementedError:
            return
        if len(batches) < 2:
            return
        self.overlap = max_overlap(batches)
        if self.overlap > 0:
            raise ShardCheckFailed(
                f"ShardCheck: replicas of {self.strategy!r} received the same examples in the first step (up to "
                f"{self.overlap:.0%} of a replica's batch is also another's); the input is not sharded, so the "
                f"extra devices add no data. Received: replica batch sizes {[len(b) for b in batches]}")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["shard_overlap"] = self.overlap


def max_overlap(batches):
    """The largest share of one batch's rows that another batch also holds.

    >>> import numpy as np
    >>> a, b = np.arange(6.).reshape(3, 2), np.arange(6., 12.).reshape(3, 2)
    >>> max_overlap([a, b]), max_overlap([a, a])
    (0.0, 1.0)
    """
    rows = [{row.tobytes() for row in np.reshape(b, (len(b), -1))} for b in batches]
    return max((len(rows[i] & rows[j]) / max(len(rows[i]), 1)
                for i in range(len(rows)) for j in range(len(rows)) if i != j), default=0.0)


class StepTimeSplit(keras.callbacks.Callback):
    """Where the step's time goes: the compute, communication, input and idle shares of the last epoch.

    The last epoch's training (validation excluded) runs under TensorFlow's
    profiler, and :mod:`keras_cnnpar.plan.timesplit` sums the traced ops of this
    process's devices by kind (a one-epoch run is measured on its first epoch,
    whose first step also traces the step function: idle then counts that).
    Every epoch's logs get ``step_seconds`` (its training time per step) and
    ``compute_share``, ``communication_share``, ``input_share``, ``idle_share``
    and ``time_split``, NaN and empty except on the measured epoch, where the
    shares sum to 1 and ``time_split`` is ``trace``.

    A strategy whose steps run in other processes (``steps_run_here`` is False:
    async-ps's workers) leaves nothing to trace here, so its split is an
    ``estimate``: before training, forward and backward of one global batch
    on one device with no strategy is timed (the median of ``repeats``); the
    workers' compute share is ``steps x that time / (workers x training
    time)``, and the rest is communication.

    Only the chief traces: its logs are the run's, and TensorFlow's profiler
    crashed a worker that was not the chief as it stopped (a double free in
    its TraceMe recorder's ``SplitEventTracker``, which pairs events begun on
    one thread and ended on another) in 5 of 30 runs of two hosts at 50
    Mbit/s.

    Args:
        model: the user's model.
        strategy: the run's strategy.
        x, y: one global batch.
        repeats: timed runs of the single-device step (async-ps's estimate).
    """

    def __init__(self, model, strategy, x, y, repeats=5):
        super().__init__()
        self.reference, self.strategy, self.x, self.y, self.repeats = model, strategy, x, y, repeats
        self.compute = float("nan")
        self.folder, self._tracing = None, contextlib.ExitStack()

    def on_train_begin(self, logs=None):
        if not self.strategy.steps_run_here:
            self.compute = _single_device_step_seconds(self.reference, self.x, self.y, self.repeats)

    def on_epoch_begin(self, epoch, logs=None):
        self.measured = epoch == self.params.get("epochs", 1) - 1
        if self.measured and self.strategy.steps_run_here and self.strategy.is_chief:
            self.folder = tempfile.mkdtemp(prefix="cnnpar-split-")
            try:
                self._tracing.enter_context(timesplit.traced(self.folder))
            except tf.errors.AlreadyExistsError:  # the user's own profiler runs: no split this time
                print("StepTimeSplit: another profiler session is running; the time split is not measured",
                      file=sys.stderr)
                self._discard_trace()
        self.start, self.train_seconds = time.perf_counter(), None

    def on_test_begin(self, logs=None):
        self._training_done()

    def on_epoch_end(self, epoch, logs=None):
        self._training_done()
        steps = self.params.get("steps")  # no batch hook: a loop of its own then skips reading each step's logs
        try:
            if logs is None or not steps:
                return
            shares = self._shares(steps) if self.measured else {}
            how = ("trace" if self.strategy.steps_run_here else "estimate") if shares else ""
            logs.update(step_seconds=self.train_seconds / steps, time_split=how,
                        **{f"{kind}_share": shares.get(kind, float("nan")) for kind in timesplit.KINDS})
        finally:
            self._discard_trace()

    def on_train_end(self, logs=None):
        self._training_done()  # a run stopped early: the profiler stops and its trace goes
        self._discard_trace()

    def _training_done(self):
        if self.train_seconds is None:
            self.train_seconds = time.perf_counter() - self.start
        self._tracing.close()

    def _discard_trace(self):
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def _shares(self, steps):
        if not self.strategy.steps_run_here:
            compute = min(steps * self.compute / (self.strategy.num_replicas * self.train_seconds), 1.0)
            return {"compute": compute, "communication": 1.0 - compute, "input": 0.0, "idle": 0.0}
        if self.folder is None:
            return {}
        optimizer = getattr(self.reference.optimizer, "name", None)
        return timesplit.split(self.folder, self.train_seconds, self.strategy.local_devices, optimizer,
                               one_device=self.strategy.num_devices == 1)


def _single_device_step_seconds(model, x, y, repeats):
    """The median time of forward and backward of ``(x, y)`` through a copy of ``model`` on one device."""
    copy = _sgd_copy(model)
    x, y = tf.constant(x), tf.constant(y)

    @tf.function(autograph=False)
    def forward_backward():
        with tf.GradientTape() as tape:
            loss = copy.compute_loss(x=x, y=y, y_pred=copy(x, training=True), training=True)
        return tape.gradient(loss, copy.trainable_variables)

    forward_backward()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        [g.numpy() for g in forward_backward()]
        times.append(time.perf_counter() - start)
    return float(np.median(times))
