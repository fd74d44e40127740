"""Predict training across hosts you do not have yet: ``cnnpar plan --hosts N --link RATE``.

One host's step of the global batch is measured on this machine (a training
step under Single, as a plan trial times it: :func:`planner.single_step_seconds`),
or given where the hosts differ from it; the model's gradient bytes are counted; and
each strategy that trains across hosts predicts its step on 1 to N hosts
joined by the link (``Strategy.host_step``): MultiWorker computes its share of
the batch and then all-reduces the whole gradient in a ring, AsyncPS's
workers all read the weights, then all write a gradient (a slice's, with more than 4 workers), through the
parameter server's link. Runs measured over the same link (``--measured``,
:class:`Measured`) calibrate their configuration with the time TensorFlow's
transport adds to a step. The table gives the predicted images/s, the scaling
efficiency (images/s over N times one host's) and the communication share,
and says where adding hosts stops paying.

Example (a 2+2 step of 72 ms on one host, hosts joined by 1 Gbit/s):

>>> import keras_cnnpar as cnnpar
>>> from keras_cnnpar.cluster import traffic
>>> result = predict(cnnpar.models.cnn("2+2"), hosts=4, link=traffic.Link.parse("1gbit"), compute_seconds=0.072,
...                  name="2+2")
>>> print(result.text())  # doctest: +NORMALIZE_WHITESPACE
2+2: 3,274,634 parameters, 13.1 MB of gradient a step; one host: 889 images/s (72.0 ms a step of 64)
link: 1gbit, 0 ms latency
hosts | multi-worker  eff  comm | accum  img/s  comm | powersgd  img/s  comm | local  img/s  comm | async-ps  eff
    1 |          889 100%    0% |   K=1    889    0% |      r=4    889    0% |   H=1    889    0% |      n/a
    2 |          455  26%   74% |  K=12   1431   20% |      r=4   1738    2% |  H=12   1431   20% |      227  13%
    3 |          391  15%   85% |  K=16   1955   27% |      r=4   2551    4% |  H=24   2146   20% |      261  10%
    4 |          365  10%   90% |  K=16   2300   35% |      r=4   3328    6% |  H=35   2846   20% |      274   8%
plain multi-worker: adding hosts does not pay: one host is fastest (889 images/s)
on 4 hosts, fastest first:
 multi-worker powersgd r=4 3328 images/s: compression='powersgd': each large gradient summed as rank-4 factors with \
error feedback, an approximation of Single's update (at rank 4, its validation accuracy measured at most 0.8 \
points below Single's in 6 of 6 runs, docs/slow_links.md)
 local-steps H=35 2846 images/s: inner_steps=35: each host steps alone on its 16 examples of a batch, and the hosts \
meet every 35 steps: another training (its validation accuracy measured at most 1.6 points below Single's in 18 \
runs, 14 of them within 1, docs/slow_links.md)
 multi-worker accumulate K=16 2300 images/s: an update of 1024 images, 16 times Single's: another training (K is \
advised up to 16)
  multi-worker                    365 images/s: Single's training
  async-ps                        274 images/s: asynchronous updates from stale weights: another training
these are upper bounds: the link's bytes and latency only; TensorFlow's transport costs more (measured 0.35-1.05x \
of them across hosts, docs/hosts.md); --measured CONFIGURATION:HOSTS=IMAGES/S, from a run over this link, \
calibrates them
"""

import dataclasses
import math
import re
import statistics

import numpy as np

from keras_cnnpar import strategies
from keras_cnnpar.plan import figures
from keras_cnnpar.strategies import arguments, compression, local_steps

#: Communication share under which the accumulation the table suggests brings a multi-worker step (the
#: original project's 20-30%: above it, change the parallelism).
COMMUNICATION_TARGET = 0.2
#: The most micro-batches the plan advises accumulating per all-reduce: an update of 16 global batches (1,024
#: images at 64) already trains another way than Single (fewer, larger updates; the learning rate needs thought).
MAX_ACCUMULATE = 16
#: The most inner steps the plan advises between two exchanges of local steps: their accuracy was measured up to
#: 64 (docs/slow_links.md); more trains further from Single.
MAX_INNER_STEPS = 64
#: What the table's figures are without a measured run, printed under it (docs/hosts.md has the measurements).
UPPER_BOUND = ("these are upper bounds: the link's bytes and latency only; TensorFlow's transport costs more "
               "(measured 0.35-1.05x of them across hosts, docs/hosts.md); --measured CONFIGURATION:HOSTS=IMAGES/S, "
               "from a run over this link, calibrates them")
#: What the table's figures are with measured runs (docs/hosts.md: how the calibration was checked).
CALIBRATED = ("calibrated with the measured runs: TensorFlow's transport adds {added} a step beyond the link's "
              "bytes and latency ({checked}, docs/hosts.md)")
