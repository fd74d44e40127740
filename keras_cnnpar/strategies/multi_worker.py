"""Sync data parallel across processes or hosts: ``tf.distribute.MultiWorkerMirroredStrategy``."""

import contextlib
import itertools
import json
import re
import signal
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.cluster import assembly, environments, local_workers, network, traffic
from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.cluster.joined import this_process
from keras_cnnpar.strategies import arguments, base, compression
from keras_cnnpar.strategies.base import CheckpointedStrategy, PeerLost, register
from keras_cnnpar.strategies.single import Single


class Preempted(SystemExit):
    """Raised in every worker after a preemption checkpoint was saved; exits with code 42."""

    def __init__(self, checkpoint_dir):
        super().__init__(local_workers.PREEMPTED_EXIT_CODE)
        self.checkpoint_dir = checkpoint_dir

    def __str__(self):
        return f"checkpoint saved in {self.checkpoint_dir}; rerun with resume=True (--resume) to continue"


@register("multi-worker")
class MultiWorker(CheckpointedStrategy):
    """Sync data parallel across processes or hosts, on ``MultiWorkerMirroredStrategy``.

    Every worker process holds a full replica of the model (one per local GPU,
    or one on the CPU). Each step splits the global ``batch_size`` evenly across
    all replicas of all workers: worker ``i`` gets the ``i``-th slice of every
    batch, so the workers see different examples and, together, the same
    batches as :class:`DataParallel` over as many devices. The gradients are
    all-reduced across workers and every replica applies the same update. Every
    worker shuffles with the same seed, which keeps the slices disjoint.

    Keras 3's ``fit`` fails under this strategy (keras-team/keras#20585); the
    prepared copy of the model gets a contained fix, so Keras's ``fit``,
    callbacks and ``History`` work as usual and no other model is touched.

    Only the chief (the ``chief`` task, or worker 0) writes the run's CSVs,
    log, weights and exports. A SIGTERM to any worker makes all of them save a
    checkpoint at the same step (``PreemptionCheckpointHandler``) and exit with
    code 42; ``resume=True`` (``cnnpar train --resume``) then restores it and
    trains the remaining epochs, starting again at the interrupted epoch's first
    step with the weights saved at preemption. A worker that dies makes the
    others fail after ``timeout`` seconds instead of waiting forever.

    TensorFlow joins a cluster only before it starts its runtime. Start the
    program with ``cnnpar launch --workers N -- python script.py`` (on several
    hosts: ``CNNPAR_MULTI_WORKER=1`` beside ``TF_CONFIG``): ``import
    keras_cnnpar`` then joins at once, and the script may build its model
    before ``fit(strategy="multi-worker")``. Otherwise create the strategy
    before any model or tensor. ``cnnpar train --strategy multi-worker
    --workers 2`` runs the CLI's own training that way.

    Example (a script run by ``cnnpar launch --workers 2 -- python script.py``):

    >>> import keras_cnnpar as cnnpar                # joins the cluster here
    >>> model = cnnpar.models.cnn("2+2")              # doctest: +SKIP
    >>> digits = cnnpar.data.load()                   # doctest: +SKIP
    >>> history = model.fit(digits.x, digits.y, batch_size=64, epochs=3,
    ...                     strategy="multi-worker")  # doctest: +SKIP

    Args:
        cluster: None reads the environment's cluster: ``TF_CONFIG``, else
            under ``srun`` the Slurm job step's, else a Kubernetes Indexed
            Job's (:mod:`keras_cnnpar.cluster.environments`); else a
            ``TF_CONFIG``-style dict or the path of a JSON file holding one.
        checkpoint_dir: folder of the preemption checkpoints (one sub-folder per
            run configuration); None turns preemption handling off.
        resume: restore the checkpoint of a preempted run, if there is one.
            Without it, an existing checkpoint is an error, so none is lost.
        timeout: seconds a worker waits for its peers, to assemble the
            cluster at the start (then the process exits with code 1) and in
            every collective operation (then ``PeerLost`` is raised).
        scale_lr: ``"linear"``, ``"sqrt"`` or ``None`` (default), as in
            :class:`DataParallel`.
        accumulate: micro-batches of ``batch_size`` per step, as in
            :class:`DataParallel`: one all-reduce per ``accumulate`` micro-batches.
        sync_batchnorm: ``BatchNormalization`` statistics over the global
            batch of all workers (default True), as in :class:`DataParallel`.
        compression: ``"bfloat16"`` halves the bytes each step sends between
            hosts, ``"powersgd"`` sends rank ``powersgd_rank`` factors of the
            large gradients (docs/slow_links.md), as in :class:`DataParallel`;
            the preemption checkpoint keeps PowerSGD's error feedback.
        powersgd_rank: PowerSGD's rank (default 4), with ``compression="powersgd"``.
        pack_bytes: all-reduce the gradients in packs of about that many
            bytes, the last layers' first, so that a pack can cross the link
            while the backward pass computes the layers before it; None
            (default): one all-reduce a step (docs/slow_links.md: the measured
            overlap).
        all_reduce_dtype: the former spelling of ``compression="bfloat16"``
            (deprecated).
    """

    description = "sync data parallel across processes, see --workers"
    trains_under_tf_distribute = all_reduces_gradients = True
    min_devices = 1  # a cluster of one worker: a run resumed on fewer hosts
    device_option = "workers"
    needs_cluster = True
    elastic = True
    #: Every worker shuffles alike, so each gets a different slice of the same batches.
    shuffle_seed = 0

    @classmethod
    def configurations(cls, devices, batch_size):
        """None: its workers are processes that ``cnnpar launch`` starts, each one a ``fit``, not devices here."""
        return []

    @classmethod
    def host_step(cls, hosts, compute_seconds, link, gradient_bytes, accumulate=1, all_reduces=1):
        """Each host computes its share of ``accumulate`` global batches, then the hosts all-reduce the gradient
        in a ring (:func:`traffic.ring_all_reduce`), as TensorFlow's collectives do between CPU hosts:
        ``gradient_bytes`` as sent (compressed: :func:`.compression.sent_floats`), in ``all_reduces`` rounds of
        the ring (PowerSGD's two).

        >>> step = MultiWorker.host_step(2, 0.072, traffic.Link.parse("1gbit"), 13_000_000)
        >>> round(step.compute_seconds, 3), round(step.communication_seconds, 3), round(step.images_per_second(64))
        (0.036, 0.104, 457)
        """
        ring = traffic.ring_all_reduce(gradient_bytes, hosts)
        return traffic.HostStep(accumulate * compute_seconds / hosts,
                                link.seconds(ring, rounds=2 * (hosts - 1) * all_reduces), images_factor=accumulate)

    def __init__(self, cluster=None, *, checkpoint_dir="checkpoints", resume=False, timeout=60, scale_lr=None,
                 accumulate=1, sync_batchnorm=True, compression=None,
                 powersgd_rank=None, pack_bytes=None, all_reduce_dtype=None):
        super().__init__(checkpoint_dir=checkpoint_dir, resume=resume, timeout=timeout, steps_per_execution=1,
                         accumulate=accumulate)
        self.sync_batchnorm = arguments.flag("sync_batchnorm", sync_batchnorm)
        self.compression, self.powersgd_rank = arguments.compression(compression, powersgd_rank, all_reduce_dtype)
        self.pack_bytes = arguments.pack_bytes(pack_bytes, self.compression)
        self.task = cluster_lib.Task.parse(cluster) if cluster is not None else environment_task()
        self.is_chief = self.task.is_chief
        self.scale_lr = arguments.scale_lr(scale_lr)
        self._strategy = joined(self.task, self.timeout)
        # One function for every call (a plan gathers a few figures at a time): traced once per length of them.
        self._rows_summed = tf.function(self._replica_rows_summed, reduce_retracing=True)
        self._first_replicas_summed = tf.function(self._first_replica_sum, reduce_retracing=True)

    def _gradient_sum(self, model):
        if self.pack_bytes is None:
            return super()._gradient_sum(model)
        return compression.reducer(self.compression, pack_bytes=self.pack_bytes)

    @property
    def devices(self):
        return self._strategy.num_replicas_in_sync

    @property
    def batch_pieces(self):
        return self.num_replicas

    @property
    def num_replicas(self):
        return self.devices

    @property
    def local_devices(self):
        return 1  # the strategy takes every local GPU, or the CPU, itself

    def __repr__(self):
        return (f"<MultiWorker workers={self.task.num_workers} replicas={self.num_replicas} "
                f"task={self.task.type}:{self.task.index}>")

    def _tf_strategy(self):
        return self._strategy

    def distribute(self, dataset):
        """This worker's part of ``dataset`` (batched by the global batch): its slice of every batch."""
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return self._strategy.experimental_distribute_dataset(dataset.with_options(options))

    def probe(self):
        raise NotImplementedError("a one-step probe beside the run would need every worker to take part")

    def gathered(self, values):
        """``values`` (floats) of every replica, in replica order (the chief's first), on every worker: each
        worker passes its own; an all-reduce sums a matrix in which each replica fills its own row."""
        summed = self._rows_summed(tf.constant(values, tf.float32))
        return self._strategy.experimental_local_results(summed)[0].numpy().tolist()

    def _replica_rows_summed(self, mine):
        replicas = self._strategy.num_replicas_in_sync

        def each_in_its_row():
            context = tf.distribute.get_replica_context()
            row = tf.one_hot(context.replica_id_in_sync_group, replicas)
            return context.all_reduce("SUM", row[:, None] * mine[None, :])

        return self._strategy.run(each_in_its_row)

    def barrier(self, name):
        """Wait until every worker has called ``barrier(name)`` (TensorFlow's coordination service), for at most
        ``timeout`` seconds; each name once a process. For after the last all-reduce of a job: a worker that exits
        while another still pulls that all-reduce's bytes from it fails it there ("Socket closed": the chief of a
        cluster plan, in one CI run)."""
        from tensorflow.python.eager import context

        context.context().wait_at_barrier(f"keras_cnnpar/{name}", int(1000 * self.timeout))

    def publish(self, name, value):
        """On the chief: hand ``value`` (JSON-ready) to every worker that waits in :meth:`published` (TensorFlow's
        coordination service's key-value store; a name once a process). For what takes longer than a collective
        may wait (``timeout``): a trial, a training."""
        from tensorflow.python.eager import context

        context.context().set_config_key_value(f"keras_cnnpar/{name}", json.dumps(value))

    def published(self, name):
        """On the other workers: what the chief publishes as ``name``, waited for without a time limit."""
        from tensorflow.python.eager import context

        return json.loads(context.context().get_config_key_value(f"keras_cnnpar/{name}"))

    def from_chief(self, values):
        """``values`` (floats) as the chief has them, on every worker (each passes its own): what every worker
        must agree on."""
        (chief,) = self.broadcast([np.asarray(values, np.float64)])
        return chief.tolist()

    def broadcast(self, arrays):
        """``arrays`` (NumPy) as the chief's first replica has them, on every worker: each worker passes arrays of
        the same shapes and dtypes, and an all-reduce (one a dtype) sums them with every other replica's zeroed (floats
        travel in their own dtype, so the chief's values arrive exact; other dtypes as float64)."""
        sent = [tf.constant(a, a.dtype if np.issubdtype(a.dtype, np.floating) else np.float64) for a in arrays]
        received = [None] * len(sent)
        for dtype in {t.dtype for t in sent}:  # one all-reduce a dtype: TensorFlow packs alike tensors only
            alike = [index for index, t in enumerate(sent) if t.dtype == dtype]
            summed = self._strategy.experimental_local_results(self._first_replicas_summed([sent[i] for i in alike]))
            for index, value in zip(alike, summed[0]):
                received[index] = value
        return [value.numpy().astype(a.dtype) for value, a in zip(received, arrays)]

    def _first_replica_sum(self, sent):
        def the_first_replicas():
            context = tf.distribute.get_replica_context()
            first = tf.equal(context.replica_id_in_sync_group, 0)
            return context.all_reduce("SUM", [t * tf.cast(first, t.dtype) for t in sent])

        return self._strategy.run(the_first_replicas)

    def all_reduce_seconds(self, size, repeats=5):
        """The median seconds of this worker's all-reduce of ``size`` bytes of float32 with the other workers
        (traced, and the channels warmed, first); every worker must call it alike."""
        elements = max(1, size // 4)

        @tf.function
        def all_reduce():
            return self._strategy.run(
                lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([elements])))

        all_reduce()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self._strategy.experimental_local_results(all_reduce())[0].numpy()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def prepare(self, model, settings=None):
        settings = settings or base.RunSettings()
        prepared = self.prepared_copy(model, settings)
        checkpoint = None
        if self.checkpoint_dir is not None:
            self.build_optimizer(prepared)
            checkpoint = _PreemptionCheckpoint(self._strategy, self.task, self.run_checkpoint(prepared, settings))
        return MultiWorkerRun(self, settings, prepared, checkpoint)


