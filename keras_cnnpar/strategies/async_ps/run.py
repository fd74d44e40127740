"""An ``AsyncPS`` training in its coordinator process: groups of steps scheduled on the workers, each batch in
slices where the workers are many, each gradient divided by its staleness, the weights' moving average, precise
BatchNormalization statistics, and the checks that a lost parameter server ends the run."""

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.cluster import network
from keras_cnnpar.keras_compat import precise_bn, rebuild
from keras_cnnpar.strategies import base, loop
from keras_cnnpar.strategies.base import PeerLost
from keras_cnnpar.zoo import data

#: How long a failed step waits for a parameter server to be seen gone before the error counts as its own. A
#: killed server's port may answer a moment after its connections broke: the likeliest reading of one CI run
#: where tests/test_hosts.py's lost server came back as a bare UnavailableError.
PS_LOSS_SECONDS = 5


class AsyncRun(base.Run):
    """An ``AsyncPS`` training in the coordinator process: the prepared model (its variables on the parameter
    servers), the per-epoch checkpoint and the precise-BN statistics."""

    def __init__(self, strategy, connection, settings, model, checkpoint):
        super().__init__(strategy, settings, model, checkpoint)
        self.connection = connection
        self.precise = precise_bn.PreciseBatchNorm(model) if strategy.precise_bn else None
        if self.precise is not None and self.precise.statistics is None:  # no BatchNormalization to recompute
            self.precise = None
        self.held = _bytes_per_task(model.weights)
        self.slices = batch_slices(strategy.batch_slices, strategy.workers, settings.record.get("global_batch"))

    def report(self):
        strategy = self.strategy
        lines = [f"{strategy.describe()}; learning rate x{strategy.lr_factor():.3g} (scale_lr={strategy.scale_lr})"
                 + (f"; first {_warmup_text(strategy.warmup_steps, self.slices)} one group at a time"
                    if strategy.warmup_steps else "")
                 + (f"; each gradient divided by {_divisor_text(self.model.optimizer, self.slices)}"
                    if strategy.staleness_aware else "")
                 + (f"; a step staler than {strategy.max_staleness} updates dropped"
                    if strategy.max_staleness is not None else "")
                 + (f"; validated and returned: the weights' moving average (ema_momentum={strategy.ema_momentum})"
                    if WeightAverage.kept(strategy.ema_momentum, self.model.optimizer) else "")
                 + (f"; BatchNormalization statistics recomputed from {strategy.precise_bn} batches after each epoch"
                    if self.precise else ""),
                 slices_note(self.slices, strategy.slices),
                 *(f"{task} holds {count} model variables, {size / 1e6:.1f} MB"
                   for task, (count, size) in sorted(self.held.items())),
                 self.resumed_line()]
        return "\n".join(line for line in lines if line)

    def fit(self, epoch_batches, *, epochs=1, steps_per_epoch, validation_data=None, validation_steps=None,
            validation_freq=1, callbacks=None, initial_epoch=0, verbose=1):
        """Train ``epochs`` epochs of ``steps_per_epoch`` steps; ``epoch_batches(epoch)`` is that epoch's
        finite dataset of ``steps_per_epoch`` batches, which the workers read, every batch once."""
        strategy, prepared, steps = self.strategy, self.model, steps_per_epoch
        workers, updates = len(self.connection.cluster["worker"]), steps * self.slices
        async_loop = _AsyncLoop(strategy, self.connection, prepared,
                                steps_per_group(strategy.steps_per_execution, updates, workers), updates, self.slices)
        evaluator = _evaluator(prepared) if validation_data is not None else None

        def train_epoch(epoch, callback_list):
            batches = epoch_batches(epoch)
            rebuild.build_compiled_state(prepared, batches.element_spec, strategy.scope())
            callback_list.on_train_batch_begin(0)
            logs = async_loop.run_epoch(batches)
            if self.precise:  # on the coordinator, from this epoch's first batches
                logs["precise_bn_batches"] = float(self.precise.update(prepared, batches.take(strategy.precise_bn)))
            callback_list.on_train_batch_end(steps - 1, logs)
            return logs

        def validate(_):  # the callbacks run in the user's process: no batch hooks from here
            rebuild.set_weights(evaluator, prepared.get_weights())
            return evaluator.evaluate(validation_data, steps=validation_steps, verbose=0, return_dict=True)

        return loop.run_epochs(
            prepared, train_epoch, epochs=epochs, steps=steps, callbacks=callbacks, verbose=verbose,
            initial_epoch=initial_epoch, validate=validate if evaluator is not None else None,
            validation_freq=validation_freq,
            epoch_guard=self._parameter_servers_kept,
            after_epoch=(lambda epoch: self.checkpoint.save(completed_epochs=epoch + 1))
            if self.checkpoint else None)

    @contextlib.contextmanager
    def _parameter_servers_kept(self, epoch):
        """Turn a lost parameter server (in training, validation or checkpointing) into a ``PeerLost``
        that names it and says how to resume."""
        try:
            yield
        except tf.errors.OpError as error:
            cluster = self.connection.cluster
            lost = network.unreachable_within({"ps": cluster["ps"]}, seconds=PS_LOSS_SECONDS)
            if not lost:
                raise
            run = self.checkpoint
            saved = (f"the checkpoint after epoch {run.completed_epochs} is in {run.directory}; restart "
                     f"the servers and rerun with resume=True (cnnpar train --resume)"
                     if run and run.completed_epochs else "no epoch was checkpointed yet")
            raise PeerLost(f"lost {', '.join(lost)} of the cluster {cluster} in epoch {epoch + 1}: "
                           f"its variables are gone; {saved}. ({type(error).__name__})") from error


