"""This process as the coordinator of a parameter-server cluster: the local cluster's servers, started once, and
the ``ParameterServerStrategy`` with its ``ClusterCoordinator`` (:class:`Connection`)."""

import tensorflow as tf

from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.cluster.joined import this_process


class Connection:
    """This process's place in a cluster as its coordinator: the spec, the ``ParameterServerStrategy`` and
    the ``ClusterCoordinator``. Made once per cluster and process (``this_process.join("async-ps", ...)``); the
    latest is ``this_process.current("async-ps")``."""

    def __init__(self, cluster, tf_strategy, coordinator):
        self.cluster, self.tf_strategy, self.coordinator = cluster, tf_strategy, coordinator


def servers(spec):
    """The jobs of ``spec`` whose servers must answer before a coordinator joins: all but its own ``chief``."""
    return {job: tasks for job, tasks in spec.items() if job != "chief"}


def local_cluster(workers, ps):
    """The spec of ``workers`` + ``ps`` TensorFlow gRPC servers in this (the coordinator) process, started once
    (``this_process`` keeps them serving)."""
    spec, _ = this_process.join("async-ps servers", {"workers": workers, "ps": ps},
                                lambda: _start_local_cluster(workers, ps))
    return spec


def _start_local_cluster(workers, ps, tries=3):
    """Start ``workers`` + ``ps`` servers on free ports of this machine; return their spec and the servers.

    The ports are chosen free, then bound by TensorFlow, which takes no socket
    that is already bound; when another process took one in between, the
    servers start again on fresh ports, ``tries`` times in all.
    """
    for attempt in range(1, tries + 1):
        spec = cluster_lib.local_spec(workers, ps)
        try:
            return spec, _start_servers(spec, workers)
        except (tf.errors.OpError, RuntimeError) as error:
            if attempt == tries:
                raise ConnectionError(f"cannot start the local cluster: {tries} tries on fresh ports failed; "
                                      f"the last one: {error}") from None


def _start_servers(spec, workers):
    cluster_spec = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=workers + 1)
    return [
        *(tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=config, protocol="grpc")
          for i in range(workers)),
        *(tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, protocol="grpc")
          for i in range(len(spec.get("ps", ())))),
    ]


def connect(cluster, chief):
    """Connect this process to ``cluster`` as its coordinator, task ``chief:0`` at ``chief``."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({**cluster, "chief": [chief]}), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)  # whole variables, round-robin over the ps tasks
    return Connection(cluster, strategy, tf.distribute.coordinator.ClusterCoordinator(strategy))