class MultiWorkerRun(base.Run):
    """A ``MultiWorker`` training on this worker: the prepared replica and its preemption checkpoint."""

    #: The workers take every step together, so a preemption checkpoint may come after any step.
    steps_together = True

    def report(self):
        strategy = self.strategy
        lines = [f"multi-worker: {strategy.task.num_workers} workers, {strategy.num_replicas} replicas, "
                 f"this is {strategy.task.type} {strategy.task.index}{' (chief)' if strategy.is_chief else ''}",
                 self.changes_line(), self.resumed_line()]
        return "\n".join(line for line in lines if line)

    def fit(self, train, *, validation_data=None, callbacks=(), **fit_kwargs):
        strategy, task = self.strategy, self.strategy.task
        train, validation = self.inputs(train, validation_data)
        if self.checkpoint is not None:
            callbacks = [self.checkpoint.callback(each_step=self.steps_together), *callbacks]
        try:
            return self.model.fit(train, validation_data=validation, callbacks=callbacks, shuffle=False,
                                  **fit_kwargs)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError) as error:
            lost = _lost_peers(task, error.message)
            raise PeerLost(f"{task.type} {task.index}: training stopped because a peer failed or did not "
                           f"answer within timeout={strategy.timeout} s; lost: {', '.join(lost) or 'unknown'}. "
                           f"({type(error).__name__})") from error
        finally:
            if self.checkpoint is not None:
                self.checkpoint.stop_watching()

    def inputs(self, train, validation=None):
        """``train`` and ``validation`` (batched by the global batch) as this worker reads them: every replica its
        part of each batch; the prepared model is made ready for them (keras-team/keras#20585)."""
        _contain_keras_20585(self.model, train.element_spec)
        distribute = self.strategy.distribute
        return distribute(train), distribute(validation) if validation is not None else None