class _AsyncLoop:
    """Schedules an epoch's steps in groups on the workers and gathers their loss, metrics and staleness.

    Each of the loop's steps is one update: a batch, or a slice of it where a batch is trained in ``slices``."""

    def __init__(self, strategy, connection, model, steps_per_group, steps, slices=1):
        self.tf_strategy, self.coordinator = connection.tf_strategy, connection.coordinator
        self.workers = {"worker": connection.cluster["worker"]}
        self.model, self.steps_per_group, self.slices = model, steps_per_group, slices
        self.staleness_aware, self.warmup_steps = strategy.staleness_aware, strategy.warmup_steps
        self.max_staleness = strategy.max_staleness
        with self.tf_strategy.scope():
            # Steps done, their gradient applied or dropped (staler than max_staleness): a dropped step's ticket
            # (``begun``) is done too, or every later step would count it in its staleness.
            self.applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="applied_updates")
            self.dropped = tf.Variable(0, dtype=tf.int64, trainable=False, name="dropped_updates")
            self.begun = tf.Variable(0, dtype=tf.int64, trainable=False, name="begun_updates")
            # Per group of an epoch of ``steps``, how many of its steps began their update: a group run again
            # starts after them.
            self.landed = tf.Variable(tf.zeros([math.ceil(steps / steps_per_group)], tf.int32), trainable=False,
                                      name="landed_per_group")
        self.average = WeightAverage(self.tf_strategy, model, strategy.ema_momentum)
        self.decay = self.average.momentum ** (1 / slices)  # the average spans as many images in slices
        self._steps = self._traced_steps()  # traced at its first call

    def run_epoch(self, batches):
        """Run a step on the workers for each batch of ``batches`` (one epoch's), or for each slice of it, in
        groups."""
        self.model.reset_metrics()
        self.average.swap_out()
        self.begun.assign(self.applied.read_value())  # nothing in flight: drop the tickets of a lost worker's steps
        epoch = _IndexedBatches(batches, self.slices)
        steps = len(epoch.sizes)
        iterator = iter(self.coordinator.create_per_worker_dataset(epoch.dataset()))
        applied_before, dropped_before = int(self.applied.numpy()), int(self.dropped.numpy())
        iterations = self.model.optimizer.iterations
        counted_before = int(iterations.numpy())
        groups = [(first, min(self.steps_per_group, steps - first)) for first in range(0, steps, self.steps_per_group)]
        self.landed.assign(tf.zeros_like(self.landed))
        results = []
        while groups and int(self.applied.numpy()) < self.warmup_steps * self.slices:  # one group at a time
            results.append(self._schedule(iterator, *groups.pop(0), decay=0.0))  # nothing to average yet
            self.coordinator.join()
        results += [self._schedule(iterator, *group, decay=self.decay) for group in groups]
        self.coordinator.join()
        self.average.swap_in()
        dropped = int(self.dropped.numpy()) - dropped_before
        applied = int(self.applied.numpy()) - applied_before - dropped
        # Keras counts a step by reading the optimizer's iterations and writing them back: workers that step at
        # once lose each other's counts (9 of 64 with 4 workers), which schedules and Adam's bias correction read.
        iterations.assign(counted_before + applied)
        loss, size, staleness, kept = np.concatenate([r.fetch() for r in results]).T  # each group's last run
        staleness = staleness[kept > 0] if kept.any() else np.zeros(1)  # of the gradients applied
        logs = {k: float(v) for k, v in self.model.get_metrics_result().items()}
        return {**logs, "loss": float(np.average(loss, weights=size)), "staleness_mean": float(staleness.mean()),
                "staleness_max": float(staleness.max()), "steps_applied": float(applied),
                "steps_dropped": float(dropped), "lost_workers": float(len(network.unreachable(self.workers)))}

    def _schedule(self, iterator, first, size, decay):
        """Schedule the steps on batches ``first`` to ``first + size - 1`` of the epoch on a free worker, each
        moving the weights' average by ``1 - decay`` towards the weights it left; return their remote result.

        ``ClusterCoordinator`` runs a group again, on another worker, when the worker that ran it fails; the
        run starts after the steps of the group marked landed (``landed``), each marked before its update
        begins, so no step is applied twice; the step in flight when the worker died may be lost."""
        return self.coordinator.schedule(self._steps, args=(iterator, tf.constant(first, tf.int32),
                                                             tf.constant(size, tf.int32), tf.constant(decay)))

    def _traced_steps(self):
        """One ``tf.function`` for groups of any size: the steps run in a loop inside it, not unrolled, so every
        worker compiles one step's graph once (not a group-sized graph per size)."""
        model, tf_strategy, average = self.model, self.tf_strategy, self.average
        applied, begun, landed, steps_per_group = self.applied, self.begun, self.landed, self.steps_per_group
        dropped, bound, slices = self.dropped, self.max_staleness, self.slices
        power = staleness_power(model.optimizer) if self.staleness_aware else 0

        def one_step(batch, share, group):
            """A step's gradient (weighted by its ``share`` of the batch and divided for its staleness), its
            staleness, and its loss and batch size."""
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            seen = applied.read_value()  # updates that had landed: all are in the weights this step reads
            with tf.control_dependencies([seen]), tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
                scaled_loss = model.optimizer.scale_loss(loss)  # float16's loss scaling; else the loss itself
            gradients = tape.gradient(scaled_loss, model.trainable_variables)
            with tf.control_dependencies(gradients):  # the others' updates begun before it, landed after it read
                staleness = begun.assign_add(1) - 1 - seen
            if slices > 1:  # the slices of a batch add up to the batch's gradient
                gradients = [g * tf.cast(share, g.dtype) for g in gradients]
            if power:  # staleness in batches: the updates in flight make as many batches with slices
                late = tf.cast(staleness, gradients[0].dtype) / slices + 1
                divisor = late if power == 1 else late * late
                gradients = [g / divisor for g in gradients]
            _add_metrics(model, x, y, y_pred, sample_weight)
            examples = tf.shape(tf.nest.flatten(y)[0])[0]  # y: the labels, or a tuple or dict of them
            return gradients, staleness, tf.stack([loss, tf.cast(examples, loss.dtype)])

        def update(gradients, decay, marked):
            """Once ``marked``, apply the gradients; 1 once they and the average's move landed."""
            with tf.control_dependencies([marked]):
                gradients = [tf.identity(g) for g in gradients]
            done = _ops_added_by(lambda: model.optimizer.apply_gradients(zip(gradients, model.trainable_variables)))
            with tf.control_dependencies(done):
                average.follow(decay)
                return tf.identity(tf.constant(1.0))

        def drop():
            with tf.control_dependencies([dropped.assign_add(1)]):
                return tf.identity(tf.constant(0.0))

        @tf.function(autograph=False)  # as Keras's own steps (do_not_convert): no conversion of the model's calls
        def steps(iterator, first, size, decay):
            epoch = next(iterator)  # the whole epoch, held by this worker's dataset: no copy
            group = first // steps_per_group
            start = landed.sparse_read(group)  # a run again after a lost worker skips the steps marked

            def step(i, results):
                batch, share = _IndexedBatches.batch(epoch, first + i)
                gradients, staleness, loss_and_size = tf_strategy.run(one_step, args=(batch, share, group))
                # Landed before its update begins: a run again after a lost worker starts after it, so a step whose
                # update may have begun is never applied twice (one that died before its update is lost).
                with tf.control_dependencies([staleness]):
                    mark = landed.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int32), tf.reshape(group, [1])))
                with tf.control_dependencies([mark]):
                    marked = tf.identity(staleness)

                def apply():  # a replica function of its own: the optimizer's update syncs in its branch's graph
                    return tf_strategy.run(update, args=(gradients, decay, marked))

                kept = apply() if bound is None else tf.cond(staleness <= bound, apply, drop)
                with tf.control_dependencies([kept]):  # only now: a step that reads after this count finds it
                    counted = applied.assign_add(1)
                with tf.control_dependencies([counted]):
                    result = tf.concat([tf.cast(loss_and_size, tf.float32),
                                        tf.cast(tf.stack([staleness]), tf.float32), tf.reshape(kept, [1])], 0)
                return i + 1, results.write(i - start, result)

            _, results = tf.while_loop(lambda i, _: i < size, step,
                                       (start, tf.TensorArray(tf.float32, size=size - start,
                                                              element_shape=tf.TensorShape([4]))))
            return results.stack()

        return steps