#: How well the calibrated figures held across link rates, in ``benchmarks/cluster_links.py``.
CALIBRATION_CHECKED = "14 of 16 configurations within 25% of their measured images/s at 100 Mbit/s and 1 Gbit/s"
#: How much faster than the link and the step allow a measured run may be before it is refused: a step timed apart
#: from the run it is compared with (``cnnpar plan`` on the hosts times single first) can run that much slower
#: than the run's own steps on a loaded machine, the benchmarks' tolerance of the calibration.
TIMING_NOISE = 0.25
#: The columns of ``scaling.csv``: one row per host count and configuration.
COLUMNS = ("hosts", "configuration", "images_per_second", "efficiency", "communication_share", "step_seconds")


def local_steps_changes(inner_steps, share):
    """What local steps exchanging every ``inner_steps`` steps change in the training, each host stepping on
    ``share`` examples of a batch (:func:`.local_steps.changes`), said beside their row; the bound is named where
    it is reached.

    >>> local_steps_changes(64, 32).endswith("(H is advised up to 64)")
    True
    """
    return (local_steps.changes(inner_steps, share)
            + (f" (H is advised up to {MAX_INNER_STEPS})" if inner_steps == MAX_INNER_STEPS else ""))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One configuration on ``hosts`` hosts: its predicted images/s, efficiency and communication share."""

    hosts: int
    configuration: str
    images_per_second: float
    efficiency: float
    communication_share: float
    step_seconds: float


@dataclasses.dataclass
class Scaling:
    """The predictions of every configuration on 1 to N hosts, and what they were computed from."""

    model: str
    parameters: int
    gradient_bytes: int
    compute_seconds: float
    batch_size: int
    link: object
    predictions: list
    #: Seconds of TensorFlow's transport a step, by configuration, from the measured runs (``--measured``).
    transport: dict = dataclasses.field(default_factory=dict)

    def of(self, configuration):
        """The predictions of ``configuration`` (``multi-worker``, ``async-ps``, ``multi-worker accumulate``),
        by host count."""
        return {p.hosts: p for p in self.predictions
                if re.sub(r" (K|r|H)=\d+$", "", p.configuration) == configuration}

    def text(self):
        single = self.batch_size / self.compute_seconds
        lines = [f"{self.model}: {self.parameters:,} parameters, {self.gradient_bytes / 1e6:.1f} MB of gradient a "
                 f"step; one host: {single:.0f} images/s ({self.compute_seconds * 1e3:.1f} ms a step of "
                 f"{self.batch_size})", f"link: {self.link}",
                 f"{'hosts':>5s} | {'multi-worker':>12s} {'eff':>4s} {'comm':>5s} | {'accum':>5s} {'img/s':>6s} "
                 f"{'comm':>5s} | {'powersgd':>8s} {'img/s':>6s} {'comm':>5s} | {'local':>5s} {'img/s':>6s} "
                 f"{'comm':>5s} | {'async-ps':>8s} {'eff':>4s}"]
        synced, accumulated, compressed, local, asynchronous = (self.of(name) for name in REMEDIES)
        for hosts, row in synced.items():
            more, small, alone, late = accumulated[hosts], compressed[hosts], local[hosts], asynchronous.get(hosts)
            lines.append(f"{hosts:5d} | {row.images_per_second:12.0f} {row.efficiency:4.0%} "
                         f"{row.communication_share:5.0%} | {_option(more):>5s} {more.images_per_second:6.0f} "
                         f"{more.communication_share:5.0%} | {_option(small):>8s} {small.images_per_second:6.0f} "
                         f"{small.communication_share:5.0%} | {_option(alone):>5s} {alone.images_per_second:6.0f} "
                         f"{alone.communication_share:5.0%} | "
                         + (f"{late.images_per_second:8.0f} {late.efficiency:4.0%}" if late else f"{'n/a':>8s}"))
        added = ", ".join(f"{seconds * 1e3:.0f} ms to {name}" for name, seconds in self.transport.items())
        lines += [self.verdict(), *self.ranked(),
                  CALIBRATED.format(added=added, checked=CALIBRATION_CHECKED) if added else UPPER_BOUND]
        return "\n".join(lines)

    def verdict(self):
        """Where adding hosts stops paying for plain MultiWorker at the global batch (:meth:`ranked`: the
        remedies)."""
        synced = self.of("multi-worker")
        best = max(synced.values(), key=lambda p: p.images_per_second)
        if best.hosts == 1:
            return (f"plain multi-worker: adding hosts does not pay: one host is fastest "
                    f"({best.images_per_second:.0f} images/s)")
        if best.hosts == max(synced):
            return (f"plain multi-worker: adding hosts still pays at {best.hosts} hosts "
                    f"({best.images_per_second:.0f} images/s, efficiency {best.efficiency:.0%})")
        return (f"plain multi-worker: adding hosts stops paying at {best.hosts} hosts ({best.images_per_second:.0f} "
                f"images/s, efficiency {best.efficiency:.0%}); more hosts are slower")

    def ranked(self):
        """The configurations on the most hosts, fastest first, each with what it changes in the training (the
        lines under the verdict).

        Every one that trains differently from Single says how; accumulation
        is advised up to ``MAX_ACCUMULATE`` batches, local steps up to
        ``MAX_INNER_STEPS`` inner steps.
        """
        most = max(self.of("multi-worker"))
        if most == 1:
            return []
        rows = [self.of(name)[most] for name in REMEDIES if most in self.of(name)]
        lines = [f"on {most} hosts, fastest first:"]
        for row in sorted(rows, key=lambda r: -r.images_per_second):
            lines.append(f"  {row.configuration:28s} {row.images_per_second:6.0f} images/s: "
                         f"{self.changes(row.configuration, most)}")
        return lines

    def changes(self, configuration, hosts):
        """What ``configuration`` on ``hosts`` hosts changes in the training, compared with Single's."""
        name, _, value = configuration.partition("=")
        if name.endswith(" K"):
            k = int(value)
            return ("Single's training" if k == 1 else
                    f"an update of {k * self.batch_size} images, {k} times Single's: another training"
                    + (f" (K is advised up to {MAX_ACCUMULATE})" if k == MAX_ACCUMULATE else ""))
        if name.endswith(" r"):
            return compression.changes("powersgd", value)
        if name.endswith(" H"):
            return local_steps_changes(int(value), self.batch_size // hosts)
        if name == "async-ps":
            return "asynchronous updates from stale weights: another training"
        return "Single's training"

    def save(self, folder):
        """Write ``scaling.csv`` and ``scaling.png`` (images/s against hosts, beside N times one host's) into
        ``folder``, both or neither."""
        figure, axis = figures.pyplot().subplots(figsize=(7, 4))
        hosts = sorted(self.of("multi-worker"))
        axis.plot(hosts, [h * self.batch_size / self.compute_seconds for h in hosts], "k:", label="ideal")
        for name in REMEDIES:
            rows = self.of(name)
            axis.plot(sorted(rows), [rows[h].images_per_second for h in sorted(rows)], "o-", label=name)
        axis.set(title=f"{self.model} over {self.link}", xlabel="hosts", ylabel="predicted images/s", xscale="log",
                 yscale="log")
        axis.legend(fontsize=8)
        figure.tight_layout()
        figures.write_table_and_figure(folder, "scaling", COLUMNS, [dataclasses.asdict(p) for p in self.predictions],
                                       figure)


#: The configurations the table predicts on every host count.
REMEDIES = ("multi-worker", "multi-worker accumulate", "multi-worker powersgd", "local-steps", "async-ps")


def _option(prediction):
    """The option of a configuration's prediction as the table prints it: ``K=12``, ``r=4``, ``H=16``."""
    return prediction.configuration.rpartition(" ")[2]


def host_counts(hosts):
    """1, 2, 3, 4, then powers of two, up to ``hosts`` (included).

    >>> host_counts(4), host_counts(64), host_counts(12)
    ([1, 2, 3, 4], [1, 2, 3, 4, 8, 16, 32, 64], [1, 2, 3, 4, 8, 12])
    """
    counts = [h for h in (1, 2, 3) if h < hosts] + [2 ** k for k in range(2, int(math.log2(hosts)) + 1)]
    return sorted(set(counts) | {hosts})


def gradient_bytes(model):
    """Bytes of ``model``'s trainable variables: what an all-reduce or a parameter server moves for a step."""
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.trainable_variables))