class SingleOnChief(Single):
    """``Single`` on the chief of a joined MultiWorker cluster while the other workers wait: what
    ``strategy="auto"`` chooses on a cluster where one host trains faster than all of them together (the link
    costs more than the hosts add; docs/hosts.md).

    The chief trains as ``Single`` trains, and writes the run's files as a
    Single run. Every other worker trains nothing: its ``fit`` returns when the
    chief's does, with the chief's ``History`` and the chief's trained weights in
    its model (the optimizer's state stays the chief's; its callbacks are not
    called). The chief hands both over through TensorFlow's coordination
    service (the ``History``, or the chief's error, which the others raise as
    ``PeerLost``) and one all-reduce (the weights).

    Example (a script run on every host by ``cnnpar launch`` or ``srun``; ``strategy="auto"`` makes this choice
    itself where it measures single faster):

    >>> import keras_cnnpar as cnnpar                     # joins the cluster here
    >>> strategy = cnnpar.strategies.SingleOnChief(cnnpar.MultiWorker())  # doctest: +SKIP
    >>> history = model.fit(x, y, batch_size=64, epochs=3,
    ...                     strategy=strategy)            # doctest: +SKIP

    Args:
        cluster: the joined :class:`MultiWorker` whose chief trains.
    """

    #: Each ``fit`` under this strategy in a process: its hand-over's key (every worker calls ``fit`` alike).
    _runs = itertools.count()

    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster
        self.is_chief = cluster.is_chief
        self.trains_here = cluster.is_chief

    def __repr__(self):
        return f"<SingleOnChief of {self.cluster!r}>"

    def prepare(self, model, settings=None):
        settings = settings or base.RunSettings()
        return SingleOnChiefRun(self, settings, self.prepared_copy(model, settings), key=next(self._runs))


