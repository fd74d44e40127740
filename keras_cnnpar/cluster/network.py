"""Network probes: free ports, whether tasks answer, the routed interface, private network namespaces.

>>> route_address("localhost")
'127.0.0.1'
>>> len(free_ports(2))
2
"""

import fcntl
import functools
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path


def free_ports(n, host="localhost"):
    """``n`` distinct TCP ports that are free on ``host`` (an address of this machine; default loopback) now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def unreachable(spec):
    """The ``job:index`` names of the tasks of ``spec`` that refuse TCP connections now."""
    return [f"{job}:{index}" for job, addresses in spec.items() for index, address in enumerate(addresses)
            if not _answers(address)]


def unreachable_within(spec, seconds):
    """The ``job:index`` names of the tasks of ``spec`` that refuse TCP connections within ``seconds`` (polled):
    a task whose connections just broke may still be dying, its port still open."""
    deadline = time.monotonic() + seconds
    while not (lost := unreachable(spec)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return lost


def wait_reachable(spec, timeout):
    """Wait until every task of ``spec`` accepts TCP connections; raise ``ConnectionError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while lost := unreachable(spec):
        if time.monotonic() > deadline:
            raise ConnectionError(f"cannot reach {', '.join(lost)} of the cluster {spec} within {timeout} s; start "
                                  f"the servers (cnnpar cluster start) or check the spec")
        time.sleep(0.2)


def _answers(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def route_address(host):
    """This machine's address on the interface that routes to ``host`` (a UDP ``connect`` sends nothing).

    >>> route_address("localhost")
    '127.0.0.1'
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as error:
            raise ConnectionError(f"no route from this host to the cluster task at {host}: {error.strerror}. "
                                  f"Give the coordinator's address (AsyncPS(coordinator='HOST:PORT'), "
                                  f"--coordinator) or a 'chief' task in the spec") from None
        return probe.getsockname()[0]


@functools.cache
def private_network_available():
    """Whether this machine lets this user run a command in a private network namespace (``unshare``)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


def exposure_warning(what, ports=()):
    """The one line printed when servers start that other hosts can reach."""
    listed = ",".join(map(str, ports)) or "PORTS"
    where = f" (ports {listed})" if ports else ""
    return (f"warning: the TensorFlow servers of the {what} listen on every network interface{where} and run any "
            f"graph sent to them, unauthenticated; on a shared network, block them, e.g. `iptables -I INPUT -p tcp "
            f"-m multiport --dports {listed} ! -i lo -j DROP` (docs/hosts.md, Security)")


def loopback_up():
    """Bring up ``lo`` in this (new) network namespace, where it starts down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket() as handle:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(handle, siocgifflags, request))[1]
        fcntl.ioctl(handle, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))


def listens_on(pid, port):
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (from ``/proc``)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            return False
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    try:
        sockets = {os.readlink(entry) for entry in Path(f"/proc/{pid}/fd").iterdir()}
    except OSError:
        return False
    return any(f"socket:[{inode}]" in sockets for inode in inodes)
