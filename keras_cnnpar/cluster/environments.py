"""Cluster environments: where a process finds its cluster described, one class per kind, and :func:`detect`.

A worker learns its cluster from the variables its launcher set: ``TF_CONFIG``
(by hand, by ``cnnpar launch`` or by Kubeflow's ``TFJob``), a Slurm job step
(``srun``), or a Kubernetes Indexed Job. Each kind is a
:class:`ClusterEnvironment`: ``detect()`` says whether the variables describe
it, and ``tf_config()``, ``task()`` and ``chief()`` give its cluster as
``TF_CONFIG`` would. :func:`detect` returns the first kind of
:data:`ENVIRONMENTS` that applies: ``TF_CONFIG`` wins over Slurm, Slurm over
Kubernetes. A new kind is one class here, listed in :data:`ENVIRONMENTS`.

>>> detect({"SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
<Slurm: the Slurm job step>
>>> detect({}) is None
True
"""

import os
import re
import shutil
import socket
import subprocess

from keras_cnnpar.cluster.spec import Task, read_tf_config

#: The first port of a Slurm job step's cluster (a node's further tasks take the next ones); default 8888.
SLURM_PORT = "CNNPAR_SLURM_PORT"
#: The node's GPUs before :meth:`Slurm.assign_devices` divided them, so that dividing again gives the same share.
SLURM_NODE_GPUS = "CNNPAR_SLURM_NODE_GPUS"
#: A Kubernetes Indexed Job's number of workers: its ``completions``. Set in the pod template.
K8S_WORKERS = "CNNPAR_K8S_WORKERS"
#: The headless Service that the pod template's ``subdomain`` names. Set in the pod template.
K8S_SERVICE = "CNNPAR_K8S_SERVICE"
#: The port of every pod's server in a Kubernetes Indexed Job; default 8888.
K8S_PORT = "CNNPAR_K8S_PORT"
#: The default first port of a cluster that a scheduler describes: TensorFlow's ``SlurmClusterResolver``'s.
DEFAULT_PORT = 8888


class ClusterEnvironment:
    """How one kind of environment describes this process's cluster: the base of each kind.

    A kind sets ``name`` (the words messages use for it), says in
    :meth:`detect` whether the variables describe it, and builds in
    :meth:`tf_config` the ``TF_CONFIG``-style dict of its cluster; this
    process's :meth:`task` and the :meth:`chief` follow from it. The variables
    are read when asked, so an instance follows changes to them.

    Example:

    >>> environment = TFConfig({"TF_CONFIG": '{"cluster": {"worker": ["h1:2222", "h2:2222"]}, '
    ...                                      '"task": {"type": "worker", "index": 1}}'})
    >>> environment, environment.task(), environment.chief()
    (<TFConfig: TF_CONFIG>, <Task worker:1 of {'worker': 2}>, 'h1:2222')

    Args:
        environ: the variables to read; default ``os.environ``.
    """

    name = "the cluster environment"
    #: The variables that, all set, say this kind describes the process's cluster (:meth:`detect`).
    detected_by = ()
    #: Whether a scheduler started one process per task (``srun``, a Job's pods): ``cnnpar launch`` then runs its
    #: command once, in this process, instead of starting local workers.
    creates_processes_externally = False

    def __init__(self, environ=None):
        self.environ = os.environ if environ is None else environ

    @classmethod
    def detect(cls, environ=None):
        """Whether the variables of ``environ`` (default ``os.environ``) describe a cluster of this kind: all of
        :attr:`detected_by` are set."""
        environ = _environ(environ)
        return bool(cls.detected_by) and all(environ.get(name) for name in cls.detected_by)

    def tf_config(self):
        """The cluster and this process's task in it: ``{"cluster": {job: [address, ...]}, "task": {"type",
        "index"}}``; a ``ValueError`` naming the variable that holds a bad value."""
        raise NotImplementedError

    def task(self):
        """This process's task, checked as ``TF_CONFIG``'s is (:meth:`keras_cnnpar.cluster.spec.Task.parse`)."""
        return Task.parse(self.tf_config())

    def chief(self):
        """The chief's address: the ``chief`` task's, or worker 0's without one."""
        return self.task().chief

    def assign_devices(self):
        """Keep this process to its share of the node's accelerators, before TensorFlow starts; here, nothing."""

    def __repr__(self):
        return f"<{type(self).__name__}: {self.name}>"


