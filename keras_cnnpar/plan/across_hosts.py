"""``cnnpar plan`` on a cluster: single, multi-worker, multi-worker with accumulation or compressed gradients,
local steps and async-ps measured on the hosts themselves, each beside its prediction, ranked by what was
measured.

Run it on every host as any MultiWorker job runs: ``cnnpar launch --workers N
-- cnnpar plan`` on one machine, ``srun cnnpar plan`` under Slurm, or with
``TF_CONFIG`` (and ``CNNPAR_MULTI_WORKER=1``) set on each host. Every host
takes part in every measurement; only the chief prints the table and writes
``--out``. In order:

1. the link as TensorFlow's collectives see it (:func:`measure_link`): an
   all-reduce of 4 bytes gives the latency of its ``2 (N - 1)`` rounds, larger
   ones the rate;
2. one host's step: Single's trial on every host at once, each on its own
   (every host's figure is printed; where the slowest host trains at under
   :data:`UNEVEN` of the fastest's images/s, multi-worker steps at its pace,
   and the plan says that async-ps does not wait for it);
3. MultiWorker's trial on all hosts, beside its prediction from 1 and 2
   (``MultiWorker.host_step``); the time it took beyond that is TensorFlow's
   transport (``HostStep.transport_to``), which calibrates what follows;
4. MultiWorker accumulating the ``K`` batches per all-reduce that the
   calibrated prediction says bring communication under 20% of the step
   (:func:`scaling.accumulation_for`), beside that prediction;
5. MultiWorker sending its gradients in bfloat16, then as PowerSGD's
   factors (``compression``), each beside its calibrated prediction from the
   bytes it sends, each saying what it changes in the training;
6. LocalSteps with the inner steps ``H`` that bring its exchange under 20% of
   the step (at most :data:`scaling.MAX_INNER_STEPS`), timed over epochs of
   ``H`` steps (one exchange each), beside its prediction with multi-worker's
   transport spread over the ``H`` steps;
7. AsyncPS with a worker on every host and its parameter server beside the
   chief's worker, each a TensorFlow server that its host runs for the trial,
   beside its prediction from the link alone (``AsyncPS.host_step``).

:func:`choose` is ``fit(strategy="auto")`` on a cluster: steps 1 to 3, then what
measured faster, multi-worker or single on the chief.

The hosts must agree on what to run next, so the figures that decide it are
the chief's, sent to every host by an all-reduce (``MultiWorker.from_chief``),
or, for a figure that takes longer than a collective may wait (the async-ps
trial), through TensorFlow's coordination service (``MultiWorker.publish``).
The chief prints the ``cnnpar plan --hosts`` command that predicts larger
clusters from the multi-worker figure.

>>> row = Row("multi-worker, 2 hosts", 294.0, 438.0, 0.74, "")
>>> round(row.measured_over_predicted, 2)
0.67
"""

import dataclasses
import itertools
import math
import sys

from keras_cnnpar import strategies
from keras_cnnpar.cluster import network, servers, traffic
from keras_cnnpar.plan import figures, planner, scaling
from keras_cnnpar.strategies import arguments, compression