class WeightAverage:
    """An exponential moving average of a model's trainable weights, kept beside them on the parameter servers,
    which validation, the per-epoch weights and the trained model read instead of the last update's weights.

    Each step moves the average by ``1 - decay`` towards the weights it left
    (``follow``; ``decay`` 0 during the warm-up, whose updates are sequential,
    so the average starts as the weights where asynchrony starts). Between
    epochs the model's variables hold the average (``swap_in``) and the
    averages the trained weights, which ``swap_out`` puts back before training
    goes on, as Keras's ``SwapEMAWeights`` callback swaps an optimizer's own
    averages. ``momentum=None``, or an optimizer with ``use_ema=True`` (whose
    averages Keras writes into the weights at the end), keeps no average here.
    """

    def __init__(self, tf_strategy, model, momentum):
        keeps = self.kept(momentum, model.optimizer)
        self.momentum = momentum if keeps else 0.0
        self.variables = [variable.value for variable in model.trainable_variables] if keeps else []
        self.averages, self.swapped = [], False
        with tf_strategy.scope():
            for variable in self.variables:
                with tf_strategy.extended.colocate_vars_with(variable):
                    self.averages.append(tf.Variable(variable.read_value(), trainable=False,
                                                     name=f"average_{variable.name.split(':')[0]}"))
        self._swap = tf.function(self._swapped_values, autograph=False)

    @staticmethod
    def kept(momentum, optimizer):
        """Whether a run with ``ema_momentum=momentum`` keeps an average of the weights under ``optimizer``.

        >>> [WeightAverage.kept(0.95, keras.optimizers.SGD(use_ema=ema)) for ema in (False, True)]
        [True, False]
        """
        return momentum is not None and not getattr(optimizer, "use_ema", False)

    def follow(self, decay):
        """In a step, after its update: move the average by ``1 - decay`` towards the weights, in one
        ``assign_add`` (``tf.train.ExponentialMovingAverage``'s lockless form: two workers that add at once may
        both read the same average, and neither waits)."""
        for variable, average in zip(self.variables, self.averages):
            with tf.device(average.device):  # on the parameter server, beside both: no weights cross the network
                rate = tf.cast(1.0 - decay, average.dtype)
                average.assign_add(rate * (variable.read_value() - average.read_value()))

    def swap_in(self):
        """Put the average in the model's variables (the trained weights wait in its place)."""
        if self.averages and not self.swapped:
            self._swap()
            self.swapped = True

    def swap_out(self):
        """Put the trained weights back in the model's variables, the average in its place."""
        if self.swapped:
            self._swap()
            self.swapped = False

    def _swapped_values(self):
        trained = [variable.read_value() for variable in self.variables]
        for variable, average, value in zip(self.variables, self.averages, trained):
            variable.assign(average.read_value())
            average.assign(value)