class SingleOnChiefRun(base.Run):
    """A :class:`SingleOnChief` training on this worker: the chief's Keras ``fit``, or the wait for it."""

    def __init__(self, strategy, settings, model, key):
        super().__init__(strategy, settings, model)
        self.key = f"single-on-chief/{key}"

    def report(self):
        task = self.strategy.cluster.task
        return (f"single on the chief of {task.num_workers} workers; this is {task.type} {task.index}"
                + (" (chief): it trains" if task.is_chief else ": it waits for the chief's trained weights"))

    def fit(self, train, **fit_kwargs):
        cluster = self.strategy.cluster
        if not cluster.is_chief:
            handed = cluster.published(self.key)  # when the chief's training ends
            if "error" in handed:
                raise PeerLost(f"the chief's training failed: {handed['error']}")
            history = keras.callbacks.History()
            history.history, history.epoch = handed["history"], handed["epoch"]
            return history
        try:
            history = super().fit(train, **fit_kwargs)
        except BaseException as error:
            cluster.publish(self.key, {"error": f"{type(error).__name__}: {error}"})
            raise
        logs = {name: [float(value) for value in values] for name, values in history.history.items()}
        cluster.publish(self.key, {"history": logs, "epoch": history.epoch})
        return history

    def finalize(self, model):
        """The chief copies its trained state into the user's ``model``; every worker then gets its weights."""
        if self.strategy.is_chief:
            super().finalize(model)
        model.set_weights(self.strategy.cluster.broadcast(model.get_weights()))


