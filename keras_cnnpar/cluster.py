"""Clusters of TensorFlow tasks: ``TF_CONFIG`` specs, and local worker processes on loopback.

A cluster is described as in ``TF_CONFIG``: a map from job name to task
addresses, and this process's own task in it. Worker 0 is the chief unless the
cluster has a ``chief`` job.

>>> spec = local_spec(workers=2, ports=[2222, 2223])
>>> spec
{'worker': ['localhost:2222', 'localhost:2223']}
>>> task = Task.parse({"cluster": spec, "task": {"type": "worker", "index": 1}})
>>> task, task.is_chief, task.num_workers
(<Task worker:1 of {'worker': 2}>, False, 2)
>>> Task.parse({"cluster": spec, "task": {"type": "worker", "index": 2}})  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: TF_CONFIG: task index 2 is outside job 'worker', which has 2 tasks. Received: task=...

:func:`run_local_workers` starts a command once per worker on this machine,
each process with its own ``TF_CONFIG``, streams the chief's output and fails
as soon as one worker fails. :func:`start_servers` starts one server process
per task of a parameter-server cluster; each runs this module's entry point,
``python -m keras_cnnpar.cluster serve --cluster-json JSON --job JOB --index I``.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from keras_cnnpar import runs, startup
from keras_cnnpar.subprocesses import python_command

#: Set to 1 by ``cnnpar launch`` in every worker's environment: ``import keras_cnnpar`` then joins the cluster
#: of ``TF_CONFIG`` at once, before any model exists, so a script may build its model first and call
#: ``fit(strategy="multi-worker")`` later. On several hosts, set it beside ``TF_CONFIG``.
JOIN_AT_IMPORT = "CNNPAR_MULTI_WORKER"
#: Exit code of a worker that saved a preemption checkpoint and stopped (TensorFlow's default).
PREEMPTED_EXIT_CODE = 42
_PR_SET_PDEATHSIG = 1
#: Jobs whose tasks train; the rest (``ps``, ``evaluator``) do not count as workers.
TRAINING_JOBS = ("chief", "worker")


class WorkerFailed(RuntimeError):
    """A local worker process exited with a non-zero code; carries the code and its output's tail."""

    def __init__(self, index, returncode, output):
        self.index, self.returncode, self.output = index, returncode, output
        if returncode == PREEMPTED_EXIT_CODE:
            what = "was preempted: it saved a checkpoint and stopped; rerun with --resume to continue"
        elif returncode < 0:
            what = f"was killed by {signal.Signals(-returncode).name}"
        else:
            what = f"exited with code {returncode}"
        super().__init__(f"worker {index} {what}" + (f"; its last output:\n{output}" if output else ""))


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a cluster: the cluster's jobs and addresses, and this task's job and index."""

    cluster: dict
    type: str
    index: int

    @classmethod
    def parse(cls, config=None):
        """The task described by ``config``: a ``TF_CONFIG``-style dict, the path of a JSON file
        holding one, or None for the ``TF_CONFIG`` environment variable."""
        source = "TF_CONFIG"
        if config is None:
            if not os.environ.get("TF_CONFIG"):
                raise ValueError("no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, pass "
                                 "cluster=<dict or JSON file>, or start N workers on this machine with `cnnpar "
                                 "launch --workers N python your_script.py` (or `cnnpar train --strategy "
                                 "multi-worker --workers N`). Received: TF_CONFIG=''")
            config = _json(os.environ["TF_CONFIG"], "TF_CONFIG")
        elif isinstance(config, (str, Path)):
            source, config = str(config), _json_file(config)
        if not isinstance(config, dict):
            raise TypeError(f"cluster must be a TF_CONFIG-style dict or the path of a JSON file. "
                            f"Received: cluster of type {type(config).__name__}")
        return cls(*_validated(config, source))

    @property
    def is_chief(self):
        """The chief writes logs, checkpoints and exports: the ``chief`` task, or worker 0 without one."""
        return self.type == "chief" or (self.type == "worker" and self.index == 0 and "chief" not in self.cluster)

    @property
    def num_workers(self):
        return sum(len(self.cluster.get(job, ())) for job in TRAINING_JOBS)

    def tf_config(self):
        return {"cluster": self.cluster, "task": {"type": self.type, "index": self.index}}

    def __repr__(self):
        return f"<Task {self.type}:{self.index} of {({job: len(a) for job, a in self.cluster.items()})}>"


def _json_file(path):
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read cluster file {path}: {error.strerror}. "
                         f"Received: cluster={str(path)!r}") from None
    return _json(text, str(path))


def _json(text, source):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: expected JSON, line {error.lineno} column {error.colno}: {error.msg}. "
                         f"Received: {text[:80]!r}") from None


def _validated(config, source):
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(f"{source}: expected a 'cluster' map of job name to addresses. "
                         f"Received: cluster={cluster!r}")
    _check_addresses(cluster, source)
    if not any(job in cluster for job in TRAINING_JOBS):
        raise ValueError(f"{source}: the cluster needs a 'worker' or 'chief' job. Received: jobs={sorted(cluster)}")
    index = task.get("index") if isinstance(task, dict) else None
    if index is None or task.get("type") not in cluster or isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"{source}: expected a 'task' with a 'type' among {sorted(cluster)} and an int 'index'. "
                         f"Received: task={task!r}")
    if not 0 <= task["index"] < len(cluster[task["type"]]):
        raise ValueError(f"{source}: task index {task['index']} is outside job {task['type']!r}, which has "
                         f"{len(cluster[task['type']])} tasks. Received: task={task!r}")
    return cluster, task["type"], task["index"]


def _check_addresses(cluster, source):
    """Refuse, before any connection, a job without addresses, or an address that no server could have:
    no host, a port outside 1..65535 or not in ASCII digits, the same address for two tasks."""
    seen = {}
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"{source}: job {job!r} must list 'host:port' addresses. "
                             f"Received: {job}={addresses!r}")
        for index, address in enumerate(addresses):
            host, _, port = address.rpartition(":")
            if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
                raise ValueError(f"{source}: task {job}:{index} needs a 'host:port' address with a host and a port "
                                 f"in 1..65535. Received: {job}[{index}]={address!r}")
            key = (host.lower(), int(port))
            if key in seen:
                raise ValueError(f"{source}: tasks {seen[key]} and {job}:{index} have the same address; every task "
                                 f"needs its own. Received: {job}[{index}]={address!r}")
            seen[key] = f"{job}:{index}"


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


def local_spec(workers, ps=0, ports=None):
    """A cluster of ``workers`` worker tasks and ``ps`` parameter servers on loopback, on ``ports`` (default: free)."""
    addresses = [f"localhost:{port}" for port in ports or free_ports(workers + ps)]
    return {"worker": addresses[:workers], **({"ps": addresses[workers:]} if ps else {})}


def parse_spec(cluster, jobs=("worker", "ps")):
    """The jobs map of ``cluster``: a ``TF_CONFIG``-style dict, a bare jobs map, or the path of a JSON file
    holding either. It must have every job in ``jobs``.

    >>> parse_spec({"worker": ["localhost:2222"], "ps": ["localhost:2223"]})
    {'worker': ['localhost:2222'], 'ps': ['localhost:2223']}
    >>> parse_spec({"worker": ["localhost:2222"]})
    Traceback (most recent call last):
    ValueError: cluster: expected the jobs ['worker', 'ps']. Received: jobs=['worker']
    """
    source = "cluster"
    if isinstance(cluster, (str, Path)):
        source, cluster = str(cluster), _json_file(cluster)
    if not isinstance(cluster, dict):
        raise TypeError(f"cluster must be a dict, a tf.train.ClusterSpec or the path of a JSON file. "
                        f"Received: cluster of type {type(cluster).__name__}")
    spec = cluster.get("cluster", cluster)
    if not isinstance(spec, dict) or not all(job in spec for job in jobs):
        raise ValueError(f"{source}: expected the jobs {list(jobs)}. "
                         f"Received: jobs={sorted(spec) if isinstance(spec, dict) else spec!r}")
    _check_addresses(spec, source)
    return spec


def unreachable(spec):
    """The ``job:index`` names of the tasks of ``spec`` that refuse TCP connections now."""
    return [f"{job}:{index}" for job, addresses in spec.items() for index, address in enumerate(addresses)
            if not _answers(address)]


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


def coordinator_address(spec, coordinator=None):
    """The ``host:port`` a parameter-server coordinator announces to the tasks of ``spec``.

    In order of precedence: the spec's ``chief`` task, ``coordinator``, or this
    host's address on the interface that routes to the cluster's first task,
    with a free port (loopback for a cluster on this machine). The tasks pull
    values from the coordinator (a checkpoint, for one), so the address must be
    one they can reach; TensorFlow's own default is this host's name, which
    often resolves to 127.0.0.1.

    >>> coordinator_address({"worker": ["localhost:2222"], "chief": ["10.0.0.5:2220"]}, "10.0.0.9:7000")
    '10.0.0.5:2220'
    >>> coordinator_address({"worker": ["localhost:2222"]}, "10.0.0.9:7000")
    '10.0.0.9:7000'
    """
    if "chief" in spec:
        return spec["chief"][0]
    if coordinator is not None:
        return check_coordinator(coordinator)
    first = next(iter(spec.values()))[0]
    host = route_address(first.rpartition(":")[0])
    return f"{host}:{free_ports(1, host)[0]}"


def check_coordinator(coordinator):
    """A coordinator address given by the user, checked as a task's address is; returned as given.

    >>> check_coordinator("10.0.0.1")
    Traceback (most recent call last):
    ValueError: coordinator: task chief:0 needs a 'host:port' address with a host and a port in 1..65535. \
