"""Every cross-host path, between network namespaces that behave as hosts (``tests/hosts.py``).

MultiWorker over two hosts (on links of two rates), a host whose link goes down mid-epoch, and AsyncPS
with its coordinator on another host than its workers and parameter server.
Every address is one of the namespaces' own (10.231.7.0/24); nothing leaves
the machine. Skipped, with the reason, where namespaces cannot be made.
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from keras_cnnpar.cluster import spec as cluster
from keras_cnnpar.cluster import traffic
from keras_cnnpar.plan import scaling
from keras_cnnpar.results import runs
from keras_cnnpar.strategies import compression
from keras_cnnpar.zoo import models
from keras_cnnpar.zoo.names import MODEL_NAMES
from tests import hosts
from tests.helpers import ENV, cnnpar_command, epoch_column, held, read_rows, release, run_cli, wait_for_epoch_rows

UNAVAILABLE = hosts.unavailable()
pytestmark = [pytest.mark.slow,  # processes in network namespaces
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"hosts as network namespaces: {UNAVAILABLE}")]

MODEL = MODEL_NAMES["3+3"]
EXAMPLES = Path(__file__).parents[1] / "examples"
MULTI_WORKER_CSV = runs.run_file_name(MODEL, "multi-worker", 2)


def train(data, *args):
    return cnnpar_command("train", "--model", "3+3", "--data", data, "--batch-size", "32", "--results", "results",
                          "--verbose", "2", *args)


def start(net, host, command, folder, env=ENV, log="output.log"):
    """Run ``command`` on ``host`` in ``folder``; its output goes to ``folder/log``."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / log).open("w") as file:
        return net.popen(host, command, cwd=folder, env=env, stdout=file, stderr=subprocess.STDOUT)


def output(folder, log="output.log"):
    return (folder / log).read_text()


def worker_env(spec, index):
    return {**ENV, "TF_CONFIG": json.dumps(cluster.Task(spec, "worker", index).tf_config())}


def test_multi_worker_checks_itself_across_two_hosts_and_its_communication_grows_as_the_link_slows(tmp_path,
                                                                                                   small_csv):
    """--checks under MultiWorker on two hosts whose links run at 1 Gbit/s, then at 50 Mbit/s: the chief's traced
    epoch spends more time a step communicating (its communication share times its step) on the slower link, at
    least the ring all-reduce's bytes at that rate (``traffic.ring_all_reduce``: the 3+3's gradient, once each
    way). Only the chief writes.

    Not the share itself: under load the trace left part of the slow link's wait to idle (time that no traced
    op covers), and one run read a communication share of 0.438 at 50 Mbit/s against 0.446 at 1 Gbit/s,
    though its communication a step was 215 ms against 45 ms."""
    if reason := hosts.unshapeable():
        pytest.skip(reason)
    model = models.cnn("3+3", input_shape=(28, 28, 1), num_classes=10)
    wire = {rate: traffic.Link.parse(rate).seconds(traffic.ring_all_reduce(scaling.gradient_bytes(model), 2))
            for rate in ("1gbit", "50mbit")}
    traced = {}
    for rate in wire:
        folder = tmp_path / rate
        with hosts.Hosts(2, rate=rate) as net:
            spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
            started = [start(net, i, train(small_csv, "--strategy", "multi-worker", "--workers", "2", "--epochs", "2",
                                           "--checks"), folder / f"host{i}", worker_env(spec, i)) for i in range(2)]
            codes = [process.wait(timeout=180) for process in started]
        assert codes == [0, 0], output(folder / "host0")[-3000:] + output(folder / "host1")[-3000:]
        first, traced[rate] = read_rows(folder / "host0" / "results" / MULTI_WORKER_CSV)
        assert (first["time_split"], traced[rate]["time_split"], traced[rate]["grad_parity_verdict"]) == (
            "", "trace", "n/a")  # no one-step probe beside a cluster's run
        assert not (folder / "host1" / "results").exists()
    communication = {rate: float(row["communication_share"]) * float(row["step_seconds"])
                     for rate, row in traced.items()}
    assert communication["50mbit"] > communication["1gbit"], communication
    assert communication["50mbit"] >= 0.8 * wire["50mbit"], (communication, wire)