def _lost_peers(task, message):
    """The peers of ``task`` that a failed collective lost: those its error ``message`` names, else (a collective
    that timed out names none) those that accept no TCP connection now, as ``/job:worker/replica:0/task:1``."""
    own = f"/job:{task.type}/replica:0/task:{task.index}"
    named = sorted(set(re.findall(r"/job:\w+/replica:\d+/task:\d+", message)) - {own})
    if named:
        return named
    silent = (name.split(":") for name in network.unreachable(task.cluster))
    return sorted({f"/job:{job}/replica:0/task:{index}" for job, index in silent} - {own})


def joined(task=None, timeout=60):
    """The ``MultiWorkerMirroredStrategy`` of ``task`` (default: the environment's, :func:`environment_task`),
    joining its cluster once per process (:data:`keras_cnnpar.cluster.joined.this_process`). ``import
    keras_cnnpar`` calls it when ``cnnpar launch`` started the process, so the cluster is joined before any model
    exists; a later ``MultiWorker()`` of the same task gets the same strategy (and the collective timeout it was
    joined with)."""
    task = task or environment_task()
    return this_process.join("multi-worker", task.tf_config(), lambda: _join_cluster(task, timeout))


def environment_task():
    """This process's task as its environment describes it (``TF_CONFIG``, a Slurm job step, a Kubernetes Indexed
    Job: :func:`keras_cnnpar.cluster.environments.detect`), with its share of the node's GPUs; without any, a
    ``ValueError`` that says how to give one."""
    environment = environments.resolve()
    task = environment.task()
    environment.assign_devices()
    return task


def _join_cluster(task, timeout):
    """Start this task's gRPC server and join the cluster; return the ``MultiWorkerMirroredStrategy``.

    TensorFlow waits for every peer to register without a limit, inside a call
    that holds the interpreter; a watch (:func:`keras_cnnpar.cluster.assembly.watched`)
    names the peers that never answered and ends the process after ``timeout`` seconds.
    """
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(task.cluster), task_type=task.type, task_id=task.index, rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    who = f"{task.type} {task.index}"
    print(f"{who}: joining the cluster {task.cluster}; the process exits if it has not assembled within "
          f"timeout={timeout} s", file=sys.stderr, flush=True)
    with assembly.watched(who, task.cluster, timeout):
        _coordinate(task, timeout)
        try:
            return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)
        except RuntimeError as error:
            raise RuntimeError(
                f"cannot join the cluster: {error}. TensorFlow joins a cluster only before its runtime starts: start "
                f"the program with `cnnpar launch --workers N` (on several hosts: {cluster_lib.JOIN_AT_IMPORT}=1 "
                f"beside TF_CONFIG), which joins when keras_cnnpar is imported, or create cnnpar.MultiWorker() "
                f"before building any model or tensor.") from None


def heartbeat_timeout(timeout):
    """The seconds without a heartbeat after which TensorFlow's coordination service declares a worker lost:
    half the collective ``timeout``.

    TensorFlow's own 10 s declared a live worker lost on a loaded 2-core machine (three workers resuming
    beside other training processes: the chief's heartbeats to its own service came late), so the default
    timeout of 60 s waits 30 s.

    >>> heartbeat_timeout(60), heartbeat_timeout(10)
    (30.0, 5.0)
    """
    return timeout / 2


