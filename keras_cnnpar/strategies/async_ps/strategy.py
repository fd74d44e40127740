"""``AsyncPS``: asynchronous parameter-server training on ``ParameterServerStrategy`` + ``ClusterCoordinator``, as a
configuration; its run is :mod:`.run`, its cluster :mod:`.connection`."""

import dataclasses
import sys

import tensorflow as tf

from keras_cnnpar.cluster import network, traffic
from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.cluster.joined import this_process
from keras_cnnpar.strategies import arguments, base, memory
from keras_cnnpar.strategies.async_ps import connection, run
from keras_cnnpar.strategies.base import CheckpointedStrategy, register


@register("async-ps")
class AsyncPS(CheckpointedStrategy):
    """Asynchronous data parallel: workers update variables held by parameter servers, without waiting.

    The model's variables live on the parameter servers, whole, spread
    round-robin over them when ``ps > 1`` (splitting a variable with a
    ``variable_partitioner`` fails in Keras 3's optimizer:
    "ShardedVariable doesn't support being used as a reference"). This process is the coordinator: it schedules groups
    of ``steps_per_execution`` training steps with ``ClusterCoordinator``, and
    whichever worker is free runs the next group (the epoch's next batches)
    and applies its gradients at once. Each step uses the whole ``batch_size``
    on one worker (a slice of it with more than 4 workers, below); an epoch is
    the usual number of steps, spread over the workers. Each scheduled group
    names its batches (the epoch's next
    ``steps_per_execution``, fewer where that would leave a worker idle, in
    order), so an epoch trains on every batch once, as under ``Single``,
    whichever worker runs which group, and a group that
    a lost worker left unfinished runs again on its own batches elsewhere,
    from its first step whose update had not begun: no step is applied twice,
    and the one in flight when the worker died may be lost.

    **What async means.** A worker's gradient was computed from weights that
    other workers may have updated since (its *staleness*). The loss curve is
    therefore noisier than under synchronous training, and a rate that is
    stable for synchronous momentum SGD can diverge. Two defaults keep it
    stable: the first ``warmup_steps`` updates of a run are scheduled one group
    at a time (nothing stale while the gradients are largest), and then each
    step's gradient is divided by ``(1 + staleness) ** 2`` for SGD (with or
    without momentum), so a fresh gradient lands whole and one that is 1
    update late a quarter of it (after Zhang et al., 2016, "Staleness-aware
    Async-SGD", who divide by the staleness; that was not enough for momentum
    SGD, which collapsed to chance in some seeds), and by ``1 + staleness``
    for optimizers that divide their steps by the gradients' running size
    (Adam and kin, :func:`.run.staleness_power`), where the square starved 4
    workers of progress. What validation measures, each epoch's weights and the
    trained model are the weights' moving average over the updates since the
    warm-up (``ema_momentum=0.95``, :class:`.run.WeightAverage`; the workers train
    on the weights themselves): with 4 workers the last update's weights
    carry the noise of the late steps (up to 3.4 points of validation
    accuracy behind Single's after 3 epochs, 0.9-1.9 with the average in
    most runs). The learning
    rate is kept (``scale_lr=None``): each update uses a whole batch, or a slice
    of one weighted by its share, so there is no larger batch to scale for.

    **Many workers.** Each step's gradient lands after the updates in flight
    beside it, about one per other worker. With more than 4 workers each batch
    is therefore trained in ``ceil(workers / 4)`` slices (``batch_slices``):
    each slice is a step and an update of its own, its gradient weighted by
    its share of the batch, so the slices of a batch add up to its gradient and
    the images in flight stay about 4 batches' worth however many workers
    there are; the staleness that divides a gradient is counted in batches (the
    updates in flight divided by the slices). A slice costs its worker a whole
    step's reads and writes, so a worker sends ``slices`` times the bytes per
    image. docs/async.md has the measured
    effect on the three model kinds, seed by seed
    (``benchmarks/async_robustness.py``). Each epoch
    row in the CSV records ``staleness_mean`` and ``staleness_max`` (how many
    other updates a step's gradient may have missed: those begun before it was
    ready to apply that had not landed when it read the weights), and
    ``steps_applied`` (counted on the parameter servers; updates: slices where a
    batch is sliced), ``steps_dropped``
    (staler than ``max_staleness``; the staleness columns count the applied
    steps), ``lost_workers``
    (workers that no longer answer at the epoch's end; their unfinished steps
    ran again on the others). ``loss`` is the mean
    of the steps' losses weighted by their batch sizes, as Keras reports it.
    Smooth the loss curve (e.g. a moving average) before comparing it with a
    synchronous run.

    ``cluster=None`` starts a local cluster of TensorFlow gRPC servers on
    loopback, in the run's coordinator process (each worker with
    ``inter_op_parallelism_threads >= workers + 1``, without which the cluster
    hangs), in a private network namespace where Linux allows one. Otherwise
    the coordinator connects to running servers, e.g. from ``cnnpar cluster
    start``; servers that cannot be reached within ``timeout`` seconds are an
    error, raised when the strategy is created.

    **BatchNormalization.** Each worker normalizes with its own batch's
    statistics, and its moving averages mix the statistics of stale weight
    versions from every worker, which cost the resnet model up to 13 points of
    validation accuracy after 3 epochs while its training accuracy matched
    Single's. So after every epoch the coordinator recomputes the moving mean
    and variance from the current weights over ``precise_bn`` training batches
    ("precise BN", :mod:`keras_cnnpar.keras_compat.precise_bn`); this changes inference
    only, never a training step. ``precise_bn=0`` keeps Keras's averages.

    Validation runs once per epoch on the coordinator, on a copy of the
    current weights. After every epoch a checkpoint of the model, its optimizer
    and the epoch is written (atomically) under ``checkpoint_dir``. A worker
    that dies leaves its steps to the others; a parameter server that dies
    ends the run with ``PeerLost``, naming it, and ``resume=True`` continues
    from the last checkpoint once the servers are back.

    The strategy is a configuration and never joins the cluster itself: every
    run, whether the model or the strategy was created first, is trained by a
    coordinator process of its own (:mod:`keras_cnnpar.strategies.async_ps.remote`),
    because joining a cluster restarts TensorFlow's runtime, which leaves the
    models built before unreadable.

    Example (a local cluster):

    >>> import keras_cnnpar as cnnpar
    >>> strategy = cnnpar.AsyncPS(workers=2, ps=1)    # doctest: +SKIP
    >>> model = cnnpar.models.cnn("2+2")              # doctest: +SKIP
    >>> digits = cnnpar.data.load()                   # doctest: +SKIP
    >>> history = model.fit(digits.x, digits.y, batch_size=64, epochs=3,
    ...                     strategy=strategy)        # doctest: +SKIP

    Args:
        workers: worker tasks of the local cluster (ignored with ``cluster``).
        ps: parameter servers of the local cluster (ignored with ``cluster``).
        cluster: None for a local cluster; else a ``TF_CONFIG``-style
            dict, a jobs map, a ``tf.train.ClusterSpec`` or the path of a JSON
            file, with ``worker`` and ``ps`` jobs, and optionally a ``chief``
            job: the coordinator process, at that address.
        coordinator: ``"HOST:PORT"`` the coordinator process announces to the cluster as
            its coordinator when the spec has no ``chief`` task; the tasks must
            reach it (they pull the checkpoint's values from it). Default: this
            host's address on the interface that routes to the cluster.
        scale_lr: ``None`` (default: keep the rate), ``"sqrt"`` or ``"linear"``.
        staleness_aware: divide each step's gradient by ``(1 + staleness) ** p``,
            ``p`` by the optimizer (:func:`.run.staleness_power`; default True); False
            applies every gradient whole.
        max_staleness: None (default) applies every step's gradient; an int
            drops a step staler than it: its gradient is not applied, and the
            epoch's ``steps_dropped`` counts it (a hard bound on the staleness
            of what moves the weights; the dropped steps' work is lost).
        warmup_steps: batches at the start of a run whose updates are scheduled
            one group of ``steps_per_execution`` at a time, so none is stale
            (default 64; 0: off).
        ema_momentum: the momentum of the moving average of the weights that
            validation, each epoch's weights and the trained model are (default
            0.95, as Keras's optimizer option of that name); None: the last
            update's weights. An optimizer with ``use_ema=True`` keeps its own.
        batch_slices: the steps each batch is trained in, each on a slice of it
            (default None: ``ceil(workers / 4)``, :func:`.run.batch_slices`; 1
            trains whole batches with any number of workers). A learning-rate
            schedule and ``max_staleness`` count updates, ``batch_slices`` per
            batch.
        steps_per_execution: training steps per scheduled function (default 8);
            fewer where an epoch has fewer than that per worker, so that every
            worker has a group (:func:`.run.steps_per_group`).
        timeout: seconds to wait for the servers of ``cluster`` to answer.
        checkpoint_dir: folder of the per-epoch checkpoints (one sub-folder per
            run configuration); None turns them off.
        resume: continue from the checkpoint of an interrupted run, if there is
            one. Without it, an existing checkpoint is an error.
        precise_bn: training batches over which the BatchNormalization moving
            statistics are recomputed after every epoch (default 16; 0: off).
    """

    description = "asynchronous parameter servers, see --workers, --ps, --cluster"
    trains_under_tf_distribute = True
    batch_hooks = "once per epoch (its steps run on the workers, scheduled in groups)"
    steps_run_here = False
    min_devices = 2
    device_option = "workers"
    needs_cluster = True
    elastic = True

    @classmethod
    def host_step(cls, hosts, compute_seconds, link, gradient_bytes, ps=1, workers_beside_ps=False):
        """``hosts - ps`` workers, each on a host of its own, that move in step: they all read every variable at
        once, sharing the parameter servers' links (each carries ``1 / ps`` of the variables), compute the
        step's share of the batch (a slice of it, :func:`.run.batch_slices`, where the workers are many), and all
        write their gradients at once. None without a host for a worker. ``workers_beside_ps``: a worker on
        every host, the parameter servers' hosts included, whose bytes to their own host's server stay off the
        link (``cnnpar plan`` on a cluster).

        Measured across namespace hosts (docs/hosts.md): the parameter server's link carried its bytes at under
        half its rate, so the workers' reads and writes do not interleave; a step waits for every worker's
        bytes in both directions, one after the other.

        >>> step = AsyncPS.host_step(3, 0.072, traffic.Link.parse("1gbit"), 13_000_000)
        >>> round(step.communication_seconds, 3), step.parallel_steps, round(step.images_per_second(64))
        (0.416, 2, 262)
        >>> AsyncPS.host_step(3, 0.072, traffic.Link.parse("1gbit"), 13_000_000, workers_beside_ps=True).parallel_steps
        3
        >>> sliced = AsyncPS.host_step(9, 0.072, traffic.Link.parse("1gbit"), 13_000_000)  # 8 workers: 2 slices
        >>> sliced.compute_seconds, sliced.images_factor
        (0.036, 0.5)
        """
        crossing = hosts - ps  # the workers whose bytes cross the parameter servers' links
        workers = hosts if workers_beside_ps else crossing
        if workers < 1 or crossing < 0:
            return None
        slices = run.batch_slices(None, workers)
        communication = link.seconds(2 * crossing * gradient_bytes / ps, rounds=2)
        return traffic.HostStep(compute_seconds / slices, communication, parallel_steps=workers,
                                images_factor=1 / slices)

    def __init__(self, workers=2, ps=1, cluster=None, *, coordinator=None, scale_lr=None, staleness_aware=True,
                 max_staleness=None, warmup_steps=64, ema_momentum=0.95, batch_slices=None, steps_per_execution=8,
                 timeout=30, checkpoint_dir="checkpoints", resume=False, precise_bn=16):
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
        self.max_staleness = None if max_staleness is None else arguments.non_negative_int("max_staleness",
                                                                                           max_staleness)
        self.warmup_steps = arguments.non_negative_int("warmup_steps", warmup_steps)
        self.ema_momentum = arguments.momentum_or_none("ema_momentum", ema_momentum)
        self.precise_bn = arguments.non_negative_int("precise_bn", precise_bn)
        self.batch_slices = None if batch_slices is None else arguments.positive_int("batch_slices", batch_slices)
        if coordinator is not None:
            cluster_lib.check_coordinator(coordinator)
        self.coordinator_address = coordinator
        if self.spec is not None:
            network.wait_reachable(connection.servers(self.spec), self.timeout)

    def options(self):
        """The options the coordinator process creates this strategy with: every constructor argument as given
        (so none silently takes its default there), the cluster as parsed, the rate already scaled.

        >>> options = AsyncPS(workers=3, warmup_steps=0, scale_lr="linear").options()
        >>> options["workers"], options["warmup_steps"], options["scale_lr"], options["precise_bn"]
        (3, 0, None, 16)
        """
        return {**self.given_options, "workers": self.workers, "ps": self.ps, "cluster": self.spec,
                "scale_lr": None, "checkpoint_dir": self.checkpoint_dir}

    @property
    def devices(self):
        return self.workers

    @property
    def num_replicas(self):
        return self.workers

    @property
    def local_devices(self):
        return 1

    def memory_split(self, model, batch_size):
        """A worker holds the weights and their gradients and a step's slice of a batch; the optimizer's slots
        live on the parameter servers."""
        return dataclasses.replace(memory.replicated(model, batch_size / self.slices), slots_here=False)

    def epoch_events(self, row):
        """A lost worker, from the epoch's ``lost_workers`` column.

        >>> AsyncPS().epoch_events({"lost_workers": 1.0}), AsyncPS().epoch_events({"lost_workers": 0.0})
        (['1 worker(s) lost; their steps ran again on the others'], [])
        """
        lost = int(row.get("lost_workers") or 0)
        return [f"{lost} worker(s) lost; their steps ran again on the others"] if lost else []

    @property
    def slices(self):
        """The slices each batch is trained in with this strategy's workers (:func:`.run.batch_slices`)."""
        return run.batch_slices(self.batch_slices, self.workers)

    def batch_division(self, global_batch):
        """How a batch is divided, for the line of a resume on another worker count.

        >>> AsyncPS(workers=2).batch_division(64), AsyncPS(workers=8).batch_division(64)
        ('each of the 2 workers still takes whole global batches of 64', 'each of the 8 workers takes a slice of \
each global batch of 64: 2 slices a batch')
        """
        if self.slices == 1:
            return f"each of the {self.workers} workers still takes whole global batches of {global_batch}"
        return (f"each of the {self.workers} workers takes a slice of each global batch of {global_batch}: "
                f"{self.slices} slices a batch")

    def __repr__(self):
        where = "local" if self.spec is None else "external"
        return f"<AsyncPS workers={self.workers} ps={self.ps} cluster={where} scale_lr={self.scale_lr}>"

    def _tf_strategy(self):
        joined = this_process.current("async-ps")
        return joined.tf_strategy if joined else None

    def describe(self):
        """The report's first words: the cluster."""
        cluster = "local cluster" if self.spec is None else f"external cluster {self.spec}"
        return f"async-ps: {self.workers} workers, {self.ps} parameter servers ({cluster})"

    def join(self, private_network=False):
        """Make this process the coordinator of the cluster, starting the local one first; once per process.

        Only the coordinator process (:mod:`keras_cnnpar.strategies.async_ps.remote`)
        calls it, before it builds any model: joining restarts TensorFlow's
        runtime under the cluster's device names. ``private_network``: this
        process runs in a network namespace of its own, so its servers need no
        warning.
        """
        cluster = self.spec or connection.local_cluster(self.workers, self.ps)
        network.wait_reachable(connection.servers(cluster), self.timeout)
        chief = cluster_lib.coordinator_address(cluster, self.coordinator_address)
        if not private_network:  # the servers this process started listen on every interface, and so does it
            started = [] if self.spec else [address for addresses in cluster.values() for address in addresses]
            what = "local cluster and its coordinator" if self.spec is None else "coordinator of this run"
            ports = [address.rpartition(":")[2] for address in [*started, chief]]
            print(network.exposure_warning(what, ports), file=sys.stderr, flush=True)
        this_process.join("async-ps", {**cluster, "chief": [chief]}, lambda: connection.connect(cluster, chief))

    def prepare(self, model, settings=None):
        """In the user's process: the run that drives a coordinator process. In the coordinator process (after
        :meth:`join`): the run that trains, with the prepared model's variables on the parameter servers."""
        settings = settings or base.RunSettings()
        prepared, joined = self.prepared_copy(model, settings), this_process.current("async-ps")
        if joined is None:
            # Imported here: the coordinator process runs ``-m ...async_ps.remote``, and a package that imported
            # it first would make Python run it twice there (runpy's RuntimeWarning in the user's stderr).
            from keras_cnnpar.strategies.async_ps import remote

            return remote.CoordinatorProcessRun(self, settings, prepared)
        run.read_kernels_before_xla(prepared)
        self.build_optimizer(prepared)
        checkpoint = None
        if self.checkpoint_dir is not None:
            checkpoint = self.run_checkpoint(prepared, settings)
            checkpoint.restore()
        return run.AsyncRun(self, joined, settings, prepared, checkpoint)

    def replica_batches(self, dataset):
        raise NotImplementedError("each scheduled group of steps reads its own batches of the epoch")

    def probe(self):
        raise NotImplementedError("a one-step probe would need a coordinator process and a cluster of its own")