class TFConfig(ClusterEnvironment):
    """The ``TF_CONFIG`` variable: a JSON object with the cluster and this process's task.

    Set by hand on each host, by ``cnnpar launch --workers N`` in each local
    worker, and by Kubeflow's ``TFJob`` in each of its pods. It wins over every
    other kind.

    >>> config = '{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"]}, "task": {"type": "worker", "index": 0}}'
    >>> TFConfig.detect({"TF_CONFIG": config}), TFConfig.detect({"TF_CONFIG": ""})
    (True, False)
    >>> TFConfig({"TF_CONFIG": config}).chief()
    'h0:2222'

    Args:
        environ: the variables to read; default ``os.environ``.
    """

    name = "TF_CONFIG"
    detected_by = ("TF_CONFIG",)

    def tf_config(self):
        return read_tf_config(self.environ)


class Slurm(ClusterEnvironment):
    """A Slurm job step that ``srun`` started: one worker per Slurm task, worker 0 the chief.

    ``srun`` sets ``SLURM_PROCID`` (this task's rank), ``SLURM_STEP_NODELIST``
    (the step's nodes, as ``node[01-04],gpu7``) and
    ``SLURM_STEP_TASKS_PER_NODE`` (as ``2(x3),1``); ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_NTASKS``, where set, must agree. The tasks sit on the nodes in
    Slurm's order, as its default block distribution places them; a node's tasks listen on
    ``CNNPAR_SLURM_PORT`` (default 8888) and the next ports. On GPU nodes,
    :meth:`assign_devices` divides each node's GPUs evenly among its tasks.
    This is what TensorFlow's ``SlurmClusterResolver`` built, except that the
    resolver sorted the node names as text (``node10`` before ``node9``,
    unlike Slurm's ranks) and numbered the GPUs from 0 whatever
    ``CUDA_VISIBLE_DEVICES`` listed.

    >>> step = Slurm({"SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "node[9-10]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    >>> step.tf_config()
    {'cluster': {'worker': ['node9:8888', 'node9:8889', 'node10:8888', 'node10:8889']}, \
'task': {'type': 'worker', 'index': 2}}
    >>> step.chief()
    'node9:8888'

    Args:
        environ: the variables to read; default ``os.environ``.
    """

    name = "the Slurm job step"
    detected_by = ("SLURM_PROCID", "SLURM_STEP_NODELIST")
    creates_processes_externally = True

    def tf_config(self):
        nodes = self._nodes()
        most = max(tasks for _, tasks in nodes)  # a node's tasks listen on the port and the next ones
        port = _int(self.environ, SLURM_PORT, DEFAULT_PORT, low=1, high=65536 - most)
        workers = [f"{node}:{port + local}" for node, tasks in nodes for local in range(tasks)]
        return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": self._rank(len(workers))}}

    def assign_devices(self):
        """Give this task its share of its node's GPUs in ``CUDA_VISIBLE_DEVICES``: as many as each task of the
        busiest node gets, the first share to the node's first task. A node without GPUs is left as it is.

        The node's GPUs are ``CUDA_VISIBLE_DEVICES``'s, else ``nvidia-smi``'s. They are kept in
        ``CNNPAR_SLURM_NODE_GPUS``, so that a second call (in this process, or in a program it runs) gives the
        same share.

        >>> environ = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2",
        ...            "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
        >>> Slurm(environ).assign_devices(); Slurm(environ).assign_devices()
        >>> environ["CUDA_VISIBLE_DEVICES"]
        '6,7'
        """
        gpus = self._node_gpus()
        if not gpus:
            return
        nodes = self._nodes()
        busiest = max(tasks for _, tasks in nodes)
        share = len(gpus) // busiest
        if share == 0:
            raise ValueError(f"CUDA_VISIBLE_DEVICES: a node's {len(gpus)} GPUs cannot be divided among its {busiest} "
                             f"tasks; run at most one task per GPU (srun --ntasks-per-node). Received: "
                             f"CUDA_VISIBLE_DEVICES={self.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                             f"SLURM_STEP_TASKS_PER_NODE={self.environ.get('SLURM_STEP_TASKS_PER_NODE')!r}")
        local = self._local_index(nodes)
        self.environ[SLURM_NODE_GPUS] = ",".join(gpus)
        self.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[local * share:(local + 1) * share])

    def _nodes(self):
        """``[(node, its number of tasks)]`` in Slurm's order."""
        listed, counts = self.environ.get("SLURM_STEP_NODELIST", ""), self.environ.get("SLURM_STEP_TASKS_PER_NODE")
        nodes, tasks = expand_hostlist(listed), expand_tasks_per_node(counts or "")
        if len(tasks) != len(nodes):
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE: expected a number of tasks for each of the {len(nodes)} "
                             f"nodes of SLURM_STEP_NODELIST. Received: SLURM_STEP_TASKS_PER_NODE={counts!r}, "
                             f"SLURM_STEP_NODELIST={listed!r}")
        for variable in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):  # srun sets both to the step's tasks
            declared = _int(self.environ, variable, sum(tasks), low=1)
            if declared != sum(tasks):
                raise ValueError(f"{variable}: the step's {sum(tasks)} tasks (SLURM_STEP_TASKS_PER_NODE) disagree "
                                 f"with it. Received: {variable}={str(declared)!r}, "
                                 f"SLURM_STEP_TASKS_PER_NODE={counts!r}")
        return list(zip(nodes, tasks))

    def _rank(self, tasks):
        rank = _int(self.environ, "SLURM_PROCID", low=0)
        if rank >= tasks:
            raise ValueError(f"SLURM_PROCID: task {rank} is outside the job step's {tasks} tasks. "
                             f"Received: SLURM_PROCID={self.environ['SLURM_PROCID']!r}")
        return rank

    def _local_index(self, nodes):
        """This task's place among its node's tasks (the nodes' tasks are ranked in turn, as blocks)."""
        rank = self._rank(sum(tasks for _, tasks in nodes))
        for _, tasks in nodes:
            if rank < tasks:
                return rank
            rank -= tasks

    def _node_gpus(self):
        """The node's GPU ids: kept by an earlier division, ``CUDA_VISIBLE_DEVICES``'s, else ``nvidia-smi``'s."""
        visible = self.environ.get(SLURM_NODE_GPUS, self.environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is not None:
            return [device.strip() for device in visible.split(",") if device.strip()]
        if shutil.which("nvidia-smi") is None:
            return []
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True)
        return [str(i) for i in range(sum(line.startswith("GPU ") for line in listed.stdout.splitlines()))]


