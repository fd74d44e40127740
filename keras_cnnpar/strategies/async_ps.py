"""Asynchronous parameter-server training: ``ParameterServerStrategy`` + ``ClusterCoordinator``."""

import contextlib
import functools
import itertools
import json
import math
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar import arguments, checkpoints, network, precise_bn, rebuild
from keras_cnnpar import cluster as cluster_lib
from keras_cnnpar.strategies import async_remote, base, loop
from keras_cnnpar.strategies.base import CheckpointedStrategy, PeerLost, register


@register("async-ps")
class AsyncPS(CheckpointedStrategy):
    """Asynchronous data parallel: workers update variables held by parameter servers, without waiting.

    The model's variables live on the parameter servers, whole, spread
    round-robin over them when ``ps > 1`` (splitting a variable with a
    ``variable_partitioner`` fails in Keras 3's optimizer:
    "ShardedVariable doesn't support being used as a reference"). This process is the coordinator: it schedules groups
    of ``steps_per_execution`` training steps with ``ClusterCoordinator``, and
    whichever worker is free runs the next group on its own stream of batches
    and applies its gradients at once. Each step uses the whole ``batch_size``
    on one worker; an epoch is the usual number of steps, spread over the
    workers. Every worker starts its stream at an offset of its own, so the
    workers do not train on the same batch at the same time.

    **What async means.** A worker's gradient was computed from weights that
    other workers may have updated since (its *staleness*). The loss curve is
    therefore noisier than under synchronous training, and too large a learning
    rate diverges sooner. By default each step's gradient is divided by its
    staleness (at least 1), as staleness-aware async SGD does (Zhang et al.,
    2016): a fresh gradient lands whole, a stale one damped, which kept the
    momentum-SGD 3+3 CNN from diverging with 4 workers; Adam normalizes its
    steps, so it is barely affected. The learning rate is kept
    (``scale_lr=None``): each update uses a whole batch, so there is no larger
    batch to scale for. docs/strategies.md has the measured effect on both
    CNNs. Each epoch
    row in the CSV records ``staleness_mean`` and ``staleness_max`` (how many
    other updates landed between a step reading the weights and its gradient
    being ready to apply), and ``steps_applied`` (counted on the parameter
    servers), ``lost_workers`` (workers that no longer answer at the epoch's
    end; their unfinished steps ran again on the others). ``loss`` is the mean
    of the steps' losses. Smooth the loss curve (e.g. a moving average)
    before comparing it with a synchronous run.

    ``cluster=None`` starts a local in-process cluster of TensorFlow gRPC
    servers on loopback (each worker with ``inter_op_parallelism_threads >=
    workers + 1``, without which the cluster hangs). Otherwise the strategy
    connects to running servers, e.g. from ``cnnpar cluster start``; servers
    that cannot be reached within ``timeout`` seconds are an error.

    **BatchNormalization.** Each worker normalizes with its own batch's
    statistics, and its moving averages mix the statistics of stale weight
    versions from every worker, which cost the resnet model up to 13 points of
    validation accuracy after 3 epochs while its training accuracy matched
    Single's. So after every epoch the coordinator recomputes the moving mean
    and variance from the current weights over ``precise_bn`` training batches
    ("precise BN", :mod:`keras_cnnpar.precise_bn`); this changes inference
    only, never a training step. ``precise_bn=0`` keeps Keras's averages.

    Validation runs once per epoch on the coordinator, on a copy of the
    current weights. After every epoch a checkpoint of the model, its optimizer
    and the epoch is written (atomically) under ``checkpoint_dir``. A worker
    that dies leaves its steps to the others; a parameter server that dies
    ends the run with ``PeerLost``, naming it, and ``resume=True`` continues
    from the last checkpoint once the servers are back.

    Created at the top of the program (before TensorFlow runs in the
    process), the strategy connects this process to the cluster as its
    coordinator, for the rest of the process. Created later (a model already
    exists, as with ``fit(strategy="async-ps")``), it leaves this process out
    of the cluster and trains in a coordinator process of its own
    (:mod:`keras_cnnpar.strategies.async_remote`), which joining a cluster
    after models exist requires.

    Example (in-process cluster):

    >>> import keras_cnnpar as cnnpar
    >>> strategy = cnnpar.AsyncPS(workers=2, ps=1)    # doctest: +SKIP
    >>> model = cnnpar.models.cnn("2+2")              # doctest: +SKIP
    >>> digits = cnnpar.data.load()                   # doctest: +SKIP
    >>> history = model.fit(digits.x, digits.y, batch_size=64, epochs=3,
    ...                     strategy=strategy)        # doctest: +SKIP

    Args:
        workers: worker tasks of the in-process cluster (ignored with ``cluster``).
        ps: parameter servers of the in-process cluster (ignored with ``cluster``).
        cluster: None for an in-process cluster; else a ``TF_CONFIG``-style
            dict, a jobs map, a ``tf.train.ClusterSpec`` or the path of a JSON
            file, with ``worker`` and ``ps`` jobs, and optionally a ``chief``
            job: this process, the coordinator, at that address.
        coordinator: ``"HOST:PORT"`` this process announces to the cluster as
            its coordinator when the spec has no ``chief`` task; the tasks must
            reach it (they pull the checkpoint's values from it). Default: this
            host's address on the interface that routes to the cluster.
        scale_lr: ``None`` (default: keep the rate), ``"sqrt"`` or ``"linear"``.
        staleness_aware: divide each step's gradient by its staleness (default
            True); False applies every gradient whole.
        steps_per_execution: training steps per scheduled function (default 8).
        timeout: seconds to wait for the servers of ``cluster`` to answer.
        checkpoint_dir: folder of the per-epoch checkpoints (one sub-folder per
            run configuration); None turns them off.
        resume: continue from the checkpoint of an interrupted run, if there is
            one. Without it, an existing checkpoint is an error.
        precise_bn: training batches over which the BatchNormalization moving
            statistics are recomputed after every epoch (default 16; 0: off).
    """

    description = "asynchronous parameter servers, see --workers, --ps, --cluster"
    batch_hooks = "once per epoch (its steps run on the workers, scheduled in groups)"
    min_devices = 2
    device_option = "workers"
    needs_cluster = True

    def __init__(self, workers=2, ps=1, cluster=None, *, coordinator=None, scale_lr=None, staleness_aware=True,
                 steps_per_execution=8, timeout=30, checkpoint_dir="checkpoints", resume=False, precise_bn=16):
        super().__init__(checkpoint_dir=checkpoint_dir, resume=resume, timeout=timeout,
                         steps_per_execution=steps_per_execution)
        arguments.positive_int("workers", workers)
        arguments.positive_int("ps", ps)
        if isinstance(cluster, tf.train.ClusterSpec):
            cluster = cluster.as_dict()
        self.spec = None if cluster is None else cluster_lib.parse_spec(cluster)
        self.workers = len(self.spec["worker"]) if self.spec else workers
        self.ps = len(self.spec["ps"]) if self.spec else ps
        self.scale_lr = arguments.scale_lr(scale_lr)
        self.staleness_aware = arguments.flag("staleness_aware", staleness_aware)
        self.precise_bn = arguments.non_negative_int("precise_bn", precise_bn)
        if coordinator is not None:
            cluster_lib.check_coordinator(coordinator)
        self._options = {"workers": self.workers, "ps": self.ps, "cluster": self.spec, "coordinator": coordinator,
                         "staleness_aware": staleness_aware, "steps_per_execution": steps_per_execution,
                         "timeout": timeout, "checkpoint_dir": self.checkpoint_dir, "precise_bn": precise_bn}
        #: This process already runs TensorFlow, so models exist that joining the cluster would orphan: a
        #: coordinator process of its own trains instead (``async_remote``).
        self.remote = _runtime_started()
        if self.remote:
            if self.spec is not None:
                network.wait_reachable(self.spec, self.timeout)
            self.cluster, self._strategy, self.coordinator = self.spec, None, None
            return
        self.cluster = self.spec or _in_process_cluster(self.workers, self.ps)
        network.wait_reachable({job: tasks for job, tasks in self.cluster.items() if job != "chief"}, self.timeout)
        self._strategy, self.coordinator = _connect(json.dumps(self.cluster, sort_keys=True), coordinator)

    def options(self):
        """The options the coordinator process creates this strategy with; the rate arrives already scaled."""
        return {**self._options, "scale_lr": None, "checkpoint_dir": self.checkpoint_dir}

    @property
    def devices(self):
        return self.workers

    @property
    def num_replicas(self):
        return self.workers

    @property
    def local_devices(self):
        return 1

    def __repr__(self):
        where = "in-process" if self.spec is None else "external"
        return f"<AsyncPS workers={self.workers} ps={self.ps} cluster={where} scale_lr={self.scale_lr}>"

    def _tf_strategy(self):
        return self._strategy

    def describe(self):
        """The report's first words: the cluster and how the rate is scaled."""
        return (f"async-ps: {self.workers} workers, {self.ps} parameter servers "
                f"({'in-process' if self.spec is None else 'external'} cluster"
                f"{'' if self.remote else ' ' + str(self.cluster)})")

    def prepare(self, model, settings=None):
        settings = settings or base.RunSettings()
        if self.remote:
            if settings.resume:
                raise ValueError("resume=True needs the strategy created before any model (a model built first "
                                 "trains in a coordinator process of its own, which starts afresh): create "
                                 "cnnpar.AsyncPS(..., resume=True) at the top of the program, or run `cnnpar train "
                                 "--strategy async-ps --resume`. Received: resume=True")
            return RemoteAsyncRun(self, settings, self.prepared_copy(model, settings))
        prepared = self.prepared_copy(model, settings)
        self.build_optimizer(prepared)
        checkpoint = None
        if self.checkpoint_dir is not None:
            checkpoint = checkpoints.RunCheckpoint(prepared, self.checkpoint_folder(prepared), settings.resume,
                                                   dict(settings.record))
            checkpoint.restore()
        return AsyncRun(self, settings, prepared, checkpoint)

    def replica_batches(self, dataset):
        raise NotImplementedError("each worker reads its own stream, from an offset of its own")

    def probe(self):
        if self.remote:
            raise NotImplementedError("a probe step would need a coordinator process of its own too")
        return self.replace(checkpoint_dir=None, resume=False)