def test_plan_on_two_hosts_ranks_single_and_multi_worker_measured_beside_their_predictions(tmp_path, small_csv):
    """``cnnpar plan`` on each of two hosts joined at 150 Mbit/s (a TF_CONFIG on each): the link as the all-reduces
    saw it is at most the shaped rate; the chief prints single, multi-worker, multi-worker accumulating the
    advised K, multi-worker in bfloat16 and with PowerSGD, local steps exchanging as rarely as K all-reduces (each
    saying what it changes in the training) and async-ps (a worker on each host, its parameter server beside the
    chief's; its servers gone after the plan), fastest first, each beside its prediction (multi-worker's from the
    link alone bounds it, but for the noise of timing the step apart from the run: at most 25% above it, the
    benchmark's tolerance; one CI run, under the suite's load on 2 cores, measured 454 images/s against 431
    predicted); accumulating as the advice says trains faster, and so do local steps; the printed ``plan
    --hosts`` command reproduces the measured multi-worker figure; each host's single figure is printed, the
    chief's first; only the chief writes --out.

    At 150 Mbit/s the 3+3's megabyte a step is most of its step (the plan advised K=10 on an AMD EPYC Zen 4: a
    machine eight times slower would still be advised to accumulate), so the plan always tries accumulating; at
    1 Gbit/s one CI run's slower step left communication under 20% of it, and the plan no accumulating row."""
    if reason := hosts.unshapeable():
        pytest.skip(reason)
    with hosts.Hosts(2, rate="150mbit") as net:
        spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
        line = cnnpar_command("plan", "--model", "3+3", "--data", small_csv, "--out", "planned")
        started = [start(net, i, line, tmp_path / f"host{i}", worker_env(spec, i)) for i in range(2)]
        codes = [process.wait(timeout=300) for process in started]
    printed = output(tmp_path / "host0")
    assert codes == [0, 0], printed[-3000:] + output(tmp_path / "host1")[-3000:]
    rate = float(re.search(r"the link as TensorFlow's all-reduce sees it: ([0-9.]+)mbit", printed)[1])
    assert rate <= 165, printed
    rows = read_rows(tmp_path / "host0" / "planned" / "plan.csv")
    measured = [float(row["images_per_second"]) for row in rows]
    assert measured == sorted(measured, reverse=True)  # ranked by what was measured
    each_host = re.search(r"single on each host: (\d+), (\d+) images/s", printed)
    single = next(float(row["images_per_second"]) for row in rows if row["configuration"] == "single, 1 host")
    assert each_host and float(each_host[1]) == pytest.approx(single, abs=0.5), printed
    assert sorted(re.sub(", [KH]=[0-9]+$", "", row["configuration"]) for row in rows) == [
        "async-ps, 2 workers + ps", "local-steps, 2 hosts", "multi-worker, 2 hosts", "multi-worker, 2 hosts",
        "multi-worker, 2 hosts, bfloat16", "multi-worker, 2 hosts, powersgd r=4", "single, 1 host"]
    advice = {row["configuration"]: row["advice"] for row in rows}  # what each changes in the training
    assert advice["multi-worker, 2 hosts, bfloat16"] == compression.changes("bfloat16")
    assert advice["multi-worker, 2 hosts, powersgd r=4"] == compression.changes("powersgd", 4)
    asynchronous = next(row for row in rows if row["configuration"].startswith("async-ps"))
    assert float(asynchronous["images_per_second"]) > 0 and float(asynchronous["predicted_images_per_second"]) > 0
    synced = next(row for row in rows if row["configuration"] == "multi-worker, 2 hosts")
    assert float(synced["images_per_second"]) <= 1.25 * float(synced["predicted_images_per_second"]), synced
    k = int(re.search(r"accumulate=(\d+) \(one all-reduce per", synced["advice"])[1])
    accumulated = next(row for row in rows if row["configuration"] == f"multi-worker, 2 hosts, K={k}")
    assert float(accumulated["images_per_second"]) > float(synced["images_per_second"])
    # Local steps exchange as rarely as the accumulation all-reduces (the same share of the step; H may go past
    # K's bound of 16, up to 64), and say what they change.
    local = next(row for row in rows if row["configuration"].startswith("local-steps, 2 hosts, H="))
    h = int(local["configuration"].rpartition("=")[2])
    assert h == k or k == scaling.MAX_ACCUMULATE < h <= scaling.MAX_INNER_STEPS
    assert float(local["images_per_second"]) > float(synced["images_per_second"])
    assert local["advice"] == scaling.local_steps_changes(h, 32)
    command = re.search(r"for more hosts: cnnpar (plan .*)", printed)[1].split()
    larger = run_cli(*command)
    assert larger.exit_code == 0, larger.output
    two_hosts = float(next(line.split("|")[1].split()[0] for line in larger.output.splitlines()
                            if line.startswith("    2 |")))
    assert two_hosts == pytest.approx(float(synced["images_per_second"]), rel=0.01)
    assert not (tmp_path / "host1" / "planned").exists()