def expand_hostlist(text, name="SLURM_STEP_NODELIST"):
    """The node names of a Slurm host list, in its order.

    >>> expand_hostlist("node[08-10],gpu7,rack[1-2]-n[1,3]")
    ['node08', 'node09', 'node10', 'gpu7', 'rack1-n1', 'rack1-n3', 'rack2-n1', 'rack2-n3']
    >>> expand_hostlist("node[3-1]")
    Traceback (most recent call last):
    ValueError: SLURM_STEP_NODELIST: expected node names as node[01-04],gpu7. Received: SLURM_STEP_NODELIST='node[3-1]'
    """
    parts = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", text)
    hosts = [host for part in parts for host in _expand_brackets(part)] if ",".join(parts) == text else None
    if not hosts or None in hosts:
        raise ValueError(f"{name}: expected node names as node[01-04],gpu7. Received: {name}={text!r}")
    return hosts


def _expand_brackets(part):
    """``rack[1-2]-n[1,3]``'s names; None among them where a range is malformed."""
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", part)
    if match is None:
        return [part]
    prefix, ranges, rest = match.groups()
    numbers = [number for piece in ranges.split(",") for number in _expand_range(piece)]
    return [None if None in (number, tail) else prefix + number + tail
            for number in numbers for tail in _expand_brackets(rest)]


def _expand_range(piece):
    """``08-10`` as ``['08', '09', '10']`` (the first number's width), ``7`` as ``['7']``; ``[None]`` if malformed."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
    if match is None or int(match[2] or match[1]) < int(match[1]):
        return [None]
    return [str(number).zfill(len(match[1])) for number in range(int(match[1]), int(match[2] or match[1]) + 1)]


def expand_tasks_per_node(text, name="SLURM_STEP_TASKS_PER_NODE"):
    """The number of tasks on each node of the step, in the node list's order.

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    pieces = [re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece) for piece in text.split(",")]
    if not all(pieces) or any(int(piece[1]) == 0 or int(piece[2] or 1) == 0 for piece in pieces):  # 2(x00) too
        raise ValueError(f"{name}: expected tasks per node as 2(x3),1. Received: {name}={text!r}")
    return [int(piece[1]) for piece in pieces for _ in range(int(piece[2] or 1))]