def _ops_added_by(function):
    """Call ``function`` in a ``tf.function`` being traced; return the stateful ops it added (an optimizer's
    update), so that what must follow them can wait for them.

    Automatic control dependencies do not order them: Keras's optimizer
    updates a variable through a capture of its own, and an op that reads the
    variable afterwards may run before the update lands (a step's count of
    finished updates ran ahead of its own update and of its ticket, with 8
    workers).

    >>> variable = tf.Variable(1.0)
    >>> @tf.function
    ... def added():
    ...     return tf.constant([op.type for op in _ops_added_by(lambda: variable.assign_add(1.0, read_value=False))])
    >>> added().numpy().tolist()
    [b'AssignAddVariableOp']
    """
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    function()
    return [op for op in graph.get_operations()[before:] if op.op_def.is_stateful]


def _add_metrics(model, x, y, y_pred, sample_weight=None):
    """Update ``model``'s metrics with one batch; Keras's own metrics by adding what the batch adds to each of
    their variables in one atomic ``assign_add`` of TensorFlow's.

    Keras's own update reads a metric variable and writes it back
    (``Variable.assign_add`` is ``assign(self + value)``), so workers that
    update at once lose each other's counts: a 4-worker epoch's training
    accuracy read 0.0104 where its batches' was 0.0156. Keras's metrics only
    add to their variables (means, sums, counts, confusion matrices), so
    theirs come out as under ``Single``. A metric of another module may do
    otherwise (keep a maximum, say): it keeps Keras's read and write-back.
    """
    additive = {id(variable) for metric in _leaf_metrics(model.metrics) if _keras_metric(metric)
                for variable in metric.variables}
    state = [variable for metric in model.metrics for variable in metric.variables]
    start = [tf.zeros(v.shape, v.dtype) if id(v) in additive else v.value for v in state]
    with keras.StatelessScope(state_mapping=list(zip(state, start))) as batch_only:
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        updated = [batch_only.get_current_value(variable) for variable in state]
    for variable, value in zip(state, updated):
        if id(variable) in additive:
            variable.value.assign_add(value)
        else:
            variable.assign(value)