AUTO_SCRIPT = """
import json
import sys

import numpy as np

import keras_cnnpar as cnnpar  # joins the cluster: CNNPAR_MULTI_WORKER=1 beside TF_CONFIG
import keras

digits = cnnpar.data.load(sys.argv[1])
keras.utils.set_random_seed(0)
model = cnnpar.models.cnn("3+3", input_shape=digits.x.shape[1:], num_classes=digits.num_classes)
history = model.fit(digits.x, digits.y, batch_size=32, epochs=1, strategy="auto", results_dir="results")
np.savez("weights.npz", *model.get_weights())
with open("history.json", "w") as file:
    json.dump({"history": history.history, "strategy": history.strategy.alias}, file)
"""


def test_auto_on_two_hosts_trains_with_what_measured_faster_and_every_host_ends_with_the_same_weights(tmp_path,
                                                                                                      small_csv):
    """``fit(strategy="auto")`` in a script on each of two hosts joined at 1 Gbit/s plans across the hosts and
    trains with what measured faster, single on the chief or multi-worker (on hosts that share two cores,
    either may win): the choice is the faster of the two figures it prints; both hosts end with the same
    History and bit-identical weights; only the chief writes, one run of the chosen strategy."""
    if reason := hosts.unshapeable():
        pytest.skip(reason)
    script = tmp_path / "auto.py"
    script.write_text(AUTO_SCRIPT)
    with hosts.Hosts(2, rate="1gbit") as net:
        spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
        started = [start(net, i, [sys.executable, str(script), small_csv], tmp_path / f"host{i}",
                         {**worker_env(spec, i), cluster.JOIN_AT_IMPORT: "1"}) for i in range(2)]
        codes = [process.wait(timeout=300) for process in started]
    printed = output(tmp_path / "host0")
    assert codes == [0, 0], printed[-3000:] + output(tmp_path / "host1")[-3000:]
    choice = re.search(r"auto: chose (single, 1 host|multi-worker, 2 hosts) \((\d+) images/s\); runner-up "
                       r"(single, 1 host|multi-worker, 2 hosts) \((\d+) images/s\)", printed)
    assert choice and int(choice[2]) >= int(choice[4]), printed[-3000:]
    alias = choice[1].split(",")[0]
    first, second = (json.loads((tmp_path / f"host{i}" / "history.json").read_text()) for i in range(2))
    assert first == second and first["strategy"] == alias and len(first["history"]["loss"]) == 1
    weights = [np.load(tmp_path / f"host{i}" / "weights.npz") for i in range(2)]
    assert len(weights[0].files) == len(weights[1].files) > 0
    assert all(np.array_equal(weights[0][name], weights[1][name]) for name in weights[0].files)
    assert [row["strategy"] for row in runs.read_runs(tmp_path / "host0" / "results" / runs.RUNS_CSV)] == [alias]
    assert not (tmp_path / "host1" / "results").exists()


