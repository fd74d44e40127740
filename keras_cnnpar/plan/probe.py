"""Measure the links between the tasks of a running cluster with TensorFlow's own transport.

``cnnpar cluster probe --cluster SPEC`` connects this process to the servers of
SPEC as their coordinator (as AsyncPS's does) and, for every
task but the first, times that task reading a tensor held by the first:
TensorFlow sends it between the two servers over gRPC, as it sends gradients
and weights in training. A tensor of 4 bytes gives the round trip (the request,
the answer and the function's dispatch); tensors doubled in size until their
transfer takes ``seconds`` give the rate: the bytes they add over the time they
add. The slowest pair is the cluster's link for ``cnnpar plan --hosts``.

Start the servers first: ``cnnpar cluster start`` on this machine, or
``cnnpar cluster serve`` on each host.
"""

import dataclasses
import statistics
import time

import tensorflow as tf

from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.cluster import traffic
from keras_cnnpar.strategies.async_ps import connection

#: The first tensor timed for the rate, in bytes; it doubles until its transfer takes the probe's ``seconds``.
FIRST_BYTES = 2**20
#: The largest tensor sent, in bytes.
LARGEST_BYTES = 2**28


@dataclasses.dataclass(frozen=True)
class Measured:
    """The link between two tasks of a cluster, as measured."""

    source: str
    destination: str
    bits_per_second: float
    round_trip_seconds: float
    largest_bytes: int

    def link(self):
        """The :class:`traffic.Link` it measured: its rate, and half its round trip as one message's latency."""
        return traffic.Link(self.bits_per_second, self.round_trip_seconds / 2)

    def __str__(self):
        return (f"{self.source} -> {self.destination}: {self.bits_per_second / 1e6:,.0f} Mbit/s, round trip "
                f"{self.round_trip_seconds * 1e3:.2f} ms (tensors up to {self.largest_bytes / 2**20:g} MiB)")


def tasks(spec):
    """The device names of the tasks of ``spec``, the first one first.

    >>> tasks({"worker": ["h0:2222", "h1:2222"], "ps": ["h2:2222"]})
    ['/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1', '/job:ps/replica:0/task:0']
    """
    return [f"/job:{job}/replica:0/task:{index}" for job, addresses in spec.items() if job != "chief"
            for index in range(len(addresses))]


def probe(spec, coordinator=None, seconds=0.5, repeats=5):
    """Connect to the servers of ``spec`` (its ``worker`` and ``ps`` jobs; ``coordinator``: this process's
    ``host:port``, as for async-ps) and measure the link from the first task to every other one; a list of
    :class:`Measured`. Once per process: TensorFlow joins one cluster."""
    connection.connect(spec, cluster_lib.coordinator_address(spec, coordinator))
    first, *others = tasks(spec)
    return [_measure(first, other, seconds, repeats) for other in others]


def _measure(source, destination, seconds, repeats):
    round_trip = _transfer_seconds(source, destination, 4, repeats)
    size = FIRST_BYTES
    while True:
        took = _transfer_seconds(source, destination, size, repeats)
        if took - round_trip >= seconds or size >= LARGEST_BYTES:
            break
        size *= 2
    return Measured(source, destination, 8 * (size - 4) / max(took - round_trip, 1e-9), round_trip, size)


def _transfer_seconds(source, destination, size, repeats):
    """The median seconds of ``destination`` reading a float32 tensor of ``size`` bytes held on ``source``."""
    with tf.device(source):
        held = tf.Variable(tf.zeros([size // 4], tf.float32))

    @tf.function
    def read():
        with tf.device(destination):
            return tf.reduce_sum(held)  # the whole tensor crosses to destination; one float comes back here

    read().numpy()  # traces, and warms the channel
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read().numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