Received: chief[0]='10.0.0.1'
    """
    if not isinstance(coordinator, str):
        raise TypeError(f"coordinator must be a 'host:port' string. Received: coordinator={coordinator!r}")
    _check_addresses({"chief": [coordinator]}, "coordinator")
    return coordinator


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


def launch(command, workers, env=None):
    """Run ``command`` (an argv list) once per worker on this machine, as ``torchrun`` does; return the exit code.

    Where Linux lets an ordinary user make namespaces (``unshare --user --net``),
    the workers run in a private network namespace of their own: its loopback
    is theirs alone, so the TensorFlow servers they start, which listen on
    every interface, cannot be reached from any other host or process. Without
    that, one line warns that the servers are reachable and how to block them.
    A failure prints ``Error: worker I ...`` and returns that worker's exit code
    (1 for a signal); SIGTERM and SIGINT are passed on (see
    :func:`run_local_workers`), and a second SIGINT kills every worker.
    ``env`` adds variables to the workers' environment.
    """
    if not private_network_available():
        print(exposure_warning("local workers"), file=sys.stderr, flush=True)
        return _run_and_report(command, workers, env=env)
    inner = python_command("-m", "keras_cnnpar.cluster", "workers", "--workers", str(workers), "--", *command)
    process = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "--", *inner],
                               env={**os.environ, **(env or {})})
    forward = _forward_signals([process])
    try:
        code = process.wait()
    finally:
        forward.restore()
        if process.poll() is None:
            process.kill()
            process.wait()
    return code if code >= 0 else 1


def _run_and_report(command, workers, parent=None, env=None):
    try:
        run_local_workers(command, workers, parent=parent, env=env)
    except WorkerFailed as failure:
        print(f"Error: {failure}", file=sys.stderr, flush=True)
        return failure.returncode if failure.returncode > 0 else 1
    return 0


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
            f"-m multiport --dports {listed} ! -i lo -j DROP` (docs/strategies.md, Security)")


def _loopback_up():
    """Bring up ``lo`` in this (new) network namespace, where it starts down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket() as handle:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(handle, siocgifflags, request))[1]
        fcntl.ioctl(handle, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))