SINGLE_ON_CHIEF_SCRIPT = """
import json
import sys

import numpy as np

import keras_cnnpar as cnnpar  # joins the cluster: CNNPAR_MULTI_WORKER=1 beside TF_CONFIG
import keras


class FailsOnTheChief(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("the chief's callback failed on purpose")


digits = cnnpar.data.load(sys.argv[1])
keras.utils.set_random_seed(int(sys.argv[2]))  # each host its own initial weights
model = cnnpar.models.cnn("3+3", input_shape=digits.x.shape[1:], num_classes=digits.num_classes)
strategy = cnnpar.strategies.SingleOnChief(cnnpar.MultiWorker(checkpoint_dir=None))
history = model.fit(digits.x, digits.y, batch_size=32, epochs=2, strategy=strategy, results_dir=None, verbose=0,
                    callbacks=[FailsOnTheChief()] if sys.argv[3] == "fails" else None)
np.savez("weights.npz", *model.get_weights())
with open("history.json", "w") as file:
    json.dump(history.history, file)
"""


@pytest.mark.parametrize("outcome", ["trains", "fails"])
def test_single_on_the_chief_hands_its_weights_and_history_or_its_error_to_the_other_host(tmp_path, small_csv,
                                                                                         outcome):
    """``SingleOnChief`` (what ``auto`` runs where one host trains faster than all): the chief trains, the other
    host, which starts from other weights, ends with the chief's History and bit-identical weights; when the
    chief's training fails, the other host raises ``PeerLost`` naming the chief's error."""
    script = tmp_path / "single_on_chief.py"
    script.write_text(SINGLE_ON_CHIEF_SCRIPT)
    with hosts.Hosts(2) as net:
        spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
        started = [start(net, i, [sys.executable, str(script), small_csv, str(i), outcome], tmp_path / f"host{i}",
                         {**worker_env(spec, i), cluster.JOIN_AT_IMPORT: "1"}) for i in range(2)]
        codes = [process.wait(timeout=180) for process in started]
    printed = [output(tmp_path / f"host{i}") for i in range(2)]
    if outcome == "fails":
        assert codes == [1, 1], printed[0][-2000:] + printed[1][-2000:]
        assert "PeerLost: the chief's training failed: RuntimeError: the chief's callback failed on purpose" in \
            printed[1], printed[1][-2000:]
        assert not (tmp_path / "host1" / "weights.npz").exists()
        return
    assert codes == [0, 0], printed[0][-2000:] + printed[1][-2000:]
    first, second = (json.loads((tmp_path / f"host{i}" / "history.json").read_text()) for i in range(2))
    assert first == second and len(first["loss"]) == 2
    weights = [np.load(tmp_path / f"host{i}" / "weights.npz") for i in range(2)]
    assert all(np.array_equal(weights[0][name], weights[1][name]) for name in weights[0].files)


def test_a_users_script_runs_unchanged_on_each_host_with_its_tf_config(tmp_path):
    script = [sys.executable, str(EXAMPLES / "launch_any_script.py"), "--epochs", "1", "--examples", "400"]
    with hosts.Hosts(2) as net:
        spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
        started = [start(net, i, script, tmp_path / f"host{i}", {**worker_env(spec, i), cluster.JOIN_AT_IMPORT: "1"})
                   for i in range(2)]
        codes = [process.wait(timeout=180) for process in started]
    assert codes == [0, 0], output(tmp_path / "host0")[-3000:] + output(tmp_path / "host1")[-3000:]
    assert len(read_rows(tmp_path / "host0" / "results" / runs.run_file_name("launched_cnn", "multi-worker", 2))) == 1
    assert not (tmp_path / "host1" / "results").exists()


def slurm_env(net, index, hosts_count=2):
    """The variables ``srun --ntasks-per-node=1`` sets in task ``index`` (the node names are the hosts' addresses)."""
    nodes = f"{hosts.SUBNET}.[1-{hosts_count}]"
    return {**{key: value for key, value in ENV.items() if key != "TF_CONFIG"},
            "SLURM_PROCID": str(index), "SLURM_NODEID": str(index), "SLURM_LOCALID": "0",
            "SLURM_NTASKS": str(hosts_count), "SLURM_STEP_NUM_TASKS": str(hosts_count),
            "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": f"1(x{hosts_count})", "CUDA_VISIBLE_DEVICES": ""}


