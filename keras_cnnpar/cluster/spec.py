"""Clusters of TensorFlow tasks as ``TF_CONFIG`` describes them: specs, tasks, the chief, the coordinator's address.

A cluster is a map from job name to task addresses, and this process's own
task in it. Worker 0 is the chief unless the cluster has a ``chief`` job.
Processes live elsewhere: local worker processes in
:mod:`keras_cnnpar.cluster.local_workers`, server processes in
:mod:`keras_cnnpar.cluster.servers`, network probes in :mod:`keras_cnnpar.cluster.network`.

>>> spec = local_spec(workers=2, ports=[2222, 2223])
>>> spec
{'worker': ['localhost:2222', 'localhost:2223']}
>>> task = Task.parse({"cluster": spec, "task": {"type": "worker", "index": 1}})
>>> task, task.is_chief, task.num_workers
(<Task worker:1 of {'worker': 2}>, False, 2)
>>> Task.parse({"cluster": spec, "task": {"type": "worker", "index": 2}})  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: TF_CONFIG: task index 2 is outside job 'worker', which has 2 tasks. Received: task=...
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

from keras_cnnpar.cluster.network import free_ports, route_address

#: Set to 1 by ``cnnpar launch`` in every worker's environment: ``import keras_cnnpar`` then joins the cluster
#: of ``TF_CONFIG`` at once, before any model exists, so a script may build its model first and call
#: ``fit(strategy="multi-worker")`` later. On several hosts, set it beside ``TF_CONFIG``.
JOIN_AT_IMPORT = "CNNPAR_MULTI_WORKER"


#: Jobs whose tasks train; the rest (``ps``, ``evaluator``) do not count as workers.
TRAINING_JOBS = ("chief", "worker")


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
            config = read_tf_config(os.environ)
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
    def chief(self):
        """The chief's address: the ``chief`` task's, or worker 0's without one."""
        return (self.cluster.get("chief") or self.cluster["worker"])[0]

    @property
    def num_workers(self):
        return sum(len(self.cluster.get(job, ())) for job in TRAINING_JOBS)

    def tf_config(self):
        return {"cluster": self.cluster, "task": {"type": self.type, "index": self.index}}

    def __repr__(self):
        return f"<Task {self.type}:{self.index} of {({job: len(a) for job, a in self.cluster.items()})}>"


def read_tf_config(environ):
    """The JSON object in ``environ``'s ``TF_CONFIG``; a ``ValueError`` saying how to give a cluster without one.

    >>> read_tf_config({"TF_CONFIG": '["worker"]'})
    Traceback (most recent call last):
    ValueError: TF_CONFIG: expected a JSON object with a 'cluster' and a 'task'. Received: TF_CONFIG='["worker"]'
    """
    text = environ.get("TF_CONFIG")
    if not text:
        raise ValueError("no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, pass cluster=<dict or JSON "
                         "file>, or start N workers on this machine with `cnnpar launch --workers N python "
                         "your_script.py` (or `cnnpar train --strategy multi-worker --workers N`). "
                         "Received: TF_CONFIG=''")
    config = parse_json(text, "TF_CONFIG")
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG: expected a JSON object with a 'cluster' and a 'task'. "
                         f"Received: TF_CONFIG={text[:80]!r}")
    return config


def _json_file(path):
    return read_json_file(path, "cluster")


def read_json_file(path, option):
    """The JSON value in the file ``path`` (given as ``option``); a ``ValueError`` naming the file otherwise.

    >>> import tempfile
    >>> spec = Path(tempfile.mkdtemp()) / "spec.json"
    >>> _ = spec.write_bytes(b'{"worker": ["h\\xff:1"]}')
    >>> read_json_file(spec, "spec")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../spec.json: expected UTF-8 JSON; byte 0xff at offset 14 is not UTF-8. Received: spec='...'
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {option} file {path}: {error.strerror}. "
                         f"Received: {option}={str(path)!r}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: expected UTF-8 JSON; byte {raw[error.start]:#04x} at offset {error.start} is not "
                         f"UTF-8. Received: {option}={str(path)!r}") from None
    return parse_json(text, str(path))


def parse_json(text, source):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: expected JSON, line {error.lineno} column {error.colno}: {error.msg}. "
                         f"Received: {text[:80]!r}") from None
    except RecursionError:  # json's decoder recurses once per array or object level
        raise ValueError(f"{source}: expected JSON nested fewer than {sys.getrecursionlimit()} levels deep. "
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
    no host, a port outside 1..65535 or not in ASCII digits, the same address for two tasks; an IPv6
    address, which the probes and routes here do not reach (they said "Name or service not known"); and a
    ``chief`` job of more than one task, each of which would take itself for the chief and write."""
    seen = {}
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"{source}: job {job!r} must list 'host:port' addresses. "
                             f"Received: {job}={addresses!r}")
        if job == "chief" and len(addresses) > 1:
            raise ValueError(f"{source}: the 'chief' job has one task; list the others under 'worker'. "
                             f"Received: chief={addresses!r}")
        for index, address in enumerate(addresses):
            host, _, port = address.rpartition(":")
            if ":" in host:
                raise ValueError(f"{source}: task {job}:{index} has an IPv6 address, which keras_cnnpar does not "
                                 f"reach yet; give an IPv4 address or a host name. "
                                 f"Received: {job}[{index}]={address!r}")
            if (not host or not (port.isascii() and port.isdigit()) or len(port.lstrip("0")) > 5  # int() of 4301
                    or not 1 <= int(port) <= 65535):  # digits or more raises its own error, which names no task
                raise ValueError(f"{source}: task {job}:{index} needs a 'host:port' address with a host and a port "
                                 f"in 1..65535. Received: {job}[{index}]={address!r}")
            key = (host.lower(), int(port))
            if key in seen:
                raise ValueError(f"{source}: tasks {seen[key]} and {job}:{index} have the same address; every task "
                                 f"needs its own. Received: {job}[{index}]={address!r}")
            seen[key] = f"{job}:{index}"


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
            raise ValueError(f"{source}: expected a JSON object, a TF_CONFIG-style one or a map of job name to "
                             f"addresses. Received: {json.dumps(cluster)[:80]}")
    if not isinstance(cluster, dict):
        raise TypeError(f"cluster must be a dict, a tf.train.ClusterSpec or the path of a JSON file. "
                        f"Received: cluster of type {type(cluster).__name__}")
    spec = cluster.get("cluster", cluster)
    if not isinstance(spec, dict) or not all(job in spec for job in jobs):
        raise ValueError(f"{source}: expected the jobs {list(jobs)}. "
                         f"Received: jobs={sorted(spec) if isinstance(spec, dict) else spec!r}")
    _check_addresses(spec, source)
    return spec


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
