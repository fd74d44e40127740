"""Network namespaces as hosts: each with its own address on a private test subnet, joined by a bridge.

``Hosts(2)`` makes the namespaces ``<tag>-h0`` (10.231.7.1) and ``<tag>-h1``
(10.231.7.2), each with loopback and one interface ``eth0``, wired through a
bridge in a third, "switch" namespace; nothing is added to the machine's own
network namespace, and no address outside 10.231.7.0/24 is reachable from
them. ``Hosts(2, rate="100mbit")`` limits every host's link to that rate in
both directions (``tc``'s token bucket, ``tbf``, on each end of its cable), as a
slower network would; ``shape`` changes it. Leaving the ``with`` block kills
every process in the namespaces and deletes them, also when the test fails.
It needs root and ``ip netns``: :func:`unavailable` says why not, for
``pytest.skip``; :func:`unshapeable` says why links cannot be shaped.
"""

import contextlib
import json
import os
import signal
import subprocess

from keras_cnnpar.cluster import traffic
from tests.helpers import wait_until

SUBNET = "10.231.7"


def unavailable():
    """Why the namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces as hosts need root (ip netns)"
    probe = f"cnnpar-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def unshapeable():
    """Why links cannot be given a rate here (no ``tc``, or a kernel without ``tbf``), or None."""
    if reason := unavailable():
        return reason
    probe = f"cnnpar-tbf-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1")
        _tbf(probe, "probe0", "100mbit")
    except (OSError, subprocess.CalledProcessError) as error:
        return f"tc qdisc tbf failed: {getattr(error, 'stderr', None) or error}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tbf(namespace, device, rate):
    """Limit what ``device`` of ``namespace`` sends to ``rate`` (a token bucket holding 10 ms of it, at least a
    64 KiB segment; a packet waits at most 100 ms for tokens)."""
    burst = max(int(traffic.Link.parse(rate).bits_per_second / 8 / 100), 64 * 1024)
    subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate, "burst",
                    str(burst), "latency", "100ms"], check=True, capture_output=True, text=True)


class Hosts:
    """``count`` namespaces as hosts on 10.231.7.0/24; see the module's docstring."""

    def __init__(self, count, tag=None, rate=None):
        self.tag = tag or f"cnp{os.getpid() % 100000}"
        self.names = [f"{self.tag}-h{i}" for i in range(count)]
        self.switch = f"{self.tag}-sw"
        self.rate = rate
        self.processes = []

    def address(self, index):
        return f"{SUBNET}.{index + 1}"

    def __enter__(self):
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "add", f"port{index}", "type", "veth", "peer", "name", "eth0",
                    "netns", name)
                _ip("-n", self.switch, "link", "set", f"port{index}", "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
            if self.rate is not None:
                self.shape(self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def popen(self, index, command, **kwargs):
        """Start ``command`` on host ``index`` (in its namespace); the process is killed on exit."""
        process = subprocess.Popen(["ip", "netns", "exec", self.names[index], *command], start_new_session=True,
                                   **kwargs)
        self.processes.append(process)
        return process

    def shape(self, rate):
        """Limit every host's link to ``rate`` (``tc`` text: ``100mbit``, ``1gbit``) in both directions."""
        for index, name in enumerate(self.names):
            _tbf(name, "eth0", rate)
            _tbf(self.switch, f"port{index}", rate)
        self.rate = rate

    def bytes_moved(self, index):
        """``(sent, received)``: the bytes host ``index``'s link has carried each way since it was made."""
        listed = subprocess.run(["ip", "-j", "-s", "-n", self.names[index], "link", "show", "dev", "eth0"],
                                check=True, capture_output=True, text=True)
        stats = json.loads(listed.stdout)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def link_down(self, index):
        """Cut host ``index`` off the network, as a pulled cable or a dead host does (no packet answers)."""
        _ip("-n", self.switch, "link", "set", f"port{index}", "down")

    def pids(self):
        """The processes running in any of the hosts' namespaces."""
        found = []
        for name in self.names:
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            found += [int(pid) for pid in listed.stdout.split()]
        return found

    def close(self):
        try:
            for process in self.processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            wait_until(lambda: not self._kill_left(), f"every process in the namespaces {self.names} to end", 10)
            for process in self.processes:
                process.wait(timeout=10)
        finally:
            for name in [*self.names, self.switch]:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def _kill_left(self):
        """SIGKILL every process still in the namespaces; return their pids."""
        left = self.pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left