#: Repeats of each timed all-reduce of :func:`measure_link`; the median counts.
LINK_REPEATS = 5
#: The largest all-reduce :func:`measure_link` times, in bytes.
LARGEST_BYTES = 2**28
#: The slowest host's Single images/s over the fastest's under which the plan advises async-ps.
UNEVEN = 0.8
#: The plans measured in this process (each one's barrier has a name of its own; every host plans alike).
_plans = itertools.count()
#: The columns of the cluster plan's ``plan.csv``.
COLUMNS = ("configuration", "images_per_second", "predicted_images_per_second", "communication_share", "advice")


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration measured on the cluster: images/s measured and predicted, the predicted communication
    share, and what to try."""

    configuration: str
    images_per_second: float
    predicted_images_per_second: float
    communication_share: float
    advice: str

    @property
    def measured_over_predicted(self):
        return self.images_per_second / self.predicted_images_per_second


@dataclasses.dataclass
class ClusterPlan:
    """The rows of a plan measured on ``hosts`` hosts (fastest first), what they were measured with, and Single's
    images/s on each host (the chief's first)."""

    model: str
    hosts: int
    batch_size: int
    link: traffic.Link
    step_seconds: float
    transport_seconds: float
    rows: list
    single_per_host: tuple

    def table(self):
        lines = [f"{self.model} on {self.hosts} hosts; the link as TensorFlow's all-reduce sees it: {self.link}; "
                 f"one host's step {self.step_seconds * 1e3:.1f} ms",
                 f"{'configuration':36s} {'images/s':>8s} {'predicted':>9s} {'comm':>5s}  advice"]
        lines += [f"{r.configuration:36s} {r.images_per_second:8.0f} {r.predicted_images_per_second:9.0f} "
                  f"{r.communication_share:5.0%}  {r.advice}" for r in self.rows]
        lines.append(f"TensorFlow's transport added {self.transport_seconds * 1e3:.0f} ms a step to multi-worker "
                     f"beyond the link's bytes and latency (the predictions after it include it)")
        lines.append(uneven_hosts(self.single_per_host))
        return "\n".join(lines)

    def hosts_command(self):
        """The ``cnnpar plan --hosts`` command that predicts larger clusters from these measurements (add an
        async-ps run's figure as ``--measured async-ps:HOSTS=IMAGES/S``)."""
        synced = next(r for r in self.rows if r.configuration == _synced_name(self.hosts))
        rate = f"{self.link.bits_per_second / 1e6:.0f}mbit"
        return (f"cnnpar plan --model {self.model} --batch-size {self.batch_size} --hosts {4 * self.hosts} --link "
                f"{rate} --latency {self.link.latency_seconds * 1e3:.3g}ms --step-seconds {self.step_seconds:.4g} "
                f"--measured multi-worker:{self.hosts}={synced.images_per_second:.0f}")

    def save(self, folder):
        """Write ``plan.csv`` and ``plan.png`` (measured and predicted images/s of each row) into ``folder``, both
        or neither."""
        figure, axis = figures.pyplot().subplots(figsize=(7, 3.5))
        names = [r.configuration for r in self.rows]
        axis.barh(names, [r.images_per_second for r in self.rows], label="measured")
        axis.plot([r.predicted_images_per_second for r in self.rows], names, "kx", label="predicted")
        axis.set(title=f"{self.model} on {self.hosts} hosts over {self.link}", xlabel="images/s")
        axis.legend(fontsize=8)
        figure.tight_layout()
        figures.write_table_and_figure(folder, "plan", COLUMNS, [dataclasses.asdict(r) for r in self.rows], figure)


def measure_link(strategy, payload_bytes, seconds=0.25, repeats=LINK_REPEATS):
    """The link between the hosts of ``strategy`` (a joined :class:`strategies.MultiWorker`) as its all-reduce
    sees it, the chief's figures on every host: the median all-reduce of 4 bytes over its ``2 (N - 1)`` rounds as
    the latency; for the rate, the ring's bytes of an all-reduce of ``payload_bytes``, doubled until it takes
    ``seconds`` more than the 4 bytes (as ``cnnpar cluster probe`` times its reads: a short burst would read the
    rate of a link's buffers), over the time they add."""
    hosts = strategy.task.num_workers
    (small,) = strategy.from_chief([strategy.all_reduce_seconds(4, repeats)])
    size = payload_bytes
    while True:
        (large,) = strategy.from_chief([strategy.all_reduce_seconds(size, repeats)])
        if large - small >= seconds or size >= LARGEST_BYTES:
            break
        size *= 2
    rate = 8 * traffic.ring_all_reduce(size, hosts) / max(large - small, 1e-9)
    return traffic.Link(rate, small / (2 * max(hosts - 1, 1)))


def plan(model, x, y, strategy, *, name, batch_size=64, precision="float32", advice_trials=True, log=print):
    """Measure ``model`` on the cluster of ``strategy`` (a :class:`strategies.MultiWorker`, joined) on every
    host: the :class:`ClusterPlan` (see the module's docstring); ``advice_trials=False`` leaves out the trials of
    multi-worker accumulating or compressing and of async-ps, which ``auto`` does not choose (the advice stays).
    Every host must call it alike."""
    number = next(_plans)
    hosts = strategy.task.num_workers
    size = scaling.gradient_bytes(model)
    log(f"plan: measuring the link with all-reduces of 4 bytes and of {size / 1e6:.1f} MB or more")
    link = measure_link(strategy, size)
    log("plan: trying single on every host at once")
    each_replica = [value for (value,) in strategy.gathered([planner.trial_images_per_second(
        model, strategies.Single(), x, y, batch_size=batch_size, precision=precision)])]
    each_host = each_replica[::len(each_replica) // hosts]  # a host's replicas come together, its figure in each
    single = each_host[0]  # the chief's
    step = batch_size / single
    log(f"plan: trying multi-worker on {hosts} hosts")
    (synced,) = strategy.from_chief([planner.trial_images_per_second(model, strategy, x, y, batch_size=batch_size,
                                                                     precision=precision)])
    predicted = strategies.MultiWorker.host_step(hosts, step, link, size)
    transport = predicted.transport_to(synced, batch_size)
    calibrated = predicted.with_transport(transport)
    k = scaling.accumulation_for(calibrated, scaling.COMMUNICATION_TARGET)
    accumulated = strategies.MultiWorker.host_step(hosts, step, link, size, accumulate=k).with_transport(transport)
    rows = [Row("single, 1 host", single, single, 0.0, "one host: nothing crosses the link"),
            Row(_synced_name(hosts), synced, predicted.images_per_second(batch_size), calibrated.communication_share,
                _advice(calibrated, accumulated, k, synced, batch_size))]
    if k > 1 and advice_trials:
        log(f"plan: trying multi-worker on {hosts} hosts accumulating {k} batches per all-reduce")
        (more,) = strategy.from_chief([planner.trial_images_per_second(
            model, strategy.replace(accumulate=k), x, y, batch_size=batch_size, precision=precision)])
        rows.append(Row(f"{_synced_name(hosts)}, K={k}", more, accumulated.images_per_second(batch_size),
                        accumulated.communication_share, f"an update of {k * batch_size} images: weigh the learning "
                                                         f"rate (scale_lr) and the accuracy"))
    if advice_trials:
        rows += _compressed_rows(model, x, y, strategy, step, link, transport, batch_size, precision, log)
        h = scaling.accumulation_for(calibrated, scaling.COMMUNICATION_TARGET, most=scaling.MAX_INNER_STEPS)
        rows += _local_steps_rows(model, x, y, strategy, h, step, link, size, transport, batch_size, precision, log)
        log(f"plan: trying async-ps with a worker on each of the {hosts} hosts")
        rows += _async_ps_rows(model, x, y, strategy, step, link, size, batch_size, precision, number, log)
    rows.sort(key=lambda row: -row.images_per_second)
    strategy.barrier(f"plan-measured-{number}")  # no host leaves while another still reads the last all-reduce
    return ClusterPlan(name, hosts, batch_size, link, step, transport, rows, tuple(each_host))


def choose(model, x, y, strategy, *, batch_size=64, precision="float32", log=print):
    """``strategy="auto"`` on the cluster of ``strategy`` (a joined :class:`strategies.MultiWorker`): the plan
    without its advice trials, and what measured faster: multi-worker on every host
    (``strategies.MultiWorker()``, its defaults) or single on the chief, the others waiting for its weights
    (:class:`~keras_cnnpar.strategies.multi_worker.SingleOnChief`). Neither accumulating (an update of another
    batch size) nor async-ps (updates from stale weights) is chosen, as ``auto`` on one host chooses nothing
    whose first step differs from Single's; the plan's advice names them. Every host must call it alike; the
    choice is the chief's figures, so every host makes the same."""
    result = plan(model, x, y, strategy, name=model.name, batch_size=batch_size, precision=precision,
                  advice_trials=False, log=log)
    best, runner_up = result.rows
    log(f"auto: chose {best.configuration} ({best.images_per_second:.0f} images/s); runner-up "
        f"{runner_up.configuration} ({runner_up.images_per_second:.0f} images/s)")
    chosen = strategies.MultiWorker() if best.configuration == _synced_name(result.hosts) else \
        strategies.SingleOnChief(strategy)
    return chosen, result


def _compressed_rows(model, x, y, strategy, step, link, transport, batch_size, precision, log):
    """MultiWorker on the hosts of ``strategy`` sending its gradients in bfloat16, then as PowerSGD's factors
    of the default rank: a row each, beside the prediction from the bytes it sends (PowerSGD's in two
    all-reduces) with multi-worker's ``transport``, saying what it changes in the training. A configuration that
    the model refuses (PowerSGD with clipping, or with nothing to compress) is left out, and the log says why."""
    hosts, rank = strategy.task.num_workers, arguments.POWERSGD_RANK
    floats = compression.sent_floats([v.shape for v in model.trainable_variables], rank)
    trials = [("bfloat16", {"compression": "bfloat16"}, scaling.gradient_bytes(model) / 2, 1,
               compression.changes("bfloat16")),
              (f"powersgd r={rank}", {"compression": "powersgd", "powersgd_rank": rank}, 4 * floats, 2,
               compression.changes("powersgd", rank))]
    rows = []
    for label, options, sent, all_reduces, changes in trials:
        log(f"plan: trying multi-worker on {hosts} hosts, its gradients in {label}")
        try:  # a refusal comes before the first all-reduce, alike on every host
            (measured,) = strategy.from_chief([planner.trial_images_per_second(
                model, strategy.replace(**options), x, y, batch_size=batch_size, precision=precision)])
        except ValueError as error:
            log(f"plan: multi-worker with its gradients in {label} is left out: {error}")
            continue
        predicted = strategies.MultiWorker.host_step(hosts, step, link, sent, all_reduces=all_reduces)
        predicted = predicted.with_transport(transport)
        rows.append(Row(f"{_synced_name(hosts)}, {label}", measured, predicted.images_per_second(batch_size),
                        predicted.communication_share, changes))
    return rows


def _local_steps_rows(model, x, y, strategy, h, step, link, size, transport, batch_size, precision, log):
    """LocalSteps with ``h`` inner steps on the hosts of ``strategy``, as one row (none where ``h`` is 1, where it
    would be plain multi-worker's traffic, or where the configuration is refused, which the log says): timed over
    epochs of ``h`` steps, one exchange each."""
    hosts = strategy.task.num_workers
    if h == 1:
        return []
    log(f"plan: trying local-steps on {hosts} hosts exchanging every {h} steps")
    try:  # a refusal comes before the first collective, alike on every host
        local = strategies.LocalSteps(inner_steps=h, checkpoint_dir=None, timeout=strategy.timeout)
        (measured,) = strategy.from_chief([planner.trial_images_per_second(
            model, local, x, y, batch_size=batch_size, precision=precision, steps=h)])
    except ValueError as error:
        log(f"plan: local-steps is left out: {error}")
        return []
    predicted = strategies.LocalSteps.host_step(hosts, step, link, size, inner_steps=h).with_transport(transport / h)
    return [Row(f"local-steps, {hosts} hosts, H={h}", measured, predicted.images_per_second(batch_size),
                predicted.communication_share, scaling.local_steps_changes(h, batch_size // hosts))]


def _async_ps_rows(model, x, y, strategy, step, link, size, batch_size, precision, number, log):
    """AsyncPS on the hosts of ``strategy``, as one row (none where its trial failed, which the chief logs): a
    worker on every host and the parameter server beside the chief's, each a TensorFlow server that its host
    runs for the trial (:func:`servers.serving`); the chief trains through them as AsyncPS's coordinator while
    the others wait for its figure."""
    task = strategy.task
    hosts = [address.rpartition(":")[0] for job in ("chief", "worker") for address in task.cluster.get(job, ())]
    here = len(task.cluster.get("chief", ())) * (task.type == "worker") + task.index
    ports = network.free_ports(2, hosts[here])
    each_replica = strategy.gathered(ports)
    each_host = each_replica[::len(each_replica) // len(hosts)]
    spec = {"worker": [f"{host}:{ports[0]:.0f}" for host, ports in zip(hosts, each_host)],
            "ps": [f"{hosts[0]}:{each_host[0][1]:.0f}"]}
    name = f"plan-async-ps-{number}"
    print(network.exposure_warning("plan's async-ps trial", ports[:1 + task.is_chief]), file=sys.stderr, flush=True)
    with servers.serving(spec, [("worker", here)] + [("ps", 0)] * task.is_chief, timeout=strategy.timeout):
        if task.is_chief:
            try:
                measured = planner.trial_images_per_second(
                    model, strategies.AsyncPS(cluster=spec, checkpoint_dir=None, timeout=strategy.timeout), x, y,
                    batch_size=batch_size, precision=precision)
            except Exception as error:  # the plan goes on without it, as a local plan's failed trial
                log(f"plan: async-ps failed ({type(error).__name__}: {error}); it is left out")
                measured = None
            strategy.publish(name, measured)
        else:
            measured = strategy.published(name)
    if measured is None:
        return []
    predicted = strategies.AsyncPS.host_step(len(hosts), step, link, size, workers_beside_ps=True)
    return [Row(f"async-ps, {len(hosts)} workers + ps", measured, predicted.images_per_second(batch_size),
                predicted.communication_share,
                "asynchronous: each update one worker's batch (a slice of it from 5 workers on), on weights the "
                "other workers move meanwhile; it does not wait for a slow host (docs/async.md)")]


def _synced_name(hosts):
    return f"multi-worker, {hosts} hosts"


def uneven_hosts(single_per_host):
    """What the plan says of the hosts' Single images/s: each host's, and where the slowest is under
    :data:`UNEVEN` of the fastest, that multi-worker waits for it and async-ps does not.

    >>> print(uneven_hosts([1800.0, 1750.0]))
    single on each host: 1800, 1750 images/s
    >>> print(uneven_hosts([1800.0, 900.0]))  # doctest: +NORMALIZE_WHITESPACE
    single on each host: 1800, 900 images/s; the slowest runs at 0.50x the fastest: multi-worker steps at its
    pace, async-ps does not wait for it (docs/async.md, a slow worker: async-ps kept 0.93-1.06x of its
    images/s, multi-worker 0.34-0.42x)
    """
    line = f"single on each host: {', '.join(f'{value:.0f}' for value in single_per_host)} images/s"
    slowest = min(single_per_host) / max(single_per_host)
    if slowest >= UNEVEN:
        return line
    return (f"{line}; the slowest runs at {slowest:.2f}x the fastest: multi-worker steps at its pace, async-ps does "
            f"not wait for it (docs/async.md, a slow worker: async-ps kept 0.93-1.06x of its images/s, "
            f"multi-worker 0.34-0.42x)")


def _advice(calibrated, accumulated, k, measured, batch_size):
    """The multi-worker row's advice: the remedy for its communication share, and its predicted gain."""
    share = calibrated.communication_share
    if k == 1 or math.isnan(share):
        return f"communication is {share:.0%} of the step: the link is not the bottleneck"
    gain = accumulated.images_per_second(batch_size) / measured
    return (f"communication is {share:.0%} of the step: accumulate={k} (one all-reduce per {k} batches) predicts "
            f"{accumulated.images_per_second(batch_size):.0f} images/s, {gain:.1f}x")
