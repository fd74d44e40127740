"""Cluster environments from their variables alone: TF_CONFIG, a Slurm job step, a Kubernetes Indexed Job."""

import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from keras_cnnpar import cli
from keras_cnnpar.cluster import environments
from keras_cnnpar.cluster.environments import KubernetesIndexedJob, Slurm, TFConfig
from tests.helpers import cnnpar_command

#: Every variable that an environment reads, or that an assignment of GPUs writes.
VARIABLES = ["TF_CONFIG", "SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
             "SLURM_NTASKS", "CNNPAR_SLURM_PORT", "CNNPAR_SLURM_NODE_GPUS", "CUDA_VISIBLE_DEVICES",
             "JOB_COMPLETION_INDEX", "HOSTNAME", "CNNPAR_K8S_WORKERS", "CNNPAR_K8S_SERVICE", "CNNPAR_K8S_PORT"]
TF_CONFIG = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
                                      "task": {"type": "worker", "index": 1}})}
SLURM = {"SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "node[9-10],gpu7", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
         "SLURM_STEP_NUM_TASKS": "5"}
KUBERNETES = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "train-2", "CNNPAR_K8S_WORKERS": "3",
              "CNNPAR_K8S_SERVICE": "workers"}


@pytest.fixture
def environ(monkeypatch):
    """Set the variables given (none of the others): ``environ(**variables)``."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_variables(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_variables


def test_no_variables_describe_no_cluster(environ):
    environ()
    assert environments.detect() is None
    assert not any(kind.detect() for kind in environments.ENVIRONMENTS)


def test_tf_config_gives_its_cluster_task_and_chief(environ):
    environ(**TF_CONFIG)
    environment = environments.detect()
    assert isinstance(environment, TFConfig) and environment.name == "TF_CONFIG"
    assert environment.tf_config() == json.loads(TF_CONFIG["TF_CONFIG"])
    task = environment.task()
    assert (task.type, task.index, task.num_workers, task.is_chief) == ("worker", 1, 3, False)
    assert environment.chief() == "h0:2222"
    assert not environment.creates_processes_externally


def test_a_slurm_step_gives_one_worker_per_task_in_slurm_s_node_order(environ):
    environ(**SLURM)
    environment = environments.detect()
    assert isinstance(environment, Slurm) and environment.name == "the Slurm job step"
    assert environment.tf_config() == {
        "cluster": {"worker": ["node9:8888", "node9:8889", "node10:8888", "node10:8889", "gpu7:8888"]},
        "task": {"type": "worker", "index": 3}}
    assert repr(environment.task()) == "<Task worker:3 of {'worker': 5}>"
    assert environment.chief() == "node9:8888"
    assert environment.creates_processes_externally


def test_a_slurm_step_s_ports_start_at_cnnpar_slurm_port(environ):
    environ(SLURM_PROCID="0", SLURM_STEP_NODELIST="n[001-002]", SLURM_STEP_TASKS_PER_NODE="1(x2)",
            CNNPAR_SLURM_PORT="7000")
    assert environments.detect().tf_config()["cluster"] == {"worker": ["n001:7000", "n002:7000"]}
    assert environments.detect().task().is_chief


def test_a_kubernetes_indexed_job_gives_one_worker_per_pod_by_its_host_name(environ):
    environ(**KUBERNETES)
    environment = environments.detect()
    assert isinstance(environment, KubernetesIndexedJob) and environment.name == "the Kubernetes Indexed Job"
    assert environment.tf_config() == {
        "cluster": {"worker": ["train-0.workers:8888", "train-1.workers:8888", "train-2.workers:8888"]},
        "task": {"type": "worker", "index": 2}}
    assert repr(environment.task()) == "<Task worker:2 of {'worker': 3}>"
    assert environment.chief() == "train-0.workers:8888"
    assert environment.creates_processes_externally


def test_a_kubernetes_job_s_port_is_cnnpar_k8s_port(environ):
    environ(**KUBERNETES, CNNPAR_K8S_PORT="2222")
    assert environments.detect().chief() == "train-0.workers:2222"


def test_an_indexed_job_without_cnnpar_k8s_workers_is_not_taken_for_a_cluster(environ):
    environ(JOB_COMPLETION_INDEX="0", HOSTNAME="batch-0")  # any Indexed Job's pod, say a CI runner's
    assert environments.detect() is None


@pytest.mark.parametrize("kinds, expected", [
    (("tf_config", "slurm", "kubernetes"), TFConfig),
    (("tf_config", "slurm"), TFConfig),
    (("slurm", "kubernetes"), Slurm),
    (("tf_config", "kubernetes"), TFConfig),
])
def test_tf_config_wins_over_slurm_and_slurm_over_kubernetes(environ, kinds, expected):
    variables = {"tf_config": TF_CONFIG, "slurm": SLURM, "kubernetes": KUBERNETES}
    environ(**{name: value for kind in kinds for name, value in variables[kind].items()})
    assert type(environments.detect()) is expected


def test_an_empty_tf_config_is_no_cluster_and_resolve_says_how_to_give_one(environ):
    environ(TF_CONFIG="")
    assert environments.detect() is None
    with pytest.raises(ValueError, match=r"^no cluster: TF_CONFIG is not set\. Set TF_CONFIG on every host"):
        environments.resolve().task()


@pytest.mark.parametrize("variables, message", [
    ({"TF_CONFIG": "{oops"}, "TF_CONFIG: expected JSON, line 1 column 2: Expecting property name enclosed in "
                             "double quotes. Received: '{oops'"),
    ({"TF_CONFIG": '"spec.json"'}, "TF_CONFIG: expected a JSON object with a 'cluster' and a 'task'. "
                                   "Received: TF_CONFIG='\"spec.json\"'"),
    ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID: expected an int >= 0. Received: SLURM_PROCID='x'"),
    ({**SLURM, "SLURM_PROCID": "5"}, "SLURM_PROCID: task 5 is outside the job step's 5 tasks. "
                                     "Received: SLURM_PROCID='5'"),
    ({**SLURM, "SLURM_STEP_NODELIST": "node[9-10"}, "SLURM_STEP_NODELIST: expected node names as "
                                                    "node[01-04],gpu7. Received: SLURM_STEP_NODELIST='node[9-10'"),
    ({**SLURM, "SLURM_STEP_NODELIST": "node[10-9]"}, "SLURM_STEP_NODELIST: expected node names as "
                                                     "node[01-04],gpu7. Received: SLURM_STEP_NODELIST='node[10-9]'"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2"}, "SLURM_STEP_TASKS_PER_NODE: expected tasks per node as "
                                                     "2(x3),1. Received: SLURM_STEP_TASKS_PER_NODE='2(x2'"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x00),2,1"}, "SLURM_STEP_TASKS_PER_NODE: expected tasks per node as "
                                                          "2(x3),1. Received: SLURM_STEP_TASKS_PER_NODE='2(x00),2,1'"),
    ({key: value for key, value in SLURM.items() if key != "SLURM_STEP_TASKS_PER_NODE"},
     "SLURM_STEP_TASKS_PER_NODE: expected tasks per node as 2(x3),1. Received: SLURM_STEP_TASKS_PER_NODE=''"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     "SLURM_STEP_TASKS_PER_NODE: expected a number of tasks for each of the 3 nodes of SLURM_STEP_NODELIST. "
     "Received: SLURM_STEP_TASKS_PER_NODE='2(x2)', SLURM_STEP_NODELIST='node[9-10],gpu7'"),
    ({**SLURM, "SLURM_STEP_NUM_TASKS": "4"},
     "SLURM_STEP_NUM_TASKS: the step's 5 tasks (SLURM_STEP_TASKS_PER_NODE) disagree with it. "
     "Received: SLURM_STEP_NUM_TASKS='4', SLURM_STEP_TASKS_PER_NODE='2(x2),1'"),
    ({**SLURM, "SLURM_NTASKS": "3"},  # an allocation's 3 tasks on 2 nodes, where the step's say otherwise
     "SLURM_NTASKS: the step's 5 tasks (SLURM_STEP_TASKS_PER_NODE) disagree with it. "
     "Received: SLURM_NTASKS='3', SLURM_STEP_TASKS_PER_NODE='2(x2),1'"),
    ({**SLURM, "CNNPAR_SLURM_PORT": "70000"}, "CNNPAR_SLURM_PORT: expected an int in 1..65534. "
                                              "Received: CNNPAR_SLURM_PORT='70000'"),
    ({**SLURM, "CNNPAR_SLURM_PORT": "65535"}, "CNNPAR_SLURM_PORT: expected an int in 1..65534. "  # 2 tasks a node
                                              "Received: CNNPAR_SLURM_PORT='65535'"),
    ({**KUBERNETES, "CNNPAR_K8S_WORKERS": "two"}, "CNNPAR_K8S_WORKERS: expected an int >= 1. "
                                                  "Received: CNNPAR_K8S_WORKERS='two'"),
    ({**KUBERNETES, "CNNPAR_K8S_WORKERS": "2"},
     "JOB_COMPLETION_INDEX: pod 2 is outside the Job's 2 workers; set CNNPAR_K8S_WORKERS to the Job's completions. "
     "Received: JOB_COMPLETION_INDEX='2', CNNPAR_K8S_WORKERS='2'"),
    ({**KUBERNETES, "HOSTNAME": "train-7"}, "HOSTNAME: expected the host name <job>-<index> that an Indexed Job "
                                           "gives its pods. Received: HOSTNAME='train-7', JOB_COMPLETION_INDEX='2'"),
    ({**KUBERNETES, "CNNPAR_K8S_SERVICE": ""}, "CNNPAR_K8S_SERVICE: expected the name of the headless Service that "
                                              "the pod template's subdomain names. Received: CNNPAR_K8S_SERVICE=''"),
    ({**KUBERNETES, "CNNPAR_K8S_SERVICE": "workers.default"},
     "CNNPAR_K8S_SERVICE: expected the name of the headless Service that the pod template's subdomain names. "
     "Received: CNNPAR_K8S_SERVICE='workers.default'"),
    ({**KUBERNETES, "CNNPAR_K8S_PORT": "0"}, "CNNPAR_K8S_PORT: expected an int in 1..65535. "
                                             "Received: CNNPAR_K8S_PORT='0'"),
])
def test_a_bad_value_is_a_value_error_naming_its_variable(environ, variables, message):
    environ(**variables)
    with pytest.raises(ValueError) as raised:
        environments.detect().task()
    assert str(raised.value) == message


@pytest.mark.parametrize("visible, tasks_per_node, shares", [
    ("0,1,2,3", "2", ["0,1", "2,3"]),
    ("4,5,6,7", "2", ["4,5", "6,7"]),  # the node's own GPU ids, not 0..N-1
    ("0,1,2", "2", ["0", "1"]),  # an equal share each; the rest unused
    ("", "2", ["", ""]),  # a CPU node: left as it is
])
def test_a_slurm_node_s_gpus_are_divided_among_its_tasks_once(environ, visible, tasks_per_node, shares):
    for rank, share in enumerate(shares):
        environ(SLURM_PROCID=str(rank), SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                CUDA_VISIBLE_DEVICES=visible)
        environments.detect().assign_devices()
        environments.detect().assign_devices()  # again, as a MultiWorker() after joining at import does
        assert os.environ["CUDA_VISIBLE_DEVICES"] == share


def test_more_slurm_tasks_than_gpus_on_a_node_is_a_value_error(environ):
    environ(SLURM_PROCID="0", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="3", CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(ValueError) as raised:
        environments.detect().assign_devices()
    assert str(raised.value) == ("CUDA_VISIBLE_DEVICES: a node's 2 GPUs cannot be divided among its 3 tasks; run at "
                                 "most one task per GPU (srun --ntasks-per-node). Received: CUDA_VISIBLE_DEVICES="
                                 "'0,1', SLURM_STEP_TASKS_PER_NODE='3'")


@pytest.mark.parametrize("variables", [TF_CONFIG, KUBERNETES], ids=["tf_config", "kubernetes"])
def test_tf_config_and_kubernetes_leave_the_devices_alone(environ, variables):
    environ(**variables, CUDA_VISIBLE_DEVICES="0,1")
    environments.detect().assign_devices()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_cnnpar_launch_in_a_kubernetes_pod_checks_workers_against_the_job(environ):
    environ(**KUBERNETES)
    result = CliRunner().invoke(cli.main, ["launch", "--workers", "2", "--", "python", "train.py"])
    assert result.exit_code == 2
    assert "the Kubernetes Indexed Job holds 3 workers. Received: --workers 2" in result.output


def test_cnnpar_launch_outside_a_scheduler_needs_workers(environ):
    environ()
    result = CliRunner().invoke(cli.main, ["launch", "--", "python", "train.py"])
    assert result.exit_code == 2
    assert "Missing option '--workers' (needed unless the Slurm job step or the Kubernetes Indexed Job started " \
           "this process)." in result.output


@pytest.mark.slow  # a launcher process and the command it starts
def test_cnnpar_launch_in_a_kubernetes_pod_runs_the_command_once_joining_at_import(environ):
    environ(**KUBERNETES)
    command = cnnpar_command("launch", "--", "python", "-c", "import os; print(os.environ['CNNPAR_MULTI_WORKER'])")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "1\n"


def test_a_tf_config_whose_task_index_is_outside_its_job_is_refused_naming_the_job(environ):
    """docs/multi_worker.md: a malformed spec is refused before anything starts (`task index 2 is outside job
    'worker', which has 2 tasks`)."""
    task = {"type": "worker", "index": 2}
    environ(TF_CONFIG=json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": task}))
    with pytest.raises(ValueError) as raised:
        environments.detect().task()
    assert str(raised.value) == f"TF_CONFIG: task index 2 is outside job 'worker', which has 2 tasks. Received: " \
                                f"task={task!r}"


def test_the_base_environment_describes_no_cluster_and_each_kind_names_itself(environ):
    environ(**TF_CONFIG, **SLURM, **KUBERNETES)
    base = environments.ClusterEnvironment()
    assert not environments.ClusterEnvironment.detect() and not environments.ClusterEnvironment.detect({"X": "1"})
    assert base.assign_devices() is None and repr(base) == "<ClusterEnvironment: the cluster environment>"
    with pytest.raises(NotImplementedError):
        base.tf_config()
    assert [repr(kind({})) for kind in environments.ENVIRONMENTS] == [
        "<TFConfig: TF_CONFIG>", "<Slurm: the Slurm job step>",
        "<KubernetesIndexedJob: the Kubernetes Indexed Job>"]
    assert [kind.detect(dict.fromkeys(some, "1")) for kind in environments.ENVIRONMENTS
            for some in (kind.detected_by[:-1], kind.detected_by[1:])] == [False] * 6  # every marking variable


def test_the_last_slurm_task_is_in_the_step_and_its_ranks_fill_each_node_in_turn(environ):
    environ(**{**SLURM, "SLURM_PROCID": "4", "SLURM_NTASKS": "5"})
    assert environments.detect().task().index == 4
    for rank, share in enumerate(["0,1", "2,3", "0,1", "2,3", "0,1"]):  # node9: 0-1, node10: 2-3, gpu7: 4
        environ(**{**SLURM, "SLURM_PROCID": str(rank), "CUDA_VISIBLE_DEVICES": " 0, 1,,2 ,3"})
        os.environ.pop("CNNPAR_SLURM_NODE_GPUS", None)
        environments.detect().assign_devices()
        assert os.environ["CUDA_VISIBLE_DEVICES"] == share
        assert os.environ["CNNPAR_SLURM_NODE_GPUS"] == "0,1,2,3"


def test_a_slurm_nodes_gpus_are_nvidia_smis_where_cuda_visible_devices_is_unset(environ, tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --list-gpus ] && printf 'GPU 0: A (UUID: 1)\\nGPU 1: A (UUID: 2)\\n"
                   "GPU 2: A (UUID: 3)\\nnot a GPU\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    environ(SLURM_PROCID="1", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="3")
    environments.detect().assign_devices()
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["CNNPAR_SLURM_NODE_GPUS"]) == ("1", "0,1,2")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: a node without GPUs, left as it is
    environ(SLURM_PROCID="1", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="3")
    for name in ("CUDA_VISIBLE_DEVICES", "CNNPAR_SLURM_NODE_GPUS"):
        monkeypatch.delenv(name)
    environments.detect().assign_devices()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and "CNNPAR_SLURM_NODE_GPUS" not in os.environ


def test_a_pod_without_hostname_takes_the_job_from_its_host_name(environ, monkeypatch):
    environ(**{key: value for key, value in KUBERNETES.items() if key != "HOSTNAME"})
    monkeypatch.setattr(environments.socket, "gethostname", lambda: "train-2")
    assert environments.detect().chief() == "train-0.workers:8888"


@pytest.mark.parametrize("hostname", ["-2", "train2", "train-02"])
def test_a_pods_host_name_must_be_its_job_a_dash_and_its_index(environ, hostname):
    environ(**{**KUBERNETES, "HOSTNAME": hostname})
    with pytest.raises(ValueError) as raised:
        environments.detect().task()
    assert str(raised.value) == (f"HOSTNAME: expected the host name <job>-<index> that an Indexed Job gives its pods. "
                                 f"Received: HOSTNAME={hostname!r}, JOB_COMPLETION_INDEX='2'")


@pytest.mark.parametrize("service, taken", [("w", True), ("w-1", True), ("0a", True), ("Workers", False),
                                            ("-w", False), ("w-", False), ("w_1", False)])
def test_a_service_is_a_dns_label_of_lowercase_letters_digits_and_inner_dashes(environ, service, taken):
    environ(**{**KUBERNETES, "CNNPAR_K8S_SERVICE": service})
    if taken:
        assert environments.detect().chief() == f"train-0.{service}:8888"
        return
    with pytest.raises(ValueError, match=rf"^CNNPAR_K8S_SERVICE: expected the name of the headless Service .* "
                                         rf"Received: CNNPAR_K8S_SERVICE='{service}'$"):
        environments.detect().task()


@pytest.mark.parametrize("text, high, expected", [
    ("", None, 7), ("0", None, "expected an int >= 1"), ("1", None, 1), ("65535", 65535, 65535),
    ("65536", 65535, "expected an int in 1..65535"), ("0" * 30 + "8", 65535, 8),
    ("9" * 19, None, "expected an int >= 1"), ("9" * 18, None, 10**18 - 1), ("٣", None, "expected an int >= 1"),
    ("+5", None, "expected an int >= 1"),
])
def test_a_variables_int_is_its_ascii_digits_within_its_bounds_or_a_refusal_naming_them(text, high, expected):
    if isinstance(expected, int):
        assert environments._int({"CNNPAR_X": text}, "CNNPAR_X", 7, low=1, high=high) == expected
        return
    with pytest.raises(ValueError) as raised:
        environments._int({"CNNPAR_X": text}, "CNNPAR_X", 7, low=1, high=high)
    assert str(raised.value) == f"CNNPAR_X: {expected}. Received: CNNPAR_X={text!r}"


def test_detect_and_resolve_read_the_variables_they_are_given_not_the_processs(environ):
    environ(**TF_CONFIG)  # this process's variables describe another cluster
    assert environments.detect(SLURM).tf_config()["cluster"]["worker"][-1] == "gpu7:8888"
    assert environments.resolve(KUBERNETES).chief() == "train-0.workers:8888"
    with pytest.raises(ValueError, match=r"^no cluster: TF_CONFIG is not set\."):
        environments.resolve({}).task()


def test_the_first_pod_of_a_job_whose_name_holds_dashes_is_its_chief(environ):
    environ(JOB_COMPLETION_INDEX="0", HOSTNAME="my-train-0", CNNPAR_K8S_WORKERS="2", CNNPAR_K8S_SERVICE="workers")
    task = environments.detect().task()
    assert (task.index, task.is_chief, environments.detect().chief()) == (0, True, "my-train-0.workers:8888")


def test_a_one_task_slurm_step_whose_ntasks_agree_is_a_cluster_of_one(environ):
    environ(SLURM_PROCID="0", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NUM_TASKS="1",
            SLURM_NTASKS="1")
    assert environments.detect().tf_config() == {"cluster": {"worker": ["n1:8888"]},
                                                 "task": {"type": "worker", "index": 0}}


@pytest.mark.parametrize("kind, variables, message", [
    (Slurm, {"SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"},
     "SLURM_STEP_NODELIST: expected node names as node[01-04],gpu7. Received: SLURM_STEP_NODELIST=''"),
    (KubernetesIndexedJob, {key: value for key, value in KUBERNETES.items() if key != "CNNPAR_K8S_SERVICE"},
     "CNNPAR_K8S_SERVICE: expected the name of the headless Service that the pod template's subdomain names. "
     "Received: CNNPAR_K8S_SERVICE=''"),
], ids=["slurm without its node list", "a pod without its service"])
def test_a_variable_that_is_not_set_is_refused_as_an_empty_one_naming_it(kind, variables, message):
    with pytest.raises(ValueError) as raised:
        kind(variables).tf_config()
    assert str(raised.value) == message
