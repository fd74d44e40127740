"""AsyncPS: ParameterServerStrategy + ClusterCoordinator, on a local cluster and on real server processes.

A coordinator stays connected to its cluster for the rest of its process, so
training runs in `cnnpar train` subprocesses; argument and reachability errors
come before any connection and are checked here. Every test bounds its
processes' time and ends the servers it started.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import keras_cnnpar as cnnpar
from keras_cnnpar import cli
from keras_cnnpar.cluster import network, servers
from keras_cnnpar.cluster import spec as cluster
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies.async_ps import remote as coordinator_module
from tests.helpers import (
    ENV,
    FLOORS,
    alive,
    cnnpar_command,
    cpu_seconds,
    descendants,
    epoch_column,
    held,
    kill_tree,
    processes,
    release,
    reserve_ports,
    run_cli,
    still_alive_after,
    suite_processes,
    wait_for_epoch_rows,
    wait_until,
)
from tests.helpers import read_rows as rows

pytestmark = pytest.mark.slow  # parameter-server clusters of processes: `pytest -m "not slow"` leaves them out

RUN = "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_async-ps_2dev"
CHECKPOINT = "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_async-ps"  # resumes on any number of workers


def train(tmp_path, *args, timeout=400):
    command = cnnpar_command("train", "--verbose", "2", "--results", "results", *args)
    result = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_local_cluster_trains_the_resnet_to_single_s_floor(tmp_path):
    """The resnet: BatchNormalization under asynchronous steps, whose moving averages of stale weights cost up to
    13 points before AsyncPS recomputed them after each epoch (precise BN, docs/async.md). Single's floor
    (Single itself: 0.951 here); the gap to Single seed by seed is benchmarks/async_robustness.py's."""
    result = train(tmp_path, "--model", "resnet", "--strategy", "async-ps", "--workers", "2", "--ps", "1",
                   "--epochs", "3")
    # The local cluster lives in the coordinator process, in a private network namespace where Linux allows one;
    # elsewhere one line names every port it listens on, its coordinator's included.
    warned = re.search(r"warning: the TensorFlow servers of the local cluster and its coordinator listen on every "
                       r"network interface \(ports \d+,\d+,\d+,\d+\) and run any graph sent to them, "
                       r"unauthenticated", result.stderr)
    assert bool(warned) != network.private_network_available(), result.stderr[-2000:]
    (async_ps,) = rows(tmp_path / "results" / "runs.csv")
    # AsyncPS(2)'s resnet ended at 0.957 on average in 21 runs (seeds 0-5; docs/measurements/2026-12-05-avx2-asyncps.md
    # and docs/sweep/), standard deviation 0.003, lowest 0.950: the floor is 12 deviations below, so a false failure
    # is out of reach (normal tails: below 1 in 10^30; even at a spread 3 times that, 1 in 10^8).
    assert float(async_ps["val_accuracy"]) >= FLOORS["resnet"], async_ps
    epochs = rows(tmp_path / "results" / "cnn2d_resnet_3stage_keras_tensorflow_async-ps_2dev.csv")
    assert [int(e["epoch"]) for e in epochs] == [1, 2, 3]
    # The first 64 updates (all 63 of epoch 1) run one group at a time: nothing stale during the warm-up.
    assert float(epochs[0]["staleness_max"]) == 0.0
    for epoch in epochs:
        assert float(epoch["steps_applied"]) == 63.0  # 4,000 images at batch 64, each step applied once
        assert float(epoch["lost_workers"]) == 0.0
        assert float(epoch["precise_bn_batches"]) == 16.0  # precise BN's statistics, from the default 16 batches
    # Two workers update at once after the warm-up: some steps find the other's update landed after they read
    # the weights. Taken over epochs 2 and 3 together (126 steps), not per epoch: the reference sweep's 2-worker
    # runs had a mean staleness of 0.68-0.95 in every such epoch (docs/sweep/), so none was near zero.
    later = epochs[1:]
    assert max(float(epoch["staleness_max"]) for epoch in later) >= 1.0
    assert sum(float(epoch["staleness_mean"]) for epoch in later) > 0.0
    assert all(float(epoch["staleness_mean"]) <= float(epoch["staleness_max"]) for epoch in later)
    log = (tmp_path / "results" / "results.log").read_text()
    assert "layout async-ps: 2 workers, 1 parameter servers (local cluster)" in log
    # Adam: divided by 1 + staleness, not its square (SGD's, staleness_power's doctest).
    assert "first 64 updates one group at a time; each gradient divided by (1 + its staleness); validated and " \
           "returned: the weights' moving average (ema_momentum=0.95); BatchNormalization statistics recomputed " \
           "from 16 batches after each epoch" in log
    assert "learning rate x1 (scale_lr=None)" in log  # the default keeps the rate (docs/async.md)