class RemoteAsyncRun(base.Run):
    """An ``AsyncPS`` training of a model built before the strategy: a coordinator process trains it
    (:mod:`keras_cnnpar.strategies.async_remote`)."""

    def report(self):
        strategy = self.strategy
        return (f"{strategy.describe()}, trained by a coordinator process of its own: this process built its model "
                f"before the strategy, so it stays out of the cluster; learning rate x{strategy.lr_factor():.3g} "
                f"(scale_lr={strategy.scale_lr})")

    def fit(self, train, *, epochs=1, validation_data=None, callbacks=None, initial_epoch=0, verbose=1,
            steps_per_epoch=None, validation_steps=None, **unsupported):
        steps = loop.epoch_steps(self.strategy, train, steps_per_epoch, unsupported)
        return async_remote.fit(self, train, epochs=epochs, steps=steps, validation_data=validation_data,
                                validation_steps=validation_steps, callbacks=callbacks, initial_epoch=initial_epoch,
                                verbose=verbose)


class AsyncRun(base.Run):
    """An ``AsyncPS`` training with this process as the coordinator: the prepared model (its variables on the
    parameter servers), the per-epoch checkpoint and the precise-BN statistics."""

    def __init__(self, strategy, settings, model, checkpoint):
        super().__init__(strategy, settings, model, checkpoint)
        self.precise = precise_bn.PreciseBatchNorm(model) if strategy.precise_bn else None
        if self.precise is not None and self.precise.statistics is None:  # no BatchNormalization to recompute
            self.precise = None
        self.held = _bytes_per_task(model.weights)

    def report(self):
        strategy = self.strategy
        lines = [f"{strategy.describe()}; learning rate x{strategy.lr_factor():.3g} (scale_lr={strategy.scale_lr})"
                 + ("; each gradient divided by its staleness" if strategy.staleness_aware else "")
                 + (f"; BatchNormalization statistics recomputed from {strategy.precise_bn} batches after each epoch"
                    if self.precise else ""),
                 *(f"{task} holds {count} model variables, {size / 1e6:.1f} MB"
                   for task, (count, size) in sorted(self.held.items())),
                 self.resumed_line()]
        return "\n".join(line for line in lines if line)

    def fit(self, train, *, epochs=1, validation_data=None, callbacks=None, initial_epoch=0, verbose=1,
            steps_per_epoch=None, validation_steps=None, **unsupported):
        strategy, prepared = self.strategy, self.model
        steps = loop.epoch_steps(strategy, train, steps_per_epoch, unsupported)
        rebuild.build_compiled_state(prepared, train.element_spec, strategy.scope())
        async_loop = _AsyncLoop(strategy, prepared, _offset_on_each_worker(train.repeat(), steps),
                                strategy.steps_per_execution)
        evaluator = _evaluator(prepared) if validation_data is not None else None
        statistics_batches = iter(train.repeat()) if self.precise else None  # on the coordinator, for precise BN

        def train_epoch(epoch, callback_list):
            callback_list.on_train_batch_begin(0)
            logs = async_loop.run_epoch(steps)
            if self.precise:
                batches = itertools.islice(statistics_batches, strategy.precise_bn)
                logs["precise_bn_batches"] = float(self.precise.update(prepared, batches))
            callback_list.on_train_batch_end(steps - 1, logs)
            return logs

        def validate():
            evaluator.set_weights(prepared.get_weights())
            return evaluator.evaluate(validation_data, steps=validation_steps, verbose=0, return_dict=True)

        return loop.run_epochs(
            prepared, train_epoch, epochs=epochs, steps=steps, callbacks=callbacks, verbose=verbose,
            initial_epoch=initial_epoch, validate=validate if evaluator is not None else None,
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
            cluster = self.strategy.cluster
            lost = network.unreachable({"ps": cluster["ps"]})
            if not lost:
                raise
            run = self.checkpoint
            saved = (f"the checkpoint after epoch {run.completed_epochs} is in {run.directory}; restart "
                     f"the servers and rerun with resume=True (cnnpar train --resume)"
                     if run and run.completed_epochs else "no epoch was checkpointed yet")
            raise PeerLost(f"lost {', '.join(lost)} of the cluster {cluster} in epoch {epoch + 1}: "
                           f"its variables are gone; {saved}. ({type(error).__name__})") from error


class _AsyncLoop:
    """Schedules an epoch's steps in groups on the workers and gathers their loss, metrics and staleness."""

    def __init__(self, strategy, model, dataset, steps_per_group):
        self.tf_strategy, self.coordinator = strategy._tf_strategy(), strategy.coordinator
        self.workers = {"worker": strategy.cluster["worker"]}
        self.model, self.steps_per_group = model, steps_per_group
        self.staleness_aware = strategy.staleness_aware
        with self.tf_strategy.scope():
            self.applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="applied_updates")
        self.iterator = iter(self.coordinator.create_per_worker_dataset(dataset))
        self._groups = {}

    def run_epoch(self, steps):
        self.model.reset_metrics()
        applied_before = int(self.applied.numpy())
        groups = [self.steps_per_group] * (steps // self.steps_per_group)
        groups += [steps % self.steps_per_group] if steps % self.steps_per_group else []
        results = [self.coordinator.schedule(self._group(size), args=(self.iterator,)) for size in groups]
        self.coordinator.join()
        loss, staleness = np.concatenate([r.fetch() for r in results]).T
        logs = {k: float(v) for k, v in self.model.get_metrics_result().items()}
        return {**logs, "loss": float(loss.mean()), "staleness_mean": float(staleness.mean()),
                "staleness_max": float(staleness.max()),
                "steps_applied": float(int(self.applied.numpy()) - applied_before),
                "lost_workers": float(len(network.unreachable(self.workers)))}

    def _group(self, size):
        """The ``tf.function`` that runs ``size`` steps on one worker (traced once per size)."""
        if size not in self._groups:
            self._groups[size] = self._traced_group(size)
        return self._groups[size]

    def _traced_group(self, size):
        model, applied, tf_strategy = self.model, self.applied, self.tf_strategy
        staleness_aware = self.staleness_aware

        def one_step(batch):
            x, y = batch
            seen = applied.read_value()  # updates applied before this step reads the weights
            with tf.control_dependencies([seen]), tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
                scaled_loss = model.optimizer.scale_loss(loss)  # float16's loss scaling; else the loss itself
            variables = model.trainable_variables
            gradients = tape.gradient(scaled_loss, variables)
            if staleness_aware:
                with tf.control_dependencies(gradients):  # updates that landed since this step read the weights
                    lag = tf.cast(tf.maximum(applied.read_value() - seen, 1), gradients[0].dtype)
                gradients = [g / lag for g in gradients]
            model.optimizer.apply_gradients(zip(gradients, variables))
            model.compute_metrics(x, y, y_pred)
            with tf.control_dependencies(gradients):
                staleness = applied.assign_add(1) - 1 - seen
            return tf.stack([loss, tf.cast(staleness, loss.dtype)])

        @tf.function
        def group(iterator):
            return tf.stack([tf_strategy.run(one_step, args=(next(iterator),)) for _ in range(size)])

        return group


def _runtime_started():
    """Whether this process has started TensorFlow's runtime (built a model, made a tensor)."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def _bytes_per_task(variables):
    """``{task: (variable count, bytes)}`` of where ``variables`` live."""
    held = {}
    for variable in variables:
        spec = tf.DeviceSpec.from_string(variable.value.device)
        count, size = held.get(f"{spec.job}:{spec.task}", (0, 0))
        held[f"{spec.job}:{spec.task}"] = (count + 1, size + variable.value.dtype.size * math.prod(variable.shape))
    return held


def _offset_on_each_worker(batches, window):
    """``batches`` from an offset of its own on every worker, below ``window`` batches.

    Every worker runs the same dataset graph, so with a seeded shuffle they would
    all train on the same batch at the same time. Each worker skips a number of
    batches read from its clock when its iterator starts.
    """
    clock = tf.data.Dataset.from_tensors(0).map(lambda _: tf.cast(tf.timestamp() * 1e6, tf.int64))
    return clock.flat_map(lambda microseconds: batches.skip(microseconds % window))


def _evaluator(prepared):
    """A local copy of ``prepared``, compiled alike, that evaluates the current weights on the coordinator."""
    copy = keras.models.clone_model(prepared)
    config = prepared.get_compile_config()
    config["steps_per_execution"] = 1
    copy.compile_from_config(config)
    return copy


@functools.cache
def _in_process_cluster(workers, ps, tries=3):
    """Start ``workers`` + ``ps`` TensorFlow gRPC servers in this process, once; return their spec.

    The ports are chosen free, then bound by TensorFlow, which takes no socket
    that is already bound; when another process took one in between, the
    servers start again on fresh ports, ``tries`` times in all.
    """
    for attempt in range(1, tries + 1):
        spec = cluster_lib.local_spec(workers, ps)
        try:
            _in_process_cluster.servers = _start_servers(spec, workers)
            break
        except (tf.errors.OpError, RuntimeError) as error:
            if attempt == tries:
                raise ConnectionError(f"cannot start the in-process cluster: {tries} tries on fresh ports failed; "
                                      f"the last one: {error}") from None
    ports = [address.rpartition(":")[2] for addresses in spec.values() for address in addresses]
    print(network.exposure_warning("in-process cluster", ports), file=sys.stderr, flush=True)
    return spec


def _start_servers(spec, workers):
    cluster_spec = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=workers + 1)
    return [
        *(tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=config, protocol="grpc")
          for i in range(workers)),
        *(tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, protocol="grpc")
          for i in range(len(spec.get("ps", ())))),
    ]


@functools.cache
def _connect(spec_json, coordinator=None):
    """Connect this process to the cluster as its coordinator (task ``chief:0`` at the address of
    ``cluster.coordinator_address``); one connection per cluster and process."""
    spec = json.loads(spec_json)
    spec = {**spec, "chief": [cluster_lib.coordinator_address(spec, coordinator)]}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)  # whole variables, round-robin over the ps tasks
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)