def _leaf_metrics(metrics):
    """The metrics in ``metrics``, with the ones Keras's ``CompileMetrics`` holds in its place."""
    for metric in metrics:
        inner = getattr(metric, "metrics", None)
        yield from _leaf_metrics(inner) if inner else [metric]


def _keras_metric(metric):
    """Whether ``metric`` is one of Keras's own (``keras.metrics``, or a function it wraps in one).

    >>> _keras_metric(keras.metrics.AUC()), _keras_metric(keras.metrics.MeanMetricWrapper(lambda y, p: y))
    (True, True)
    """
    return type(metric).__module__.startswith("keras.")


#: Optimizers that divide each step by a running measure of the gradients' size (Keras's names; those a Keras
#: version lacks are left out).
ADAPTIVE_OPTIMIZERS = ("Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "Ftrl",
                       "Lion", "Lamb", "Muon")


#: The batches whose images may be in flight at once, by default (docs/async.md, Many workers): each worker's
#: step takes a whole batch up to this many workers; with more, each batch is trained in slices
#: (:func:`batch_slices`).
BATCHES_IN_FLIGHT = 4


def batch_slices(slices, workers, batch_size=None):
    """The slices each batch is trained in with ``workers`` workers: ``slices`` where given, else one per
    :data:`BATCHES_IN_FLIGHT` workers, so that more workers put no more images in flight; never more than the
    ``batch_size`` examples of a batch, where it is known (a slice holds one example at least).

    A step's gradient is computed on weights that the updates in flight move
    before it lands. With 16 workers on whole batches that was about 12 batches'
    updates, and the 3+3 CNN collapsed in two seeds of five; with each batch in
    4 slices it is 3 batches' worth, as with 4 workers on whole batches.

    >>> [batch_slices(None, workers) for workers in (1, 2, 4, 5, 8, 16)], batch_slices(3, 2)
    ([1, 1, 1, 2, 2, 4], 3)
    >>> batch_slices(None, 16, batch_size=1), batch_slices(1000, 2, batch_size=64)
    (1, 64)
    """
    wanted = slices or math.ceil(workers / BATCHES_IN_FLIGHT)
    return wanted if batch_size is None else min(wanted, batch_size)


