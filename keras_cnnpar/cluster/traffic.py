"""What a training step sends between hosts, and how long a link takes to carry it.

A strategy that trains across hosts says what one step costs there
(``Strategy.host_step``): the seconds it computes, the seconds its busiest
link carries bytes and waits for rounds of messages, and how many steps run at
once. :mod:`keras_cnnpar.plan.scaling` turns that into images/s for clusters
of any size.

>>> link = Link.parse("1gbit", latency="0.1ms")
>>> link.seconds(125_000_000), link.seconds(0, rounds=10)  # a second of bytes at 1 Gbit/s; ten waits of 0.1 ms
(1.0, 0.001)
>>> ring_all_reduce(13_000_000, hosts=2), ring_all_reduce(13_000_000, hosts=4)  # bytes each host sends a step
(13000000.0, 19500000.0)
>>> step = HostStep(compute_seconds=0.036, communication_seconds=0.104)
>>> round(step.images_per_second(64)), round(step.communication_share, 2)
(457, 0.74)
"""

import dataclasses
import math
import re

#: Link rates as ``tc`` writes them, in bits per second.
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
#: Durations, in seconds.
TIME_UNITS = {"s": 1, "ms": 1e-3, "us": 1e-6}


def _parse(text, units, what, example):
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*", str(text).lower())
    value = float(match[1]) * units[match[2]] if match and match[2] in units else math.nan
    if not 0 <= value < math.inf:  # the product: 1e300tbit is a finite number of an infinite rate
        raise ValueError(f"{what}: expected a number and one of the units {', '.join(units)} ({example}); "
                         f"received {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link: its rate in each direction (full duplex), and the latency of one message."""

    bits_per_second: float
    latency_seconds: float = 0.0

    @classmethod
    def parse(cls, rate, latency="0s"):
        """A link from ``tc``-style text: ``rate`` as ``100mbit``, ``1gbit`` or ``10gbit``, ``latency`` as
        ``0.1ms`` or ``50us``; a ``ValueError`` that says what was expected otherwise.

        >>> Link.parse("10gbit").bits_per_second, Link.parse("100mbit", "0.5ms").latency_seconds
        (10000000000.0, 0.0005)
        >>> Link.parse("fast")
        Traceback (most recent call last):
        ...
        ValueError: link rate: expected a number and one of the units bit, kbit, mbit, gbit, tbit (100mbit, 1gbit, \
10gbit); received 'fast'
        """
        bits = _parse(rate, RATE_UNITS, "link rate", "100mbit, 1gbit, 10gbit")
        if bits <= 0:
            raise ValueError(f"link rate: expected more than 0 bits per second; received {rate!r}")
        return cls(bits, _parse(latency, TIME_UNITS, "link latency", "0.1ms, 50us"))

    def seconds(self, payload_bytes, rounds=0):
        """Seconds to carry ``payload_bytes`` one way, plus ``rounds`` messages' latencies."""
        return 8 * payload_bytes / self.bits_per_second + rounds * self.latency_seconds

    def __str__(self):
        rate = next(f"{self.bits_per_second / scale:.3g}{unit}" for unit, scale in reversed(RATE_UNITS.items())
                    if self.bits_per_second >= scale or unit == "bit")
        return f"{rate}, {self.latency_seconds * 1e3:.3g} ms latency"


def ring_all_reduce(payload_bytes, hosts):
    """Bytes each host sends (and receives) in a ring all-reduce of ``payload_bytes``: ``2 (N - 1) / N`` of them,
    in ``2 (N - 1)`` rounds (a reduce-scatter, then an all-gather)."""
    return 2 * (hosts - 1) / hosts * payload_bytes


@dataclasses.dataclass(frozen=True)
class HostStep:
    """One step of a strategy across hosts: the seconds it computes and communicates (one after the other:
    Keras computes the whole gradient before it sends any), how many such steps run at once (asynchronous
    workers), and how many global batches one step trains on (the micro-batches it accumulates, or the share of
    one that a slice is)."""

    compute_seconds: float
    communication_seconds: float = 0.0
    parallel_steps: float = 1.0
    images_factor: float = 1

    @property
    def seconds(self):
        return self.compute_seconds + self.communication_seconds

    @property
    def communication_share(self):
        return self.communication_seconds / self.seconds if self.seconds else math.nan

    def images_per_second(self, batch_size):
        return batch_size * self.images_factor * self.parallel_steps / self.seconds

    def transport_to(self, images_per_second, batch_size):
        """The seconds this step must add to its communication to train at the measured ``images_per_second``:
        what TensorFlow's transport costs a step beyond the link's bytes and latencies (negative where the step
        ran faster than the link alone allows).

        >>> round(HostStep(0.036, 0.104).transport_to(294, batch_size=64), 3)  # 0.218 s a step, measured
        0.078
        """
        return batch_size * self.images_factor * self.parallel_steps / images_per_second - self.seconds

    def with_transport(self, seconds):
        """This step with ``seconds`` of TensorFlow's transport added to its communication (at least none left).

        >>> HostStep(0.036, 0.104).with_transport(0.078).images_per_second(64)  # doctest: +ELLIPSIS
        293.5...
        """
        return dataclasses.replace(self, communication_seconds=max(0.0, self.communication_seconds + seconds))