def test_two_parameter_servers_share_the_variables_and_a_bfloat16_run_exports(tmp_path):
    # bfloat16 where the CPU computes it (emulated, it is 5x slower than float32: docs/precision.md).
    precision = "mixed_bfloat16" if hardware.native_bfloat16() else "float32"
    train(tmp_path, "--strategy", "async-ps", "--workers", "2", "--ps", "2", "--epochs", "1", "--export", "models",
          "--precision", precision)
    log = (tmp_path / "results" / "results.log").read_text()
    assert f"precision={precision}" in log
    (epoch,) = rows(tmp_path / "results" / f"{RUN}.csv")
    # One epoch of 2+2 learns, under bfloat16 too. All 63 updates of epoch 1 are the warm-up's, one group at a
    # time: Single's steps, 0.930 in docs/sweep/ (float32); 13 points above, only rounding varies between runs.
    assert float(epoch["val_accuracy"]) >= 0.8
    held = dict(re.findall(r"layout (ps:\d) holds (\d+) model variables", log))
    assert sorted(held) == ["ps:0", "ps:1"] and sum(map(int, held.values())) == 8, log
    assert (tmp_path / "models" / "1" / "saved_model.pb").exists()


def test_a_worker_process_killed_mid_run_leaves_training_to_the_others(tmp_path):
    spec = tmp_path / "cluster.json"
    started = subprocess.run(cnnpar_command("cluster", "start", "--workers", "2", "--ps", "1", "--spec", str(spec)),
                             env=ENV, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    assert "warning: the TensorFlow servers of the cluster listen on every network interface" in started.stderr
    config = json.loads(spec.read_text())
    pids = config["pids"]
    try:
        command = cnnpar_command("train", "--strategy", "async-ps", "--cluster", str(spec), "--epochs", "2",
                                 "--verbose", "2", "--results", "results")
        hold = tmp_path / "hold"
        with processes([command], tmp_path, [held(hold, 1)]) as (coordinator,):
            wait_for_epoch_rows(tmp_path / "results" / f"{RUN}.csv", 1, coordinator)  # the run waits after it
            os.kill(pids["worker"][1], signal.SIGKILL)
            release(hold)  # epoch 2 starts with worker 1 gone
            output = coordinator.communicate(timeout=300)[0]
        assert coordinator.returncode == 0, output[-3000:]
        epochs = rows(tmp_path / "results" / f"{RUN}.csv")
        assert epoch_column(tmp_path / "results" / f"{RUN}.csv") == [1, 2]  # epoch 2 on the worker left
        assert [float(e["lost_workers"]) for e in epochs] == [0.0, 1.0]
        # AsyncPS(2)'s 2+2 read 0.956 after epoch 2 (docs/sweep/; Single 0.964), its final accuracy varying by 0.3
        # points (standard deviation, 20 runs, docs/measurements/2026-12-05-avx2-asyncps.md): 0.9 is 5.6 points
        # below, 6 deviations even at three times that spread (below 1 in 10^8); one worker left is less stale.
        assert float(epochs[-1]["val_accuracy"]) >= 0.9
        assert "event epoch 2: 1 worker(s) lost; their steps ran again on the others" in \
            (tmp_path / "results" / "results.log").read_text()
    finally:
        stopped = subprocess.run(cnnpar_command("cluster", "stop", "--spec", str(spec)), env=ENV,
                                 capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped 2 server processes" in stopped.stdout  # the killed worker was already gone
    assert not spec.exists()
    assert not any(servers._is_server(pid, config) for job in pids.values() for pid in job)


def test_a_worker_killed_in_the_middle_of_its_steps_leaves_no_step_applied_twice(tmp_path):
    """``ClusterCoordinator`` runs a lost worker's group of steps again on another worker. Worker 1 is killed
    while it runs a group of epoch 2 (once it has used 1.5 times the CPU it used in epoch 1: each group is 16
    steps, and a worker is busy only inside one); the group's second run starts after its steps marked landed,
    each marked before its update begins, so epoch 2 applies at most one update a step: all of them, or all
    but the one in flight. With the mark after the update, 3 of 6 runs applied 126 updates for 125 steps."""
    spec = tmp_path / "cluster.json"
    started = subprocess.run(cnnpar_command("cluster", "start", "--workers", "2", "--ps", "1", "--spec", str(spec)),
                             env=ENV, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    worker = json.loads(spec.read_text())["pids"]["worker"][1]
    try:
        command = cnnpar_command("train", "--strategy", "async-ps", "--cluster", str(spec), "--epochs", "2",
                                 "--batch-size", "32", "--option", "steps_per_execution=16", "--option",
                                 "warmup_steps=0", "--verbose", "2", "--results", "results")
        hold, csv_path = tmp_path / "hold", tmp_path / "results" / f"{RUN}.csv"
        with processes([command], tmp_path, [held(hold, 1)]) as (coordinator,):
            begun = cpu_seconds(worker)
            wait_for_epoch_rows(csv_path, 1, coordinator)  # the run waits after epoch 1
            first_epoch = cpu_seconds(worker) - begun
            release(hold)
            wait_until(lambda: cpu_seconds(worker) - begun >= 1.5 * first_epoch, "worker 1 half-way through "
                       "epoch 2", process=coordinator)
            os.kill(worker, signal.SIGKILL)
            output = coordinator.communicate(timeout=300)[0]
        assert coordinator.returncode == 0, output[-3000:]
        epochs = rows(csv_path)
        assert [float(e["lost_workers"]) for e in epochs] == [0.0, 1.0]
        steps = math.ceil(4000 / 32)  # mnist-5k's 4,000 training digits
        assert float(epochs[0]["steps_applied"]) == steps
        assert steps - 1 <= float(epochs[1]["steps_applied"]) <= steps, epochs[1]
    finally:
        subprocess.run(cnnpar_command("cluster", "stop", "--spec", str(spec)), env=ENV, capture_output=True,
                       text=True, timeout=60)


def test_a_lost_parameter_server_stops_the_run_and_resume_completes_it(tmp_path, small_csv):
    spec, results = tmp_path / "cluster.json", tmp_path / "results"
    command = cnnpar_command("train", "--strategy", "async-ps", "--cluster", str(spec), "--epochs", "3",
                             "--data", str(small_csv), "--batch-size", "32", "--verbose", "2", "--results", "results")
    start = cnnpar_command("cluster", "start", "--spec", str(spec))
    stop = cnnpar_command("cluster", "stop", "--spec", str(spec))
    hold = tmp_path / "hold"
    try:
        subprocess.run(start, env=ENV, check=True, capture_output=True, timeout=120)
        with processes([command], tmp_path, [held(hold, 2)]) as (coordinator,):
            # The run waits after epoch 2, before its checkpoint; epoch 1's was saved before epoch 2 began.
            wait_for_epoch_rows(results / f"{RUN}.csv", 2, coordinator)
            assert (results / "checkpoints" / CHECKPOINT / "checkpoint").exists()
            os.kill(json.loads(spec.read_text())["pids"]["ps"][0], signal.SIGKILL)
            release(hold)
            output = coordinator.communicate(timeout=120)[0]
        assert coordinator.returncode == 1, output[-3000:]
        checkpoint = f"results/checkpoints/{CHECKPOINT}"
        lost = re.search(r"Error: lost ps:0 of the cluster \{.*\} in epoch 2: its variables are gone; the "
                         rf"checkpoint after epoch (1) is in {checkpoint}; restart the servers and rerun with "
                         r"resume=True \(cnnpar train --resume\)", output)
        assert lost, output[-3000:]
        saved = int(lost.group(1))
        subprocess.run(stop, env=ENV, check=True, capture_output=True, timeout=60)
        # The servers come back with a third worker: an elastic resume, the global batch kept.
        subprocess.run([*start, "--workers", "3"], env=ENV, check=True, capture_output=True, timeout=120)
        resumed = subprocess.run([*command, "--resume"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                                 timeout=400)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        subprocess.run(stop, env=ENV, capture_output=True, timeout=60)
    assert epoch_column(results / f"{RUN.replace('_2dev', '_3dev')}.csv") == list(range(saved + 1, 4))
    log = (results / "results.log").read_text()
    assert f"layout resumed from {checkpoint} after epoch {saved}; changed since: devices 2 (checkpoint) vs 3 (this " \
           f"run); each of the 3 workers still takes whole global batches of 32" in log
    (resumed_row,) = [row for row in rows(results / "runs.csv") if row["devices"] == "3"]
    assert (resumed_row["global_batch"], resumed_row["epochs"]) == ("32", "3")
    assert not (results / "checkpoints").exists()


def test_cluster_commands_refuse_to_overwrite_or_guess_a_spec(tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text("{}")
    result = subprocess.run(cnnpar_command("cluster", "start", "--spec", str(spec)), env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert f"{spec} exists: stop its servers first" in " ".join(result.stderr.split())
    assert spec.read_text() == "{}"
    result = subprocess.run(cnnpar_command("cluster", "stop", "--spec", str(tmp_path / "none.json")), env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "none.json does not exist." in result.stderr


def test_an_unreachable_cluster_fails_once_its_timeout_has_passed():
    spec = cluster.local_spec(workers=1, ps=1, ports=reserve_ports(2))  # no server listens on them
    started = time.monotonic()
    with pytest.raises(ConnectionError) as raised:
        cnnpar.AsyncPS(cluster=spec, timeout=2)
    assert time.monotonic() - started >= 2  # it kept trying for its timeout; the message names it
    assert str(raised.value) == (f"cannot reach worker:0, ps:0 of the cluster {spec} within 2 s; start the servers "
                                 f"(cnnpar cluster start) or check the spec")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"workers": 0}, ValueError, "workers must be a positive int. Received: workers=0"),
    ({"ps": "1"}, ValueError, "ps must be a positive int. Received: ps='1'"),
    ({"timeout": -1}, ValueError, "timeout must be a positive number of seconds. Received: timeout=-1"),
    ({"scale_lr": "cubic"}, ValueError, "scale_lr must be 'linear', 'sqrt' or None. Received: scale_lr='cubic'"),
    ({"cluster": 42}, TypeError, "cluster must be a dict, a tf.train.ClusterSpec or the path of a JSON file. "
                                 "Received: cluster of type int"),
    ({"cluster": {"worker": ["localhost:1"]}}, ValueError,
     "cluster: expected the jobs ['worker', 'ps']. Received: jobs=['worker']"),
    ({"cluster": "missing.json"}, ValueError,
     "cannot read cluster file missing.json: No such file or directory. Received: cluster='missing.json'"),
    ({"coordinator": "10.0.0.1"}, ValueError, "coordinator: task chief:0 needs a 'host:port' address with a host "
                                              "and a port in 1..65535. Received: chief[0]='10.0.0.1'"),
    ({"coordinator": 7000}, TypeError, "coordinator must be a 'host:port' string. Received: coordinator=7000"),
    ({"precise_bn": -1}, ValueError, "precise_bn must be an int of at least 0. Received: precise_bn=-1"),
    ({"batch_slices": 0}, ValueError, "batch_slices must be a positive int. Received: batch_slices=0"),
    ({"ema_momentum": 1.0}, ValueError, "ema_momentum must be a number in [0, 1) or None. Received: ema_momentum=1.0"),
])
def test_async_ps_validates_its_arguments_before_connecting(monkeypatch, tmp_path, kwargs, error, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        cnnpar.AsyncPS(**kwargs)
    assert str(raised.value) == message


def test_a_malformed_spec_file_names_the_line(tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text('{"cluster": {"worker": ["localhost:1"],\n "ps": [localhost:2]}}')
    with pytest.raises(ValueError) as raised:
        cnnpar.AsyncPS(cluster=str(spec))
    assert str(raised.value).startswith(f"{spec}: expected JSON, line 2 column 9: Expecting value. Received: ")


@pytest.mark.parametrize("content", ["[]", '"str"', "3"])
@pytest.mark.parametrize("command", ["probe", "serve"])
def test_cluster_commands_refuse_a_spec_file_that_is_not_a_json_object_in_one_line(tmp_path, content, command):
    spec = tmp_path / "list.json"
    spec.write_text(content)
    extra = ["--job", "ps", "--index", "0"] if command == "serve" else []
    result = run_cli("cluster", command, "--cluster", spec, *extra)
    assert f"{spec}: expected a JSON object, a TF_CONFIG-style one or a map of job name to addresses. Received: " \
           f"{content}" in " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_cluster_stop_refuses_a_spec_whose_pids_are_another_clusters_servers(tmp_path):
    mine, theirs = tmp_path / "mine.json", tmp_path / "theirs.json"
    started = subprocess.run(cnnpar_command("cluster", "start", "--workers", "1", "--spec", str(theirs)), env=ENV,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    config = json.loads(theirs.read_text())
    try:
        mine.write_text(json.dumps({**config, "token": "0" * 32}))  # their pids, another cluster's token
        refused = subprocess.run(cnnpar_command("cluster", "stop", "--spec", str(mine)), env=ENV,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2
        first = config["pids"]["worker"][0]
        assert f"process {first} is not a server this spec started (another command line or start time); " \
               f"refusing to signal anything" in " ".join(refused.stderr.split())
        assert all(servers._is_server(pid, config) for job in config["pids"].values() for pid in job)
        assert mine.exists()
    finally:
        stopped = subprocess.run(cnnpar_command("cluster", "stop", "--spec", str(theirs)), env=ENV,
                                 capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0 and "stopped 2 server processes" in stopped.stdout


def test_cluster_start_with_an_unwritable_spec_starts_no_server(tmp_path):
    spec = tmp_path / "missing-folder" / "cluster.json"
    before = set(suite_processes())
    result = subprocess.run(cnnpar_command("cluster", "start", "--spec", str(spec)), env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot write the spec {spec}: No such file or directory; no server was started." in \
        " ".join(result.stderr.split())
    assert set(suite_processes()) <= before and not spec.exists()


@pytest.mark.parametrize("task, message", [
    (("worker", "0"), "task worker:0 has the address 10.231.7.99:2222, whose host is not an address of this machine "
                      "(Cannot assign requested address); start it on the host the spec names. "
                      "Received: worker:0='10.231.7.99:2222'"),
    (("ps", "3"), "the cluster has no task ps:3. Received: jobs {'worker': 1, 'ps': 1}"),
])
def test_cluster_serve_refuses_a_task_that_is_not_on_this_host(tmp_path, task, message):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cluster": {"worker": ["10.231.7.99:2222"], "ps": ["localhost:2223"]}}))
    job, index = task
    result = CliRunner().invoke(cli.main, ["cluster", "serve", "--cluster", str(spec), "--job", job, "--index", index])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


#: A user's script whose process keeps the coordinator's standard input open after it is killed: after epoch 1 a
#: forked child takes a copy of every descriptor (and waits for signals), then the run waits there (``held``).
PIPE_KEEPING_SCRIPT = """
import os, signal, sys
import keras, keras_cnnpar as cnnpar

class ForkAPipeKeeper(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        keeper = os.fork()
        while keeper == 0:
            signal.pause()
        with open(sys.argv[1], "w") as file:
            file.write(str(keeper))

model = cnnpar.models.cnn("2+2")  # built first: the run goes to a coordinator process
digits = cnnpar.data.load()
model.fit(digits.x[:640], digits.y[:640], batch_size=64, epochs=2, strategy="async-ps", results_dir="results",
          verbose=0, callbacks=[ForkAPipeKeeper()])
"""


def test_a_killed_user_process_leaves_no_coordinator_process_behind(tmp_path):
    """The coordinator waits for the user's answer after epoch 1, its standard input kept open by the user's
    forked child: no end of input ever tells it, only its watch of its parent can end it."""
    def coordinators(pid):
        module = coordinator_module.__name__.encode()
        return [child for child in descendants(pid)
                if module in Path(f"/proc/{child}/cmdline").read_bytes()] if alive(pid) else []

    temporary, keeper_pid = tmp_path / "tmp", tmp_path / "keeper.pid"
    temporary.mkdir()
    env = held(tmp_path / "hold", 1, env={**ENV, "TMPDIR": str(temporary)})
    with processes([[sys.executable, "-c", PIPE_KEEPING_SCRIPT, str(keeper_pid)]], tmp_path, [env]) as (user,):
        keeper = int(wait_until(lambda: keeper_pid.exists() and keeper_pid.read_text(), "epoch 1 to end", 300, user))
        try:
            children = [pid for pid in descendants(user.pid) if pid != keeper]
            assert coordinators(user.pid)
            os.kill(user.pid, signal.SIGKILL)
            user.wait(timeout=30)
            wait_until(lambda: not any(alive(pid) for pid in children),
                       "the coordinator to end after the process that started it")
        finally:
            kill_tree(keeper)
    assert list(temporary.glob("cnnpar-async-*")) == []  # and it removed its folder of batches


def test_cluster_start_killed_while_starting_leaves_no_server_and_stop_cleans_up(tmp_path):
    spec = tmp_path / "cluster.json"
    with processes([cnnpar_command("cluster", "start", "--workers", "1", "--ps", "1", "--spec", str(spec))],
                   tmp_path, [ENV]) as (starter,):
        # The servers are recorded before they are waited for: stopped then, the starter can never tell them they
        # are ready (TensorFlow takes a second or more to start in them, the wait here polls every 0.01 s).
        wait_until(lambda: spec.exists() and spec.stat().st_size, f"the spec {spec}", 60, starter, poll=0.01)
        os.kill(starter.pid, signal.SIGSTOP)
        config = json.loads(spec.read_text())
        pids = [pid for job in config["pids"].values() for pid in job]
        os.kill(starter.pid, signal.SIGKILL)
        left = still_alive_after(pids)
    assert left == [], f"servers {left} outlived the start that was killed"
    result = CliRunner().invoke(cli.main, ["cluster", "stop", "--spec", str(spec)])
    assert result.exit_code == 0, result.output
    assert "stopped 0 server processes" in result.output and not spec.exists()