def slices_note(slices, wanted=None):
    """The run report's line on the slices each batch is trained in, or ``""`` for whole batches; ``wanted``: the
    slices the workers called for, where a batch of ``slices`` examples holds fewer.

    >>> slices_note(1)
    ''
    >>> slices_note(4)
    'each batch trained in 4 slices, each a step and an update weighted by its share of the batch (batch_slices=4)'
    >>> slices_note(1, wanted=4)
    'each batch trained whole: a global batch of 1 example holds no more slices (batch_slices=4 called for)'
    """
    capped = wanted is not None and wanted > slices
    if slices == 1:
        return (f"each batch trained whole: a global batch of 1 example holds no more slices (batch_slices={wanted} "
                f"called for)") if capped else ""
    return (f"each batch trained in {slices} slices, each a step and an update weighted by its share of the batch "
            f"(batch_slices={slices}" + (f"; {wanted} called for, more than a global batch of {slices} examples "
                                         f"holds)" if capped else ")"))


def steps_per_group(steps_per_execution, steps, workers):
    """The steps of each group an epoch of ``steps`` is scheduled in: ``steps_per_execution``, or fewer where
    that would leave some of the ``workers`` without a group (at least one step).

    Groups are what the workers take, one at a time, so an epoch of 63 steps in
    groups of 8 keeps at most 8 workers busy, whatever the cluster's size.

    >>> steps_per_group(8, 63, 4), steps_per_group(8, 63, 8), steps_per_group(8, 63, 16), steps_per_group(8, 5, 16)
    (8, 7, 3, 1)
    """
    return max(1, min(steps_per_execution, steps // workers))


def staleness_power(optimizer):
    """The power ``p`` of ``1 + staleness`` that divides a late gradient under ``optimizer``.

    2 for SGD and any optimizer whose step follows the gradient's size: there
    the division is the step's rate, and 1 + staleness was not enough to keep
    momentum SGD from collapsing. 1 for the optimizers of
    :data:`ADAPTIVE_OPTIMIZERS`, which divide by the gradients' running size:
    a gradient divided by a varying square mixes scales of 1 to 1/25 into
    that running size, and 4 workers of the 2+2 CNN (Adam) ended up to 4
    points below Single (docs/async.md). A mixed-precision loss-scale
    wrapper is looked through.

    >>> staleness_power(keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
    2
    >>> staleness_power(keras.optimizers.AdamW()), staleness_power(keras.optimizers.RMSprop())
    (1, 1)
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    adaptive = tuple(getattr(keras.optimizers, name) for name in ADAPTIVE_OPTIMIZERS
                     if hasattr(keras.optimizers, name))
    return 1 if isinstance(inner, adaptive) else 2


def read_kernels_before_xla(model):
    """Make each convolution of ``model`` that Keras computes in an XLA function read its kernel before it.

    On the TensorFlow backend Keras runs a grouped convolution (``groups > 1``)
    and a ``channels_first`` 3-D one as a ``tf.function(jit_compile=True)``,
    and XLA cannot read a variable held on another device: with the kernel on
    a parameter server, every step failed ("Trying to access resource ...
    located in device /job:ps/replica:0/task:0/device:CPU:0 from device
    /job:worker/..."). Read on the worker first, the kernel reaches the
    function as a tensor; the arithmetic is the same.

    >>> model = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(4, 3, groups=2),
    ...                           keras.layers.Conv2D(2, 1)])
    >>> read_kernels_before_xla(model)
    >>> ["convolution_op" in vars(layer) for layer in model.layers]
    [True, False]
    """
    for layer in model._flatten_layers():
        if hasattr(layer, "convolution_op") and (getattr(layer, "groups", 1) > 1 or (  # Keras's BaseConv
                getattr(layer, "rank", 2) == 3 and getattr(layer, "data_format", None) == "channels_first")):
            layer.convolution_op = _reading_the_kernel_first(layer.convolution_op)


def _reading_the_kernel_first(convolution_op):
    def convolution_op_of_a_read_kernel(inputs, kernel):
        # keras.ops.convert_to_tensor casts under mixed precision but passes a tf.Variable through: read it here.
        return convolution_op(inputs, tf.identity(keras.ops.convert_to_tensor(kernel)))

    return convolution_op_of_a_read_kernel


def _warmup_text(warmup_steps, slices):
    """The run report's words for the warm-up's updates.

    >>> _warmup_text(64, 1), _warmup_text(64, 4)
    ('64 updates', '64 batches (256 updates)')
    """
    return f"{warmup_steps} updates" if slices == 1 else f"{warmup_steps} batches ({warmup_steps * slices} updates)"


def _divisor_text(optimizer, slices=1):
    """The run report's words for the divisor of a late gradient under ``optimizer``, a batch in ``slices``.

    >>> _divisor_text(keras.optimizers.SGD(), 1), _divisor_text(keras.optimizers.Adam(), 4)
    ('(1 + its staleness)^2', '(1 + its staleness / 4)')
    """
    staleness = "its staleness" if slices == 1 else f"its staleness / {slices}"
    return f"(1 + {staleness})" + ("^2" if staleness_power(optimizer) == 2 else "")


def _bytes_per_task(variables):
    """``{task: (variable count, bytes)}`` of where ``variables`` live."""
    held = {}
    for variable in variables:
        spec = tf.DeviceSpec.from_string(variable.value.device)
        count, size = held.get(f"{spec.job}:{spec.task}", (0, 0))
        held[f"{spec.job}:{spec.task}"] = (count + 1, size + variable.value.dtype.size * math.prod(variable.shape))
    return held


class _IndexedBatches:
    """One epoch's batches in memory, addressable by their index: every part's examples concatenated, with each
    step's start and size and its share of its batch: a batch per step, or ``slices`` steps per batch.

    A worker's dataset holds the epoch as one element of constants (its
    graph carries them, so workers on other hosts, which cannot read this
    host's files, have them too); a scheduled group reads that element once
    and slices its steps' examples out of it.

    >>> batches = tf.data.Dataset.range(5).batch(3).map(lambda x: (x, -x))
    >>> def steps(slices):
    ...     indexed = _IndexedBatches(batches, slices)
    ...     epoch = next(iter(indexed.dataset()))
    ...     return [_IndexedBatches.batch(epoch, i) for i in range(len(indexed.sizes))]
    >>> [([part.numpy().tolist() for part in step], float(share)) for step, share in steps(1)]
    [([[0, 1, 2], [0, -1, -2]], 1.0), ([[3, 4], [-3, -4]], 1.0)]
    >>> [(step[0].numpy().tolist(), round(float(share), 3)) for step, share in steps(2)]
    [([0, 1], 0.667), ([2], 0.333), ([3], 0.5), ([4], 0.5)]
    """

    def __init__(self, batches, slices=1):
        batches = list(batches.as_numpy_iterator())
        self.whole = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)
        sizes = [_slice_sizes(len(tf.nest.flatten(batch)[0]), slices) for batch in batches]
        self.sizes = np.array([size for batch in sizes for size in batch], np.int64)
        self.shares = np.array([size / sum(batch) for batch in sizes for size in batch], np.float32)

    def dataset(self):
        """The epoch, repeated as one element: ``(whole, starts, sizes, shares)``."""
        starts = np.cumsum(self.sizes) - self.sizes
        return data.untuned(tf.data.Dataset.from_tensors((self.whole, starts, self.sizes, self.shares)).repeat())

    @staticmethod
    def batch(epoch, index):
        """Step ``index``'s examples of ``epoch`` (an element of :meth:`dataset`), counted round the epoch, and
        their share of their batch."""
        whole, starts, sizes, shares = epoch
        index = tf.cast(index, tf.int64) % tf.size(sizes, out_type=tf.int64)
        start, size = starts[index], sizes[index]
        return tf.nest.map_structure(lambda part: part[start:start + size], whole), shares[index]


def _slice_sizes(size, slices):
    """The sizes of the slices a batch of ``size`` examples is trained in: as equal as can be, none empty.

    >>> _slice_sizes(64, 4), _slice_sizes(62, 4), _slice_sizes(3, 4)
    ([16, 16, 16, 16], [16, 16, 15, 15], [1, 1, 1])
    """
    parts = min(slices, size)
    return [size // parts + (i < size % parts) for i in range(parts)]


def _evaluator(prepared):
    """A local copy of ``prepared``, compiled alike, that evaluates the current weights on the coordinator."""
    copy = keras.models.clone_model(prepared)
    config = prepared.get_compile_config()
    config["steps_per_execution"] = 1
    copy.compile_from_config(config)
    return copy