@dataclasses.dataclass(frozen=True)
class Measured:
    """A configuration's images/s measured on hosts joined by the link of the prediction (``--measured``):
    ``multi-worker:2=294`` is multi-worker on 2 hosts training 294 images/s. It calibrates the predictions of its
    configuration with the time TensorFlow's transport adds to each step beyond the link's bytes and latency.

    >>> from keras_cnnpar.cluster import traffic
    >>> run = Measured.parse("multi-worker:2=294")
    >>> round(run.transport(0.072, traffic.Link.parse("1gbit"), 13_000_000, batch_size=64), 3)
    0.078
    >>> Measured.parse("mirrored:2=900")
    Traceback (most recent call last):
    ...
    ValueError: expected CONFIGURATION:HOSTS=IMAGES/S, as multi-worker:2=294 (configurations: multi-worker, \
local-steps, async-ps; 2 or more hosts; images/s above 0); received 'mirrored:2=900'
    """

    configuration: str
    hosts: int
    images_per_second: float

    @classmethod
    def parse(cls, text):
        match = re.fullmatch(rf"({'|'.join(ACROSS_HOSTS)}):([0-9]+)=([0-9]*\.?[0-9]+)", str(text).strip())
        if not match or int(match[2]) < 2 or float(match[3]) <= 0:
            raise ValueError(f"expected CONFIGURATION:HOSTS=IMAGES/S, as multi-worker:2=294 (configurations: "
                             f"{', '.join(ACROSS_HOSTS)}; 2 or more hosts; images/s above 0); received {text!r}")
        return cls(match[1], int(match[2]), float(match[3]))

    def transport(self, compute_seconds, link, size, batch_size):
        """Seconds TensorFlow's transport added to each step of this run beyond the link's bytes and latency
        (below zero where the run was faster than the link and the step allow, within ``TIMING_NOISE``); a
        ``ValueError`` where it was faster still."""
        predicted = _host_step(self.configuration, self.hosts, compute_seconds, link, size)
        bound = predicted.images_per_second(batch_size)
        seconds = predicted.transport_to(self.images_per_second, batch_size)
        if self.images_per_second > (1 + TIMING_NOISE) * bound:
            raise ValueError(f"{self.configuration}:{self.hosts}={self.images_per_second:g} is more than the "
                             f"{bound:.0f} images/s that the link ({link}) and the step ({compute_seconds * 1e3:.3g} "
                             f"ms) allow, by more than the {TIMING_NOISE:.0%} of timing noise: it would make "
                             f"TensorFlow's transport take {seconds * 1e3:.0f} ms a step; check the run, --link and "
                             f"--step-seconds")
        return seconds


