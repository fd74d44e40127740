"""The clusters this process joined, and the servers it started for them: made once, kept until the process ends.

TensorFlow joins a cluster only before its runtime starts, and never leaves
it; a server it started serves until the process ends. So a strategy that
joins a cluster (``MultiWorkerMirroredStrategy``, a ``ParameterServerStrategy``
coordinator) asks :data:`this_process` for what it joined, and joins only the
first time. The registry holds objects without knowing them: it imports no
TensorFlow.
"""

import collections
import json


class JoinedClusters:
    """What a process made to take part in clusters, one per kind and cluster, for the rest of the process.

    ``join(kind, config, connect)`` calls ``connect()`` the first time it
    sees ``kind`` with a ``config`` equal to one before, and returns what it
    returned every time; ``current(kind)`` is what the latest ``join`` of
    ``kind`` returned. A ``config`` is JSON-like (a ``TF_CONFIG``, a spec).

    >>> clusters = JoinedClusters()
    >>> config = {"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 0}}
    >>> first = clusters.join("multi-worker", config, lambda: object())
    >>> clusters.join("multi-worker", dict(config), lambda: object()) is first
    True
    >>> clusters.current("multi-worker") is first, clusters.current("async-ps")
    (True, None)
    >>> clusters
    <JoinedClusters multi-worker: 1>
    """

    def __init__(self):
        self._made = {}
        self._current = {}

    def join(self, kind, config, connect):
        """What ``connect()`` returned for ``kind`` and ``config``; it is called the first time only.

        Args:
            kind: what was made, as ``"multi-worker"`` or ``"async-ps servers"``.
            config: the cluster it was made for, JSON-like; equal configs are the same cluster.
            connect: makes it, without arguments: joins the cluster, or starts the servers.
        """
        key = (kind, json.dumps(config, sort_keys=True))
        if key not in self._made:
            self._made[key] = connect()
        self._current[kind] = self._made[key]
        return self._made[key]

    def current(self, kind):
        """What the latest :meth:`join` of ``kind`` returned, or None before any."""
        return self._current.get(kind)

    def __repr__(self):
        counts = collections.Counter(kind for kind, _ in self._made)
        return f"<JoinedClusters {', '.join(f'{kind}: {n}' for kind, n in counts.items()) or 'none'}>"


#: This process's clusters.
this_process = JoinedClusters()