class KubernetesIndexedJob(ClusterEnvironment):
    """A Kubernetes Indexed Job whose pods reach each other through a headless Service: one worker per pod.

    An Indexed Job gives each pod ``JOB_COMPLETION_INDEX`` (0 to
    ``completions`` - 1) and the host name ``<job>-<index>`` (``HOSTNAME``;
    where it is not set, the host name itself). With the pod template's
    ``subdomain`` naming a headless Service, ``<job>-<index>.<service>``
    resolves to that pod within the namespace. The pod template sets:

    - ``CNNPAR_K8S_WORKERS``: the number of workers, the Job's ``completions``
      (and ``parallelism``, so that every pod runs at once). With
      ``JOB_COMPLETION_INDEX``, it is what marks the environment.
    - ``CNNPAR_K8S_SERVICE``: the headless Service, as ``subdomain`` names it.
    - ``CNNPAR_K8S_PORT`` (optional): the port of every pod's server; default
      8888. Pods need no ``containerPort`` for it, but network policies must
      let the pods reach each other on it.

    Worker ``i`` is ``<job>-<i>.<service>:<port>``; worker 0 is the chief. The
    manifests' essentials (the Service selects the pods by the ``job-name``
    label that Kubernetes gives them; the Job's name keeps ``<job>-<index>``
    within 63 characters)::

        apiVersion: v1
        kind: Service
        metadata: {name: workers}
        spec: {clusterIP: None, selector: {job-name: train}}
        ---
        apiVersion: batch/v1
        kind: Job
        metadata: {name: train}
        spec:
          completionMode: Indexed
          completions: 2
          parallelism: 2
          template:
            spec:
              subdomain: workers
              restartPolicy: Never
              containers:
              - name: worker
                image: your-image
                command: [cnnpar, launch, --, python, train.py]
                env:
                - {name: CNNPAR_K8S_WORKERS, value: "2"}
                - {name: CNNPAR_K8S_SERVICE, value: workers}

    >>> pod = KubernetesIndexedJob({"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "train-1", "CNNPAR_K8S_WORKERS": "2",
    ...                             "CNNPAR_K8S_SERVICE": "workers"})
    >>> pod.tf_config()
    {'cluster': {'worker': ['train-0.workers:8888', 'train-1.workers:8888']}, 'task': {'type': 'worker', 'index': 1}}
    >>> pod.chief()
    'train-0.workers:8888'

    Args:
        environ: the variables to read; default ``os.environ``.
    """

    name = "the Kubernetes Indexed Job"
    detected_by = ("JOB_COMPLETION_INDEX", K8S_WORKERS)
    creates_processes_externally = True

    def tf_config(self):
        workers, index = _int(self.environ, K8S_WORKERS, low=1), _int(self.environ, "JOB_COMPLETION_INDEX", low=0)
        if index >= workers:
            raise ValueError(f"JOB_COMPLETION_INDEX: pod {index} is outside the Job's {workers} workers; set "
                             f"{K8S_WORKERS} to the Job's completions. Received: JOB_COMPLETION_INDEX="
                             f"{str(index)!r}, {K8S_WORKERS}={str(workers)!r}")
        job, service = self._job(index), self._service()
        port = _int(self.environ, K8S_PORT, DEFAULT_PORT, low=1, high=65535)
        workers = [f"{job}-{i}.{service}:{port}" for i in range(workers)]
        return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}

    def _job(self, index):
        """The Job's name: the pod's host name, ``<job>-<index>``, without its index."""
        hostname = self.environ.get("HOSTNAME") or socket.gethostname()
        job, _, suffix = hostname.rpartition("-")
        if not job or suffix != str(index):
            raise ValueError(f"HOSTNAME: expected the host name <job>-<index> that an Indexed Job gives its pods. "
                             f"Received: HOSTNAME={hostname!r}, JOB_COMPLETION_INDEX={str(index)!r}")
        return job

    def _service(self):
        service = self.environ.get(K8S_SERVICE, "")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", service):
            raise ValueError(f"{K8S_SERVICE}: expected the name of the headless Service that the pod template's "
                             f"subdomain names. Received: {K8S_SERVICE}={service!r}")
        return service


#: The kinds :func:`detect` tries, in order: the first that applies describes the cluster.
ENVIRONMENTS = (TFConfig, Slurm, KubernetesIndexedJob)


def detect(environ=None):
    """The environment that describes this process's cluster: the first kind of :data:`ENVIRONMENTS` whose
    variables are set in ``environ`` (default ``os.environ``), or None.

    >>> detect({"TF_CONFIG": "{}", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n1"})
    <TFConfig: TF_CONFIG>
    """
    return next((kind(environ) for kind in ENVIRONMENTS if kind.detect(environ)), None)


def resolve(environ=None):
    """The environment that describes this process's cluster, as :func:`detect` finds it; without any,
    :class:`TFConfig`, whose :meth:`~ClusterEnvironment.task` then says how to give a cluster.

    >>> resolve({}).task()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, ... Received: TF_CONFIG=''
    """
    return detect(environ) or TFConfig(environ)


def _environ(environ):
    return os.environ if environ is None else environ


def _int(environ, name, default=None, *, low, high=None):
    """The int in the variable ``name`` (``default`` where it is unset or empty), within ``low``..``high``."""
    text = environ.get(name) or ""
    if not text and default is not None:
        return default
    if (not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > 18  # int() refuses 4301 digits or more
            or not low <= int(text) <= (high or int(text))):
        bounds = f"in {low}..{high}" if high else f">= {low}"
        raise ValueError(f"{name}: expected an int {bounds}. Received: {name}={text!r}")
    return int(text)