def run_local_workers(command, workers, *, poll_seconds=0.2, preemption_grace_seconds=120, parent=None, env=None):
    """Run ``command`` (an argv list) once per worker on loopback; raise ``WorkerFailed`` on failure.

    Each process gets its own ``TF_CONFIG`` and its share of the cores for
    TensorFlow's thread pools (environment variables already set win), and
    dies with this process. The chief's output goes to this process's stdout
    and stderr as it comes; the other workers' goes to temporary files that
    are removed at the end, and a failing worker's last lines are in the
    error. When one worker fails the others are killed, except after a
    preemption: then they get ``preemption_grace_seconds`` to finish their
    checkpoint. A SIGTERM or SIGINT sent here is passed on to the workers as
    SIGTERM, so they save a preemption checkpoint and stop; a second SIGINT
    kills them. With ``parent``, the workers are killed as soon as that
    process is gone.
    """
    spec = local_spec(workers)
    with tempfile.TemporaryDirectory(prefix="cnnpar-workers-") as logs:
        processes = []
        forward = _forward_signals(processes)
        try:
            for index in range(workers):
                processes.append(_start_worker(command, Task(spec, "worker", index), logs, env))
            failed = _wait_for_failure(processes, poll_seconds, parent)
            if failed is not None and processes[failed].returncode == PREEMPTED_EXIT_CODE:
                _wait_all(processes, preemption_grace_seconds)
        finally:
            forward.restore()
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
        if failed is not None:
            raise WorkerFailed(failed, processes[failed].returncode, _tail(Path(logs) / f"worker{failed}.log"))