#: The configurations that train across hosts, and the strategy that predicts each one's step.
ACROSS_HOSTS = {"multi-worker": "MultiWorker", "local-steps": "LocalSteps", "async-ps": "AsyncPS"}


def _host_step(configuration, hosts, compute_seconds, link, size, **options):
    return getattr(strategies, ACROSS_HOSTS[configuration]).host_step(hosts, compute_seconds, link, size, **options)


def predict(model, hosts, link, compute_seconds, batch_size=64, name=None, measured=()):
    """The :class:`Scaling` of ``model`` on 1 to ``hosts`` hosts joined by ``link``, where one host computes a step
    of ``batch_size`` in ``compute_seconds``; ``measured`` runs (:class:`Measured`) calibrate their configuration's
    predictions (several of one configuration: the mean of what they add)."""
    size = gradient_bytes(model)
    rank = arguments.POWERSGD_RANK
    compressed = 4 * compression.sent_floats([v.shape for v in model.trainable_variables], rank)
    single = batch_size / compute_seconds
    added = {}
    for run in measured:
        added.setdefault(run.configuration, []).append(run.transport(compute_seconds, link, size, batch_size))
    transport = {configuration: statistics.mean(seconds) for configuration, seconds in added.items()}
    predictions = []

    def step(configuration, count, sent=size, **options):
        predicted = _host_step(configuration, count, compute_seconds, link, sent, **options)
        return predicted and predicted.with_transport(transport.get(configuration, 0.0) if count > 1 else 0.0)

    def add(count, configuration, predicted):
        if predicted is not None:
            images = predicted.images_per_second(batch_size)
            predictions.append(Prediction(count, configuration, images, images / (count * single),
                                          predicted.communication_share, predicted.seconds))

    for count in host_counts(hosts):
        synced = step("multi-worker", count)
        add(count, "multi-worker", synced)
        k = accumulation_for(synced, COMMUNICATION_TARGET)
        add(count, f"multi-worker accumulate K={k}", step("multi-worker", count, accumulate=k))
        add(count, f"multi-worker powersgd r={rank}", step("multi-worker", count, compressed, all_reduces=2))
        h = accumulation_for(synced, COMMUNICATION_TARGET, most=MAX_INNER_STEPS)  # the exchange over H steps
        add(count, f"local-steps H={h}", step("local-steps", count, inner_steps=h))
        add(count, "async-ps", step("async-ps", count))
    parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return Scaling(name or model.name, parameters, size, compute_seconds, batch_size, link, predictions, transport)


def accumulation_for(step, share, most=MAX_ACCUMULATE):
    """The fewest micro-batches a multi-worker ``step`` must accumulate per all-reduce for its communication to be
    at most ``share`` of the step, at most ``most``; the same number of local steps between exchanges does it too.

    >>> from keras_cnnpar.cluster import traffic

    >>> accumulation_for(traffic.HostStep(0.036, 0.104), 0.2), accumulation_for(traffic.HostStep(0.036, 0.001), 0.2)
    (12, 1)
    >>> accumulation_for(traffic.HostStep(0.036, 10.0), 0.2)
    16
    """
    needed = math.ceil(step.communication_seconds * (1 - share) / (share * step.compute_seconds))
    return max(1, min(most, needed))
