"""Clusters of TensorFlow tasks: the spec and this task (``TF_CONFIG``), the environments that describe them
(``TF_CONFIG``, Slurm, Kubernetes: :mod:`.environments`), the network (ports, reachability,
namespaces), server processes and local worker processes. Never imports the strategies.

``cnnpar.cluster`` keeps the names of :mod:`.spec` and :mod:`.environments`:

>>> from keras_cnnpar import cluster
>>> cluster.parse_spec({"worker": ["localhost:2222"], "ps": ["localhost:2223"]})
{'worker': ['localhost:2222'], 'ps': ['localhost:2223']}
"""

from keras_cnnpar.cluster.environments import (
    ENVIRONMENTS,
    SLURM_PORT,
    ClusterEnvironment,
    KubernetesIndexedJob,
    Slurm,
    TFConfig,
    detect,
    resolve,
)
from keras_cnnpar.cluster.spec import (
    JOIN_AT_IMPORT,
    TRAINING_JOBS,
    Task,
    check_coordinator,
    coordinator_address,
    local_spec,
    parse_json,
    parse_spec,
    read_json_file,
    read_tf_config,
)

__all__ = ["ENVIRONMENTS", "JOIN_AT_IMPORT", "SLURM_PORT", "TRAINING_JOBS", "ClusterEnvironment",
           "KubernetesIndexedJob", "Slurm", "TFConfig", "Task", "check_coordinator", "coordinator_address", "detect",
           "local_spec", "parse_json", "parse_spec", "read_json_file", "read_tf_config", "resolve"]