def test_a_two_host_run_started_from_slurm_variables_alone_trains_and_only_the_chief_writes(tmp_path):
    script = cnnpar_command("launch", "--", "python", EXAMPLES / "launch_any_script.py", "--epochs", "1",
                            "--examples", "400", "--keras-logs", "logs")
    with hosts.Hosts(2) as net:
        started = [start(net, i, script, tmp_path / f"host{i}", slurm_env(net, i)) for i in range(2)]
        codes = [process.wait(timeout=180) for process in started]
    assert codes == [0, 0], output(tmp_path / "host0")[-3000:] + output(tmp_path / "host1")[-3000:]
    assert f"worker 1: joining the cluster {{'worker': ['{net.address(0)}:8888', '{net.address(1)}:8888']}}" in \
        output(tmp_path / "host1")
    assert len(read_rows(tmp_path / "host0" / "results" / runs.run_file_name("launched_cnn", "multi-worker", 2))) == 1
    assert (tmp_path / "host0" / "logs" / "last.keras").exists()
    assert sorted(p.name for p in (tmp_path / "host1").iterdir()) == ["output.log"]  # no results, no Keras logs


def test_a_host_whose_link_goes_down_fails_the_other_within_the_timeout_and_nothing_is_left(tmp_path, small_csv):
    """Both hosts wait after epoch 1 (``held``); the link goes down there, and their next step needs each other.
    Their time to fail is measured against the collective timeout plus twice the chief's first epoch."""
    command = train(small_csv, "--strategy", "multi-worker", "--workers", "2", "--epochs", "2",
                    "--collective-timeout", "10")
    hold = tmp_path / "hold"
    with hosts.Hosts(2) as net:
        spec = {"worker": [f"{net.address(i)}:2222" for i in range(2)]}
        chief, other = (start(net, i, command, tmp_path / f"host{i}", held(hold, 1, env=worker_env(spec, i)))
                        for i in range(2))
        wait_for_epoch_rows(tmp_path / "host0" / "results" / MULTI_WORKER_CSV, 1, chief)
        net.link_down(1)
        release(hold)
        released = time.monotonic()
        codes = chief.wait(timeout=120), other.wait(timeout=120)
        waited = time.monotonic() - released
        left = net.pids()
    assert codes == (1, 1)
    (epoch,) = read_rows(tmp_path / "host0" / "results" / MULTI_WORKER_CSV)
    assert waited < 10 + 2 * float(epoch["epoch_seconds"]), (waited, epoch["epoch_seconds"])
    chief_output = output(tmp_path / "host0")
    assert "Error: worker 0: training stopped because a peer failed or did not answer within timeout=10.0 s; " \
           "lost: /job:worker/replica:0/task:1." in chief_output
    # The heartbeats (at half the timeout) named the lost host before the collective timed out: when both aborted
    # at once, TensorFlow's abort now and then corrupted a mutex and the chief died of SIGABRT (exit code -6).
    assert "stopped sending heartbeats" in chief_output
    assert "Collective has timed out" not in chief_output
    assert left == []  # both hosts' processes ended on their own


def serve(net, host, spec_path, job, index, folder):
    return start(net, host, cnnpar_command("cluster", "serve", "--cluster", spec_path, "--job", job, "--index", index),
                 folder / f"{job}{index}")


def test_cluster_probe_measures_the_rate_of_a_shaped_link_with_tensorflows_transport(tmp_path):
    """A worker on one host, a parameter server on another, their links at 50 Mbit/s: `cnnpar cluster probe`
    from the first host reads the rate within 25% (TCP's and gRPC's framing take a few percent), and prints it as
    `plan --hosts` options."""
    if reason := hosts.unshapeable():
        pytest.skip(reason)
    with hosts.Hosts(2, rate="50mbit") as net:
        spec = {"worker": [f"{net.address(0)}:2222"], "ps": [f"{net.address(1)}:2222"]}
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({"cluster": spec}))
        servers = [serve(net, index, spec_path, job, 0, tmp_path) for index, job in enumerate(("worker", "ps"))]
        probe = start(net, 0, cnnpar_command("cluster", "probe", "--cluster", spec_path, "--seconds", "0.3"),
                      tmp_path / "probe")
        code = probe.wait(timeout=120)
        for server in servers:
            server.send_signal(signal.SIGTERM)
        stopped = [server.wait(timeout=30) for server in servers]
    printed = output(tmp_path / "probe")
    assert code == 0 and stopped == [0, 0], printed[-3000:]
    (pair,) = re.findall(r"/job:worker/replica:0/task:0 -> /job:ps/replica:0/task:0: ([0-9,]+) Mbit/s", printed)
    assert 0.75 * 50 <= float(pair.replace(",", "")) <= 1.25 * 50, printed
    assert re.search(r"^slowest link: --link \d+mbit --latency [0-9.]+ms$", printed, re.MULTILINE), printed


