"""Clusters of TensorFlow tasks: the spec and this task (``TF_CONFIG``), the network (ports, reachability,
namespaces), server processes and local worker processes. Never imports the strategies.

``cnnpar.cluster`` keeps the names of :mod:`.spec`:

>>> from keras_cnnpar import cluster
>>> cluster.parse_spec({"worker": ["localhost:2222"], "ps": ["localhost:2223"]})
{'worker': ['localhost:2222'], 'ps': ['localhost:2223']}
"""

from keras_cnnpar.cluster.spec import (
    JOIN_AT_IMPORT,
    SLURM_PORT,
    TRAINING_JOBS,
    Task,
    check_coordinator,
    cluster_in_environment,
    coordinator_address,
    local_spec,
    parse_json,
    parse_spec,
    read_json_file,
    slurm_step,
)

__all__ = ["JOIN_AT_IMPORT", "SLURM_PORT", "TRAINING_JOBS", "Task", "check_coordinator", "cluster_in_environment",
           "coordinator_address", "local_spec", "parse_json", "parse_spec", "read_json_file", "slurm_step"]