def _coordinate(task, timeout):
    """Configure TensorFlow's coordination service as ``MultiWorkerMirroredStrategy`` would (which then keeps
    it), with the heartbeat timeout :func:`heartbeat_timeout`; TensorFlow's public API has no setting for it.

    A host whose link goes down is caught twice: by the coordination service's heartbeats and by the
    collective timeout. When both aborted the collectives at once (``--collective-timeout 10``), TensorFlow
    now and then corrupted a mutex ("Mutex corrupt: waiting writer with no waiters") and the chief died of
    SIGABRT before it could say which peer it lost. With the heartbeats at half the timeout, the lost host is
    named by them seconds after its link went down (docs/hosts.md), before any collective times out."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    spec = tf.train.ClusterSpec(task.cluster)
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
            for job in ("chief", "worker") if job in spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=multi_worker_util.coordination_leader(spec),
        heartbeat_timeout_in_ms=int(1000 * heartbeat_timeout(timeout)), coordinated_jobs=jobs)


def _contain_keras_20585(model, element_spec):
    """Let Keras's ``fit`` run on this ``model`` instance under ``MultiWorkerMirroredStrategy``.

    Keras 3 fails there in two places (keras-team/keras#20585):

    1. ``_maybe_symbolic_build`` reduces a ``PerReplica`` input batch with
       ``strategy.reduce``. The model, its loss and metrics are built from the
       dataset's element spec instead (``base.build_before_fit``).
    2. The step's logs are reduced with ``strategy.reduce("MEAN", value, axis=0)``,
       which rejects scalars. The logs are equal on every replica (the metrics
       are synced), so they are given shape ``[1]`` and the mean is their value.

    Only the attributes of this instance change; Keras's classes stay as they are.
    """
    base.build_before_fit(model, element_spec)
    model.train_step = _logs_as_vectors(model.train_step)
    model.test_step = _logs_as_vectors(model.test_step)


def _logs_as_vectors(step):
    def step_with_vector_logs(data):
        return {name: tf.reshape(value, [1]) for name, value in step(data).items()}

    return step_with_vector_logs


class _PreemptionCheckpoint:
    """A run's preemption checkpoint: the prepared model, its optimizer and the completed epochs.

    ``PreemptionCheckpointHandler`` watches for SIGTERM on every worker; the
    workers agree on the point to save at, a call of :meth:`save_if_preempted`
    that comes at the same point of the training on every worker: after each
    step (the callback's), or where they meet. The chief writes to
    ``directory``, the other workers to temporary folders beside it that are
    removed when they finish.
    """

    def __init__(self, strategy, task, run_checkpoint):
        self.task = task
        self._run = run_checkpoint
        self.directory = directory = run_checkpoint.directory
        self.changes = run_checkpoint.changes
        #: The folders that this worker creates (the deepest first): a worker that is not the chief leaves none.
        self._created = [folder for folder in (directory, *directory.parents) if not folder.exists()]
        self._sigterm = signal.getsignal(signal.SIGTERM)
        config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, grace_period=0)
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(  # restores a checkpoint it finds
            strategy.cluster_resolver, self._run.checkpoint, str(self._run.preemption_folder), config)
        self.completed_epochs = self._run.completed_epochs

    def _exit(self):
        if self.task.is_chief:
            self._run.record_config()
        raise Preempted(self.directory)

    def save_if_preempted(self):
        """Where a worker was preempted, save when every worker reached the agreed call of this, then stop."""
        self._handler.save_checkpoint_if_preempted()

    def callback(self, each_step=True):
        """The callback that counts completed epochs and, with ``each_step``, saves after a step where preempted
        (workers that step apart call :meth:`save_if_preempted` where they meet instead)."""
        checkpoint = self

        class SaveIfPreempted(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if each_step:
                    checkpoint.save_if_preempted()

            def on_epoch_end(self, epoch, logs=None):
                checkpoint._run.epochs.assign(epoch + 1)

        return SaveIfPreempted()

    def stop_watching(self):
        """Give SIGTERM its previous meaning again (the handler keeps its own until then)."""
        signal.signal(signal.SIGTERM, self._sigterm)

    def remove(self):
        """Delete this worker's checkpoint folder once the run completed: the run's (the chief), or this run's
        temporary one (``RUN/workertemp_I``), never another run's."""
        self._run.remove(None if self.task.is_chief else self.directory / f"workertemp_{self.task.index}")
        if not self.task.is_chief:
            for folder in self._created:
                with contextlib.suppress(OSError):  # not empty: another run's, or the chief's on a shared disk
                    folder.rmdir()