def _start_worker(command, task, logs, extra_env=None):
    env = {**_thread_share(task.num_workers), **os.environ, **(extra_env or {}),
           "TF_CONFIG": json.dumps(task.tf_config())}
    output = None if task.is_chief else open(Path(logs) / f"worker{task.index}.log", "wb")  # noqa: SIM115
    try:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
                                start_new_session=True, preexec_fn=die_with(os.getpid()))
    finally:
        if output:
            output.close()


def die_with(parent):
    """A ``preexec_fn`` that makes the child die with ``parent`` (Linux ``PR_SET_PDEATHSIG``), or None elsewhere.

    A launcher that is SIGKILLed, or whose terminal closes, then leaves no
    worker behind, although the workers have sessions of their own (so that
    a Ctrl-C reaches them only through the launcher, as SIGTERM).
    """
    if not sys.platform.startswith("linux"):
        return None

    def die_with_parent():
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)

    return die_with_parent


def _thread_share(workers):
    """TensorFlow thread pools for one of ``workers`` processes sharing this machine's cores (unless set already).

    Each process would otherwise size its pools for every core, and the
    workers would compete for them (figures in docs/benchmarks.md).
    """
    return {"TF_NUM_INTRAOP_THREADS": str(max(1, (os.cpu_count() or 1) // workers)), "TF_NUM_INTEROP_THREADS": "2"}


def _wait_for_failure(processes, poll_seconds, parent=None):
    """Wait until every process ended; return the index of the first that failed, or None.

    When ``parent`` is given and is no longer this process's parent, every
    process is killed and this process exits: its launcher is gone.
    """
    while True:
        if parent is not None and os.getppid() != parent:
            for process in processes:
                process.kill()
            sys.exit(1)
        codes = [p.poll() for p in processes]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return None
        time.sleep(poll_seconds)


def _wait_all(processes, seconds):
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


class _forward_signals:
    """Pass SIGTERM and SIGINT on to ``processes`` as SIGTERM, until ``restore()``; a second SIGINT kills them."""

    def __init__(self, processes):
        self.processes, self.interrupted = processes, False
        self.previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _forward(self, signum, frame):
        escalate = signum == signal.SIGINT and self.interrupted
        self.interrupted = self.interrupted or signum == signal.SIGINT
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL if escalate else signal.SIGTERM)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _tail(path, lines=20):
    if not path.exists():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def start_servers(workers, ps, spec_path, *, timeout=60, tries=3):
    """Start one TensorFlow server process per task on loopback, check them, write their spec; return it.

    The spec file is reserved first (created exclusively, so an unwritable path
    or a second ``start`` on the same path fails before any server starts),
    then every server must answer, be alive and be the process that listens on
    its port (another process may take a free port before the server binds it:
    then the servers start again on fresh ports, ``tries`` times in all). The
    spec, ``{"cluster", "pids", "token", "started"}``, replaces the
    reservation once all is well; :func:`stop_servers` signals only processes
    whose command line carries its token and whose start time it recorded.
    A server that fails to start is reported with its own error output.
    """
    spec_path = Path(spec_path)
    try:
        reservation = os.open(spec_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise FileExistsError(f"{spec_path} exists: stop its servers first (cnnpar cluster stop --spec {spec_path}) "
                              f"or choose another path. Received: spec={str(spec_path)!r}") from None
    os.close(reservation)
    try:
        for attempt in range(1, tries + 1):
            try:
                config = _start_checked_servers(workers, ps, timeout)
                break
            except _PortTaken as taken:
                if attempt == tries:
                    raise ConnectionError(f"{taken}; {tries} tries on fresh ports all failed") from None
        runs.write_atomic(spec_path, json.dumps(config, indent=2) + "\n")
        return config
    except BaseException:
        spec_path.unlink(missing_ok=True)
        raise


class _PortTaken(RuntimeError):
    """A server could not bind its port: another process took it after it was chosen."""


def _start_checked_servers(workers, ps, timeout):
    spec, token = local_spec(workers, ps), uuid.uuid4().hex
    processes, outputs = {job: [] for job in spec}, {}
    with contextlib.ExitStack() as files:
        try:
            for job, addresses in spec.items():
                for index in range(len(addresses)):
                    output = files.enter_context(tempfile.TemporaryFile())  # shown if the server fails to start
                    outputs[job, index] = output
                    processes[job].append(subprocess.Popen(
                        python_command("-m", "keras_cnnpar.cluster", "serve", "--cluster-json", json.dumps(spec),
                                       "--job", job, "--index", str(index), "--token", token),
                        stdout=output, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_for_servers(spec, processes, outputs, timeout)
        except BaseException:
            for process in (p for started in processes.values() for p in started):
                process.kill()
                process.wait()
            raise
    pids = {job: [p.pid for p in started] for job, started in processes.items()}
    return {"cluster": spec, "pids": pids, "token": token,
            "started": {str(pid): _start_time(pid) for started in pids.values() for pid in started}}


def _wait_for_servers(spec, processes, outputs, timeout):
    """Wait until every server listens on its own port; raise with a dead server's output, or ``_PortTaken``."""
    deadline = time.monotonic() + timeout
    while True:
        for job, started in processes.items():
            for index, process in enumerate(started):
                if process.poll() is not None:
                    outputs[job, index].seek(0)
                    output = outputs[job, index].read().decode(errors="replace").strip()
                    message = f"server {job}:{index} exited with code {process.returncode} at start"
                    if "address already in use" in output.lower() or "could not start" in output.lower():
                        raise _PortTaken(f"{message}: its port {spec[job][index]} was taken")
                    raise RuntimeError(f"{message}; its output:\n{output[-2000:]}")
        waiting = [(job, index) for job, started in processes.items() for index, p in enumerate(started)
                   if not _listens_on(p.pid, int(spec[job][index].rpartition(":")[2]))]
        if not waiting:
            return
        if time.monotonic() > deadline:
            job, index = waiting[0]
            if not unreachable({job: [spec[job][index]]}):
                raise _PortTaken(f"another process listens on {spec[job][index]}, the port of server {job}:{index}")
            raise ConnectionError(f"server {job}:{index} did not listen on {spec[job][index]} within {timeout} s")
        time.sleep(0.2)


def _listens_on(pid, port):
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


def _start_time(pid):
    """When ``pid`` started (clock ticks since boot), or None once it is gone: with the pid, it names a process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stop_servers(spec_path, *, grace_seconds=5):
    """End the server processes that :func:`start_servers` recorded in ``spec_path``, then remove the file.

    A process is signalled only if it is still that server: its command line
    carries the spec's token and it started when the spec says. A spec that
    cannot be validated is refused and nothing is signalled. Returns how many
    servers were running.
    """
    spec_path = Path(spec_path)
    if not spec_path.exists():
        raise FileNotFoundError(f"{spec_path} does not exist. Received: spec={str(spec_path)!r}")
    config = _json(spec_path.read_text(encoding="utf-8"), str(spec_path))
    if not isinstance(config, dict) or not isinstance(config.get("token"), str) or not isinstance(
            config.get("pids"), dict) or not isinstance(config.get("started"), dict):
        raise ValueError(f"{spec_path}: expected a spec written by `cnnpar cluster start` (cluster, pids, token, "
                         f"started); refusing to signal anything. Received: keys "
                         f"{sorted(config) if isinstance(config, dict) else type(config).__name__}")
    pids = [pid for job in config["pids"].values() for pid in job]
    foreign = [pid for pid in pids if _running(pid) and not _is_server(pid, config)]
    if foreign:
        raise ValueError(f"{spec_path}: process {foreign[0]} is not a server this spec started (another command "
                         f"line or start time); refusing to signal anything. Received: pids={pids}")
    running = [pid for pid in pids if _is_server(pid, config)]
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while any(_is_server(pid, config) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in running:
        if _is_server(pid, config):
            os.kill(pid, signal.SIGKILL)
    spec_path.unlink()
    return len(running)


def _running(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_server(pid, config):
    """Whether ``pid`` is a live server of the spec ``config``: its token on the command line, its start time."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (_running(pid) and b"keras_cnnpar.cluster" in command and config["token"].encode() in command
            and _start_time(pid) == config["started"].get(str(pid)))


def serve(cluster, job, index, announce=False):
    """Run the TensorFlow gRPC server of task ``job:index`` of ``cluster`` until SIGTERM or SIGINT (exit 0).

    The task's host must be an address of this machine (or a name that
    resolves to one): the spec is what the other tasks dial. TensorFlow's
    server listens on every interface at the task's port; it runs any graph
    sent to it, unauthenticated (docs/strategies.md, Security). A worker's
    server gets ``inter_op_parallelism_threads >= workers + 1``: with fewer, a
    parameter-server cluster hangs. ``announce`` prints one line once the
    server is up (``cnnpar cluster serve``).
    """
    if job not in cluster or not 0 <= index < len(cluster[job]):
        raise ValueError(f"the cluster has no task {job}:{index}. Received: jobs "
                         f"{ {name: len(tasks) for name, tasks in cluster.items()} }")
    address = cluster[job][index]
    _check_own_address(address, f"{job}:{index}")
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # TensorFlow's threads inherit the mask: the signal waits here
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=len(cluster["worker"]) + 1) \
        if job == "worker" else None
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, config=config,
                         protocol="grpc")
    if announce:
        print(f"cnnpar cluster serve: task {job}:{index} ready at {address}; TensorFlow listens on every interface "
              f"of this host at port {address.rpartition(':')[2]}, unauthenticated: trusted networks only", flush=True)
    received = signal.sigwait(stop)
    if announce:
        print(f"cnnpar cluster serve: task {job}:{index} stopped ({signal.Signals(received).name})", flush=True)
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's server threads never end on their own; nothing of ours is left to clean up


def _check_own_address(address, task):
    """Refuse to serve ``task`` at an address that is not this machine's (binding there fails)."""
    host = address.rpartition(":")[0]
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError as error:
            raise ValueError(f"task {task} has the address {address}, whose host is not an address of this "
                             f"machine ({error.strerror}); start it on the host the spec names. "
                             f"Received: {task}={address!r}") from None


def main(argv=None):
    """The entry point of server processes: ``python -m keras_cnnpar.cluster serve ...``."""
    parser = argparse.ArgumentParser(prog="python -m keras_cnnpar.cluster",
                                     description="Run one task's TensorFlow server of a parameter-server cluster.")
    commands = parser.add_subparsers(dest="action", required=True)
    server = commands.add_parser("serve", help="run the server of task JOB:INDEX until the process ends")
    server.add_argument("--cluster-json", required=True, help="the cluster's jobs map, as JSON")
    server.add_argument("--announce", action="store_true", help="print one line when the server is up")
    server.add_argument("--job", required=True)
    server.add_argument("--index", type=int, required=True)
    server.add_argument("--token", default="", help="the spec's token, so `cluster stop` can tell its servers")
    group = commands.add_parser("workers", help="run COMMAND once per local worker (inside a private network)")
    group.add_argument("--workers", type=int, required=True)
    group.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    options = parser.parse_args(argv)
    if options.action == "workers":
        _loopback_up()
        command = options.argv[1:] if options.argv[:1] == ["--"] else options.argv
        sys.exit(_run_and_report(command, options.workers, parent=os.getppid()))
    startup.quiet_start()
    serve(parse_spec(_json(options.cluster_json, "--cluster-json")), options.job, options.index, options.announce)


if __name__ == "__main__":
    main()