def test_async_ps_with_its_coordinator_on_another_host_trains_and_its_servers_stop_cleanly(tmp_path, small_csv):
    with hosts.Hosts(2) as net:
        spec = {"worker": [f"{net.address(1)}:2222"], "ps": [f"{net.address(1)}:2223"]}
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({"cluster": spec}))
        worker, ps = (serve(net, 1, spec_path, job, 0, tmp_path) for job in ("worker", "ps"))
        coordinator = start(net, 0, train(small_csv, "--strategy", "async-ps", "--cluster", str(spec_path),
                                          "--epochs", "2"), tmp_path / "coordinator")
        code = coordinator.wait(timeout=180)
        for server in (worker, ps):
            server.send_signal(signal.SIGTERM)
        stopped = [server.wait(timeout=30) for server in (worker, ps)]
    assert code == 0, output(tmp_path / "coordinator")[-3000:]
    assert len(read_rows(tmp_path / "coordinator" / "results" / runs.run_file_name(MODEL, "async-ps", 1))) == 2
    assert stopped == [0, 0]
    for job in ("worker", "ps"):
        assert output(tmp_path / f"{job}0").splitlines()[-2:] == [
            f"cnnpar cluster serve: task {job}:0 ready at {spec[job][0]}; TensorFlow listens on every interface of "
            f"this host at port {spec[job][0].rpartition(':')[2]}, unauthenticated: trusted networks only",
            f"cnnpar cluster serve: task {job}:0 stopped (SIGTERM)"]


def test_async_ps_over_three_hosts_resumes_after_its_parameter_server_is_restarted(tmp_path, small_csv):
    command = train(small_csv, "--strategy", "async-ps", "--epochs", "3")
    with hosts.Hosts(3) as net:
        spec = {"worker": [f"{net.address(1)}:2222", f"{net.address(2)}:2222"], "ps": [f"{net.address(1)}:2223"]}
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({"cluster": spec}))
        for host, index in ((1, 0), (2, 1)):  # the servers end with the namespaces
            serve(net, host, spec_path, "worker", index, tmp_path / f"host{host}")
        ps = serve(net, 1, spec_path, "ps", 0, tmp_path / "b")
        hold = tmp_path / "hold"
        coordinator = start(net, 0, [*command, "--cluster", str(spec_path)], tmp_path / "a", held(hold, 2))
        csv = tmp_path / "a" / "results" / runs.run_file_name(MODEL, "async-ps", 2)
        # The run waits after epoch 2, before its checkpoint; epoch 1's was saved before epoch 2 began.
        wait_for_epoch_rows(csv, 2, coordinator)
        checkpoint = runs.run_file_name(MODEL, "async-ps", None, "")  # elastic: the name holds no worker count
        assert (tmp_path / "a" / "results" / runs.CHECKPOINTS / checkpoint / "checkpoint").exists()
        ps.kill()
        release(hold)
        lost = coordinator.wait(timeout=120)
        ps = serve(net, 1, spec_path, "ps", 0, tmp_path / "b-again")
        resumed = start(net, 0, [*command, "--cluster", str(spec_path), "--resume"], tmp_path / "a", log="resumed.log")
        code = resumed.wait(timeout=180)
    assert lost == 1
    assert re.search(r"Error: lost ps:0 of the cluster \{.*\} in epoch 2: its variables are gone", output(
        tmp_path / "a")), output(tmp_path / "a")[-3000:]
    assert code == 0, output(tmp_path / "a", "resumed.log")[-3000:]
    assert epoch_column(csv) == [1, 2, 3]
    assert re.search(r"resumed from results/checkpoints/\S+ after epoch \d", output(tmp_path / "a", "resumed.log"))
    assert not (tmp_path / "a" / "results" / runs.CHECKPOINTS).exists()  # removed once the run completed
