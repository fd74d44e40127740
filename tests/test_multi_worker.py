"""MultiWorker across 2 real processes on loopback: parity, sharding, chief-only files, preemption, dead peers.

Every test bounds its processes' time and kills whatever it started.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from click.testing import CliRunner

import keras_cnnpar as cnnpar
from keras_cnnpar import cli
from keras_cnnpar.cluster import local_workers, network
from keras_cnnpar.results import checkpoints
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies import local_steps
from tests.helpers import (
    ENV,
    FLOORS,
    assert_same_step,
    build_resnet_float64,
    build_small_cnn,
    cnnpar_command,
    descendants,
    epoch_column,
    held,
    listening_sockets,
    loads_tensorflow,
    max_difference,
    processes,
    read_rows,
    release,
    reserve_ports,
    still_alive_after,
    wait_for_epoch_rows,
    worker_envs,
    worker_pid,
)

pytestmark = pytest.mark.slow  # worker processes: `pytest -m "not slow"` leaves them out

JOB = Path(__file__).with_name("multi_worker_job.py")
RUN = "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_multi-worker_2dev"
CHECKPOINT = "cnn2d_2layer_fullconnected_2layer_keras_tensorflow_multi-worker"  # any number of workers
RUN_3_PLUS_3 = "cnn2d_3layer_fullconnected_3layer_keras_tensorflow_multi-worker_2dev"
#: The exit code of a preempted worker, as docs/multi_worker.md documents it.
PREEMPTED = 42


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The outputs of one pair of worker processes that ran every mode of ``tests/multi_worker_job.py`` in turn:
    ``job(mode)`` is the prefix of that mode's files."""
    folder = tmp_path_factory.mktemp("job")
    modes = "step,accumulate,residual,shards,packed,local-step,local-steps"
    with processes([[sys.executable, str(JOB), modes, str(folder / "out")]] * 2, folder,
                   worker_envs()) as started:
        outputs = [p.communicate(timeout=300)[0] for p in started]
    assert [p.returncode for p in started] == [0, 0], outputs
    return lambda mode: folder / f"out-{mode}"


def cnnpar_train(*args):
    return cnnpar_command("train", "--strategy", "multi-worker", "--verbose", "2", *args)


@pytest.mark.parametrize("mode, builder, reference_strategy, tolerance", [
    ("step", build_small_cnn, cnnpar.DataParallel(2), 1e-5),
    ("accumulate", build_small_cnn, cnnpar.DataParallel(2), 1e-5),  # 2 micro-batches of 32, one update
    # the resnet in float64, BatchNormalization over both workers' halves: Single's step
    ("residual", build_resnet_float64, "single", 1e-5),
])
def test_one_sgd_step_matches_one_device(job, digits, mode, builder, reference_strategy, tolerance):
    out = job(mode)
    reference = builder(seed=1)
    cnnpar.fit(reference, digits.x[::78][:64], digits.y[::78][:64], strategy=reference_strategy,
               batch_size=64, epochs=1, shuffle=False, verbose=0, results_dir=None)
    chief, other = ([arrays[f"arr_{i}"] for i in range(len(arrays.files))]
                    for arrays in (np.load(f"{out}.{i}.npz") for i in (0, 1)))
    assert_same_step(reference, chief, tolerance, before=builder(seed=1))  # the moving statistics included
    assert max_difference(chief, other) == 0.0


def worker_weights(out):
    """The weights each worker of a job's mode saved, chief first."""
    return [[arrays[f"arr_{i}"] for i in range(len(arrays.files))]
            for arrays in (np.load(f"{out}.{i}.npz") for i in (0, 1))]


def test_the_all_reduce_in_packs_is_multi_workers_sgd_step(job):
    """pack_bytes: the same sums, sent in packs, the last layers' first (their order turned back on arrival)."""
    (chief, other), (plain, _) = worker_weights(job("packed")), worker_weights(job("step"))
    assert_same_step(plain, chief, 1e-6, before=build_small_cnn(seed=1))
    assert max_difference(chief, other) == 0.0


def test_local_steps_with_one_inner_step_and_averaging_is_multi_workers_sgd_step(job):
    (chief, other), (plain, _) = worker_weights(job("local-step")), worker_weights(job("step"))
    assert_same_step(plain, chief, 1e-6, before=build_small_cnn(seed=1))
    assert max_difference(chief, other) == 0.0


def test_local_steps_are_each_workers_own_sgd_steps_and_the_exchange_is_a_nesterov_step(job, digits):
    """4 batches of 16 on 2 workers with inner_steps=3: each worker steps on its 8 of each batch; after 3 steps and
    at the epoch's end, the mean change steps the anchor by SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    x, y = digits.x[::78][:64], digits.y[::78][:64]
    workers = [build_small_cnn(seed=1) for _ in range(2)]
    anchor = workers[0].get_weights()
    momentum = [np.zeros_like(w) for w in anchor]
    for steps in ([0, 1, 2], [3]):
        for index, worker in enumerate(workers):
            worker.set_weights(anchor)
            for step in steps:
                part = slice(16 * step + 8 * index, 16 * step + 8 * index + 8)
                worker.train_on_batch(x[part], y[part])
        change = [np.mean([a - w for w in weights], axis=0)
                  for a, *weights in zip(anchor, *(worker.get_weights() for worker in workers))]
        momentum = [0.9 * m + c for m, c in zip(momentum, change)]
        anchor = [a - 0.7 * (c + 0.9 * m) for a, c, m in zip(anchor, change, momentum)]
    chief, other = worker_weights(job("local-steps"))
    assert_same_step(anchor, chief, 1e-5, before=build_small_cnn(seed=1))
    assert max_difference(chief, other) == 0.0


def test_each_worker_gets_a_different_slice_of_every_batch(job):
    out = job("shards")
    seen = [json.loads(Path(f"{out}.{i}.json").read_text()) for i in (0, 1)]
    for epoch in range(2):
        first, second = seen[0][epoch], seen[1][epoch]
        assert len(first) == len(second) == 24
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(48))
    assert seen[0][0] != seen[0][1]  # reshuffled every epoch, alike on both workers


def test_local_workers_train_to_the_floor_and_only_the_chief_writes(tmp_path):
    """In the precision this CPU computes fastest (``--precision auto``: bfloat16 where it is native); the 3+3's
    gradients are a fifth of the 2+2's, which MultiWorker's step time follows on one host. One-step parity with
    DataParallel, in float32, is ``test_one_sgd_step_matches_one_device``'s."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    command = cnnpar_train("--model", "3+3", "--workers", "2", "--epochs", "3", "--results", "results",
                           "--precision", "auto")
    result = subprocess.run(command, cwd=tmp_path, env={**ENV, "TMPDIR": str(temp)}, capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "results")) == \
        [f"{RUN_3_PLUS_3}.csv", f"{RUN_3_PLUS_3}.weights.h5", "results.log", "runs", "runs.csv"]
    assert epoch_column(tmp_path / "results" / f"{RUN_3_PLUS_3}.csv") == [1, 2, 3]
    (run,) = read_rows(tmp_path / "results" / "runs.csv")  # one row: worker 1 wrote none
    # MultiWorker's steps are Single's (test_one_sgd_step_matches_one_device), seeded: the 3+3 under Single read
    # 0.954 (docs/sweep/, float32), 3.4 points above the floor. Even the spread between seeds (0.946-0.970, standard
    # deviation 1.0 point, docs/measurements/2026-12-05-avx2-asyncps.md) puts the floor 4 deviations below the
    # seeds' mean (1 in 30,000); between runs of one seed only rounding (bfloat16, the all-reduce's order) varies.
    assert float(run["val_accuracy"]) >= FLOORS["3+3"], run
    assert run["devices"] == "2"
    text = (tmp_path / "results" / "results.log").read_text()
    assert f"precision={hardware.auto_precision()}" in text
    log = text.splitlines()
    assert [line.split()[1] for line in log].count("start") == 1
    assert [line.split()[1] for line in log].count("end") == 1
    assert sorted(p.name for p in temp.iterdir() if p.name.startswith("cnnpar-workers-")) == []


def test_local_steps_workers_train_to_the_floor_exchanging_twice_an_epoch_and_only_the_chief_writes(tmp_path):
    """The 3+3 under local-steps (63 steps an epoch, inner_steps=32: an exchange after step 32 and one at the end):
    its 3 seeds read 0.951-0.968 at 3 epochs (docs/slow_links.md), 3 points and more above the floor."""
    result = subprocess.run(cnnpar_command("train", "--strategy", "local-steps", "--workers", "2", "--model", "3+3",
                                           "--epochs", "3", "--results", "results", "--verbose", "2"),
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    run_csv = tmp_path / "results" / RUN_3_PLUS_3.replace("multi-worker", "local-steps")
    assert sorted(os.listdir(tmp_path / "results")) == \
        [f"{run_csv.name}.csv", f"{run_csv.name}.weights.h5", "results.log", "runs", "runs.csv"]
    assert [row["exchanges"] for row in read_rows(f"{run_csv}.csv")] == ["2.0", "2.0", "2.0"]
    (run,) = read_rows(tmp_path / "results" / "runs.csv")
    assert float(run["val_accuracy"]) >= FLOORS["3+3"], run
    assert "the workers exchange their weight changes every 32 steps (float32); outer nesterov, lr 0.7, " \
           "momentum 0.5" in result.stdout
    # The log says what local steps change in the training, with their measured cost: each worker's 32 of 64.
    assert local_steps.changes(32, 32) in (tmp_path / "results" / "results.log").read_text()


@pytest.mark.parametrize("target, strategy, options, state", [
    ("launcher", "multi-worker", [], []),
    # The 2+2's 4 kernels compressed: Q and the error feedback (summed over the workers, tests/test_compression.py)
    ("worker 1", "multi-worker", ["--option", "compression=powersgd"],
     ["powersgd/errors"] * 4 + ["powersgd/factors"] * 4),
    # Its 8 variables' weights at the last exchange and outer momentum (tests/test_local_steps.py restores them);
    # one step a call into TensorFlow (gcd(8, 3); with the default H, 8, an epoch's 5 steps are one call), so a
    # save after any step could fall between two exchanges; it comes right after one (the workers meet there).
    ("worker 1", "local-steps", ["--option", "inner_steps=3"], ["outer/anchors"] * 8 + ["outer/momenta"] * 8),
], ids=["launcher", "worker 1", "worker 1 local-steps"])
def test_a_preemption_checkpoints_every_worker_and_resume_completes_the_remaining_epochs(tmp_path, small_csv, target,
                                                                                       strategy, options, state):
    """Preempted on 2 workers; the launcher variant resumes on 1 worker, the others on 3 (elastic resumes).
    The launcher gets SIGHUP (a closed terminal), which it passes on as SIGTERM, as it does SIGTERM and
    SIGINT (one handler for the three); worker 1 gets SIGTERM itself. The workers wait after epoch 1
    (``held``) until the signal reaches them, so 3 epochs are still to come when it does, on any machine.
    The checkpoint holds the ``state`` of PowerSGD and of local steps' outer optimizer beside the optimizer's."""
    results, run, saved_run = tmp_path / "results", RUN.replace("multi-worker", strategy), \
        CHECKPOINT.replace("multi-worker", strategy)
    # The launcher variant keeps its checkpoints where they go by default; the others name a folder.
    folder = results / "checkpoints" if target == "launcher" else tmp_path / "elsewhere"
    another_run = folder / "workertemp_1" / "another_run"  # where TensorFlow would put a worker's temporary copy
    another_run.mkdir(parents=True)
    command = cnnpar_command("train", "--strategy", strategy, "--verbose", "2", "--workers", "2", "--epochs", "4",
                             "--data", str(small_csv), "--results", "results", *options,
                             *([] if target == "launcher" else ["--checkpoint-dir", str(folder)]))
    hold = tmp_path / "hold"
    with processes([command], tmp_path, [held(hold, 1)]) as (launcher,):
        wait_for_epoch_rows(results / f"{run}.csv", 1, launcher)  # epoch 1 is done; the workers wait after it
        # Only the workers import TensorFlow: the launcher and its supervisor wait on them (it cost 5 CPU-s a run).
        worker_pids = {worker_pid(launcher, 0), worker_pid(launcher, 1)}
        assert {pid for pid in [launcher.pid, *descendants(launcher.pid)] if loads_tensorflow(pid)} == worker_pids
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGHUP)  # each worker's SIGTERM ends its wait
        else:
            os.kill(worker_pid(launcher, 1), signal.SIGTERM)  # pending in worker 1 before worker 0 goes on
            release(hold)
        output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == PREEMPTED, output[-3000:]
    assert re.search(r"Error: worker [01] was preempted: it saved a checkpoint and stopped; rerun with --resume "
                     r"to continue", output)
    checkpoint = folder / saved_run
    assert (checkpoint / "preemption" / "checkpoint").exists() and (checkpoint / "run.json").exists()
    assert sorted(os.listdir(checkpoint)) == ["preemption", "run.json"]  # worker 1's temporary copy is gone
    saved = tf.train.load_checkpoint(str(checkpoint / "preemption"))
    kept = sorted(name for name in saved.get_variable_to_shape_map() if re.search("/(powersgd|outer)/", name))
    assert [re.search(r"(\w+/\w+)/\d+/\.ATTRIBUTES", name)[1] for name in kept] == state
    assert all(np.abs(saved.get_tensor(name)).max() > 0 for name in kept)  # trained state, not fresh zeros
    if strategy == "local-steps":  # saved right after an exchange: its weights hold every worker's steps
        for index in range(8):  # the model's weights, tracked by its optimizer, are the exchange's result
            weight, anchor = (saved.get_tensor(f"optimizer/{name}/{index}/.ATTRIBUTES/VARIABLE_VALUE")
                              for name in ("_trainable_variables", "outer/anchors"))
            assert np.array_equal(weight, anchor)
    assert another_run.is_dir()  # and no other run's folder went with it
    another_run.parent.rename(tmp_path / "kept")
    done = epoch_column(results / f"{run}.csv")
    assert done == [1]  # preempted in epoch 2: the run waited after epoch 1 until the signal came

    workers = "1" if target == "launcher" else "3"
    resume = [*command[:command.index("--workers") + 1], workers, *command[command.index("--workers") + 2:]]
    result = subprocess.run([*resume, "--resume"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = f"results/checkpoints/{saved_run}" if target == "launcher" else str(checkpoint)
    # The resumed run has an epoch CSV of its own configuration's, from the epoch after the checkpoint's.
    assert epoch_column(results / f"{run.replace('_2dev', f'_{workers}dev')}.csv") == list(range(done[-1] + 1, 5))
    assert f"layout resumed from {shown} after epoch {done[-1]}; changed since: devices 2 (checkpoint) vs " \
           f"{workers} (this run); the global batch 64 is divided among the {workers} replicas now" in \
           (results / "results.log").read_text()
    (resumed,) = [row for row in read_rows(results / "runs.csv") if row["devices"] == workers]
    assert (resumed["global_batch"], resumed["epochs"]) == ("64", "4") and float(resumed["val_accuracy"]) > 0.5
    assert not folder.exists() and not (results / "checkpoints").exists()


def test_an_existing_checkpoint_needs_resume(tmp_path):
    model = build_small_cnn()
    model.optimizer.build(model.trainable_variables)
    folder = tmp_path / "checkpoints" / RUN
    checkpoints.RunCheckpoint(model, folder, resume=False).save(completed_epochs=1)
    with pytest.raises(ValueError) as raised:
        checkpoints.RunCheckpoint(model, folder, resume=False)
    assert str(raised.value) == (
        f"{folder} holds the checkpoint of an interrupted run; pass resume=True (cnnpar train --resume) to continue "
        f"it, or delete the folder to start over. Received: resume=False")
    assert checkpoints.RunCheckpoint(model, folder, resume=True).restore() == 1


def saved_checkpoint(folder):
    """The small CNN, ``folder`` and the configuration of the checkpoint after epoch 1 saved there."""
    model = build_small_cnn()
    model.optimizer.build(model.trainable_variables)
    config = {"model": "small_cnn", "strategy": "multi-worker", "devices": 2, "global_batch": 64, "data": "d1"}
    checkpoints.RunCheckpoint(model, folder, resume=False, config=config).save(completed_epochs=1)
    return model, folder, config


def test_resuming_with_another_configuration_refuses_and_names_each_difference(tmp_path):
    model, folder, config = saved_checkpoint(tmp_path / "checkpoints" / RUN)
    assert json.loads((folder / "run.json").read_text()) == config
    with pytest.raises(ValueError) as raised:
        checkpoints.RunCheckpoint(model, folder, resume=True, config={**config, "global_batch": 32, "data": "d2"})
    assert str(raised.value) == (
        f"{folder} holds the checkpoint of another configuration: global_batch 64 (checkpoint) vs 32 (this run); "
        f"data 'd1' (checkpoint) vs 'd2' (this run). Resume with the checkpoint's settings, or delete the folder to "
        f"start over. Received: resume=True")
    assert checkpoints.RunCheckpoint(model, folder, resume=True, config=config).restore() == 1


def test_an_elastic_resume_accepts_another_worker_count_says_so_and_still_refuses_other_data(tmp_path):
    model, folder, config = saved_checkpoint(tmp_path / "checkpoints" / CHECKPOINT)
    elastic = checkpoints.RunCheckpoint(model, folder, resume=True, config={**config, "devices": 3},
                                        may_change=("devices",))
    assert elastic.changes == ["devices 2 (checkpoint) vs 3 (this run)"] and elastic.restore() == 1
    with pytest.raises(ValueError, match=r"holds the checkpoint of another configuration: data 'd1' \(checkpoint\) "
                                         r"vs 'd2' \(this run\)\. "):
        checkpoints.RunCheckpoint(model, folder, resume=True, config={**config, "devices": 3, "data": "d2"},
                                  may_change=("devices",))
    assert cnnpar.MultiWorker.elastic and cnnpar.AsyncPS.elastic


def test_a_checkpoint_records_its_configuration_sorted_and_a_failed_save_keeps_the_previous_epoch(tmp_path,
                                                                                                     monkeypatch):
    model, folder, config = saved_checkpoint(tmp_path / "checkpoints" / RUN)
    assert (folder / "run.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"
    run = checkpoints.RunCheckpoint(model, folder, resume=True, config=config)
    assert run.restore() == 1 and run.changes == []
    run.save(completed_epochs=2)
    run.save(completed_epochs=3)
    assert [type(f) for f in tf.get_logger().filters].count(checkpoints.SaverRetracingFilter) == 1  # added once
    monkeypatch.setattr(run._manager, "save", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        run.save(completed_epochs=4)
    assert run.completed_epochs == 3  # as the checkpoint on disk says
    assert checkpoints.RunCheckpoint(model, folder, resume=True, config=config).restore() == 3
    unrecorded = checkpoints.RunCheckpoint(model, tmp_path / "no-config", resume=False)
    unrecorded.save(completed_epochs=1)
    assert not (tmp_path / "no-config" / "run.json").exists() and unrecorded.holds_checkpoint()


def test_a_preemption_checkpoint_alone_is_a_checkpoint_that_needs_resume(tmp_path):
    model = build_small_cnn()
    model.optimizer.build(model.trainable_variables)
    folder = tmp_path / "checkpoints" / RUN
    run = checkpoints.RunCheckpoint(model, folder, resume=False)
    assert run.preemption_folder == folder / "preemption" and not run.holds_checkpoint()
    tf.train.CheckpointManager(run.checkpoint, str(run.preemption_folder), max_to_keep=1).save()
    with pytest.raises(ValueError, match=r"holds the checkpoint of an interrupted run; pass resume=True"):
        checkpoints.RunCheckpoint(model, folder, resume=False)


def test_a_resume_beside_a_checkpoint_of_the_same_settings_names_the_folders_name_as_the_difference(tmp_path):
    model, found, config = saved_checkpoint(tmp_path / RUN)
    other = tmp_path / RUN.replace("2dev", "4dev")
    with pytest.raises(ValueError) as raised:
        checkpoints.RunCheckpoint(model, other, resume=True, config={**config, "new_key": 1})  # unrecorded: no matter
    assert f"holds no checkpoint; {found} holds one of another configuration: its folder's name. Resume with" in str(
        raised.value)


def test_removing_a_runs_checkpoint_removes_its_parent_only_when_no_other_run_is_left(tmp_path):
    model, first, _ = saved_checkpoint(tmp_path / "checkpoints" / RUN)
    _, second, _ = saved_checkpoint(tmp_path / "checkpoints" / RUN_3_PLUS_3)
    checkpoints.RunCheckpoint(model, first, resume=True).remove()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [RUN_3_PLUS_3]
    run = checkpoints.RunCheckpoint(model, second, resume=True)
    run.remove(run.preemption_folder)  # a folder of its own, first
    assert second.exists()
    run.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_timed_out_collective_names_the_peers_that_no_longer_answer():
    """A collective that timed out names no task (a link gone down): the lost peers are those that accept no
    connection; a message that names tasks is taken at its word."""
    from keras_cnnpar.cluster import spec as cluster_lib
    from keras_cnnpar.strategies import multi_worker

    with socket.create_server(("localhost", 0)) as listening:
        live, (dead,) = f"localhost:{listening.getsockname()[1]}", reserve_ports(1)  # nothing listens there
        task = cluster_lib.Task({"worker": [live, f"localhost:{dead}", live]}, "worker", 0)
        assert multi_worker._lost_peers(task, "Collective has timed out during execution.") == \
            ["/job:worker/replica:0/task:1"]
        assert multi_worker._lost_peers(task, "from /job:worker/replica:0/task:2 and /job:worker/replica:0/task:0") \
            == ["/job:worker/replica:0/task:2"]


def test_a_dead_peer_fails_the_others_within_the_timeout(tmp_path, small_csv):
    """Both workers wait after epoch 1 (``held``); worker 1 is killed there, and the chief's next step needs it.
    Its time to fail is measured against the collective timeout plus twice its own first epoch, a machine's pace."""
    command = cnnpar_train("--epochs", "2", "--data", str(small_csv), "--results", "results",
                           "--collective-timeout", "15")
    hold = tmp_path / "hold"
    with processes([command] * 2, tmp_path, worker_envs(env=held(hold, 1))) as (chief, other):
        wait_for_epoch_rows(tmp_path / "results" / f"{RUN}.csv", 1, chief)
        other.kill()
        other.wait()
        release(hold)
        released = time.monotonic()
        output = chief.communicate(timeout=120)[0]
        waited = time.monotonic() - released
    assert chief.returncode == 1
    (epoch,) = read_rows(tmp_path / "results" / f"{RUN}.csv")
    assert waited < 15 + 2 * float(epoch["epoch_seconds"]), (waited, epoch["epoch_seconds"])
    assert "Error: worker 0: training stopped because a peer failed or did not answer within timeout=15.0 s; " \
           "lost: /job:worker/replica:0/task:1." in output


def test_a_cluster_that_does_not_assemble_fails_in_one_line_naming_the_peer_that_never_answered(tmp_path):
    """TF_CONFIG names a second worker that is never started: one line names it, where faulthandler's
    "Timeout (0:01:00)!" and 20 frames said nothing of it; no process is left."""
    lone_chief = worker_envs()[0]
    peer = json.loads(lone_chief["TF_CONFIG"])["cluster"]["worker"][1]
    result = subprocess.run(cnnpar_train("--results", "results", "--collective-timeout", "5"), cwd=tmp_path,
                            env=lone_chief, capture_output=True, text=True, timeout=120)
    stderr = result.stderr
    assert result.returncode == 1
    assert "worker 0: joining the cluster {'worker': [" in stderr
    assert "]}; the process exits if it has not assembled within timeout=5.0 s" in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("Error")]
    assert lines == [f"Error: worker 0: the cluster did not assemble within timeout=5.0 s: worker 1 ({peer}) never "
                     f"answered; start every task of the cluster, or check the names and ports its environment "
                     f"gives (TF_CONFIG, Slurm, Kubernetes)"], stderr
    assert "Timeout (" not in stderr and "Traceback" not in stderr and "File " not in stderr
    watches = [pid for pid in Path("/proc").iterdir() if pid.name.isdigit() and peer.encode() in read_or_empty(
        pid / "cmdline")]
    assert watches == [] and not (tmp_path / "results").exists()  # the watch ended with the process it watched


def read_or_empty(path):
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def listening_ports(net_folder):
    """The TCP ports in LISTEN state in a ``/proc/.../net`` folder (one network namespace's view)."""
    return {port for port, _ in listening_sockets(net_folder)}


def test_the_workers_servers_listen_in_a_private_network_and_the_launcher_names_a_dead_worker(tmp_path, small_csv):
    command = cnnpar_train("--workers", "2", "--epochs", "2", "--data", str(small_csv), "--results", "results")
    with processes([command], tmp_path, [held(tmp_path / "hold", 1)]) as (launcher,):  # they wait after epoch 1
        wait_for_epoch_rows(tmp_path / "results" / f"{RUN}.csv", 1, launcher)
        worker = worker_pid(launcher, 1)
        environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        tf_config = json.loads(next(v for v in environ if v.startswith(b"TF_CONFIG="))[len("TF_CONFIG="):])
        ports = {int(address.rpartition(":")[2]) for address in tf_config["cluster"]["worker"]}
        if network.private_network_available():
            assert os.readlink(f"/proc/{worker}/ns/net") != os.readlink("/proc/self/ns/net")
            assert ports <= listening_ports(Path(f"/proc/{worker}/net"))  # they listen, in the workers' network
            assert not ports & listening_ports(Path("/proc/self/net"))  # and nothing on this machine's
        else:  # no namespaces for this user here: the launcher warned, and the servers listen on this machine
            assert ports <= listening_ports(Path("/proc/self/net"))
        os.kill(worker, signal.SIGKILL)
        output = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 1
    assert "Error: worker 1 was killed by SIGKILL; its last output:" in output


def test_the_launcher_names_the_worker_that_ended_first_not_the_lowest_index():
    """Worker 1 is killed; worker 0 fails on the lost connection a moment later, within one poll of the launcher.
    A poll that saw both gone named worker 0, whose error only echoes worker 1's death (it happened once in the
    suite, under load). The launcher polls once an hour here: it is told of worker 1's end by its waiting thread
    before worker 0 ends (each reads its standard input until the test closes it)."""
    workers = [subprocess.Popen(["sh", "-c", "read line; exit 1"], stdin=subprocess.PIPE),
               subprocess.Popen(["sh", "-c", "read line"], stdin=subprocess.PIPE)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        failed = pool.submit(local_workers._wait_for_failure, workers, poll_seconds=3600)
        try:
            workers[1].kill()
            assert failed.result(timeout=60) == 1  # told at the first failure, not at the next poll
        finally:
            workers[0].stdin.close()  # worker 0 ends (and the wait with it, had it missed worker 1)
    assert [worker.wait() for worker in workers] == [1, -signal.SIGKILL]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds. Received: timeout=0"),
    ({"checkpoint_dir": 7}, TypeError, "checkpoint_dir must be a folder path or None. Received: checkpoint_dir=7"),
    ({"pack_bytes": 0}, ValueError, "pack_bytes must be a positive int. Received: pack_bytes=0"),
    ({"pack_bytes": 10**6, "compression": "powersgd"}, ValueError,
     "pack_bytes is for compression=None or 'bfloat16'. Received: compression='powersgd', pack_bytes=1000000"),
    ({}, ValueError, "no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, pass cluster=<dict or JSON "
                     "file>, or start N workers on this machine with `cnnpar launch --workers N python "
                     "your_script.py` (or `cnnpar train --strategy multi-worker --workers N`). "
                     "Received: TF_CONFIG=''"),
    ({"cluster": 42}, TypeError, "cluster must be a TF_CONFIG-style dict or the path of a JSON file. "
                                 "Received: cluster of type int"),
    ({"cluster": "missing.json"}, ValueError, "cannot read cluster file missing.json: No such file or directory. "
                                              "Received: cluster='missing.json'"),
    ({"cluster": {"cluster": {"ps": ["localhost:1"]}, "task": {"type": "ps", "index": 0}}}, ValueError,
     "TF_CONFIG: the cluster needs a 'worker' or 'chief' job. Received: jobs=['ps']"),
    ({"cluster": {"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}}, ValueError,
     "TF_CONFIG: task worker:0 needs a 'host:port' address with a host and a port in 1..65535. "
     "Received: worker[0]='localhost'"),
    *(({"cluster": {"cluster": {"worker": ["localhost:1", address]}, "task": {"type": "worker", "index": 0}}},
       ValueError, f"TF_CONFIG: task worker:1 needs a 'host:port' address with a host and a port in 1..65535. "
                   f"Received: worker[1]={address!r}") for address in ("localhost:0", "localhost:65536", ":2222",
                                                                      "localhost:\uff12\uff12")),
    ({"cluster": {"cluster": {"worker": ["[::1]:2222"]}, "task": {"type": "worker", "index": 0}}}, ValueError,
     "TF_CONFIG: task worker:0 has an IPv6 address, which keras_cnnpar does not reach yet; give an IPv4 address or "
     "a host name. Received: worker[0]='[::1]:2222'"),
    ({"cluster": {"cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.1:2222"]},
                  "task": {"type": "worker", "index": 0}}}, ValueError,
     "TF_CONFIG: tasks chief:0 and worker:0 have the same address; every task needs its own. "
     "Received: worker[0]='10.0.0.1:2222'"),
    ({"cluster": {"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": False}}}, ValueError,
     "TF_CONFIG: expected a 'task' with a 'type' among ['worker'] and an int 'index'. "
     "Received: task={'type': 'worker', 'index': False}"),
])
def test_multi_worker_validates_its_arguments_before_joining(monkeypatch, tmp_path, kwargs, error, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        cnnpar.MultiWorker(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize("args, env, message", [
    (["--workers", "2", "--strategy", "mirrored"], {},
     "--workers is for --strategy multi-worker, local-steps or async-ps. Received: --strategy mirrored"),
    ([], {"TF_CONFIG": ""}, "no cluster: TF_CONFIG is not set."),
    ([], {"TF_CONFIG": "{oops"}, "TF_CONFIG: expected JSON, line 1 column 2"),
    (["--workers", "3"], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                    "task": {"type": "worker", "index": 0}})},
     "TF_CONFIG holds 2 workers. Received: --workers 3"),
])
def test_bad_cluster_settings_exit_2_before_training(monkeypatch, tmp_path, args, env, message):
    monkeypatch.chdir(tmp_path)  # in this process: each is refused before any cluster is joined
    result = CliRunner().invoke(cli.main, ["train", "--strategy", "multi-worker", *args, "--results", "results"],
                                env=env)
    assert result.exit_code == 2, result.output[-2000:]
    assert message in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "results").exists()


@contextlib.contextmanager
def training_workers(tmp_path, small_csv, env=ENV):
    """A launcher of 2 local workers that wait after their first epoch (``held``), once it is done; and their pids."""
    command = cnnpar_train("--workers", "2", "--epochs", "2", "--data", str(small_csv), "--results", "results")
    with processes([command], tmp_path, [held(tmp_path / "hold", 1, env=env)]) as (launcher,):
        wait_for_epoch_rows(tmp_path / "results" / f"{RUN}.csv", 1, launcher)
        yield launcher, [worker_pid(launcher, index) for index in (0, 1)]


@pytest.mark.parametrize("target", ["launcher", "supervisor"])
def test_no_worker_outlives_a_launcher_or_supervisor_killed_outright_and_no_file_is_left(tmp_path, small_csv,
                                                                                         target):
    """The supervisor is the process that started the workers (inside the launcher's network namespace)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    with training_workers(tmp_path, small_csv, {**ENV, "TMPDIR": str(temp)}) as (launcher, workers):
        supervisor = int(Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(launcher.pid if target == "launcher" else supervisor, signal.SIGKILL)
        left = still_alive_after(workers)
        assert left == [], f"workers {left} outlived their {target}"
    assert list(temp.iterdir()) == []  # worker 1's output went to an unnamed file


EXAMPLE = Path(__file__).parents[1] / "examples" / "launch_any_script.py"
LAUNCHED = "launched_cnn_keras_tensorflow_multi-worker_2dev"


def cnnpar_launch(*script_args):
    return cnnpar_command("launch", "--workers", "2", "--", "python", EXAMPLE, "--examples", "640", "--results",
                          "results", *script_args)


def test_launch_runs_a_users_script_that_builds_its_model_first_and_only_the_chief_writes(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run(cnnpar_launch("--epochs", "2", "--keras-logs", "logs"), cwd=tmp_path,
                            env={**ENV, "TMPDIR": str(temporary)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RuntimeWarning" not in result.stderr
    # Keras's own callbacks: exactly the chief's files where the script said, and nothing the others wrote left.
    assert sorted(p.relative_to(tmp_path / "logs").parts[:2] for p in (tmp_path / "logs").rglob("*") if p.is_file()) \
        == [("epochs.csv",), ("last.keras",), ("tensorboard", "train"), ("tensorboard", "validation")]
    assert len(list((tmp_path / "logs" / "tensorboard" / "train").glob("events.out.tfevents.*"))) == 1
    assert [row["epoch"] for row in read_rows(tmp_path / "logs" / "epochs.csv")] == ["0", "1"]
    assert list(temporary.iterdir()) == []
    (run,) = read_rows(tmp_path / "results" / "runs.csv")  # one row: worker 1 wrote none
    assert (run["model"], run["strategy"], run["devices"], run["epochs"]) == ("launched_cnn", "multi-worker", "2", "2")
    assert float(run["val_accuracy"]) > 0.5
    assert epoch_column(tmp_path / "results" / f"{LAUNCHED}.csv") == [1, 2]
    assert result.stdout.count("final validation accuracy") == 1  # the chief's output only


@pytest.mark.parametrize("network_kind", ["private", "host"])
def test_launch_says_which_network_the_workers_have_and_host_gives_them_this_machines(tmp_path, network_kind):
    show = "import os; print('network', os.readlink('/proc/self/ns/net'))"
    result = subprocess.run(cnnpar_command("launch", "--workers", "1", "--network", network_kind, "--", "python", "-c",
                                           show), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (worker_network,) = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("network ")]
    first = result.stderr.splitlines()[0]
    if network_kind == "host" or not network.private_network_available():
        assert worker_network == os.readlink("/proc/self/ns/net")
        assert "warning: the TensorFlow servers of the local workers listen on every network interface" in result.stderr
    else:
        assert worker_network != os.readlink("/proc/self/ns/net")
        assert first == local_workers.NETWORK_LINES["private"].format(workers=1)
    if network_kind == "host":
        assert first == local_workers.NETWORK_LINES["host"].format(workers=1)


def test_launch_names_a_killed_worker(tmp_path):
    """The workers wait after epoch 1 (``held``) and are never let go: only the kill ends the run."""
    with processes([cnnpar_launch("--epochs", "2")], tmp_path, [held(tmp_path / "hold", 1)]) as (launcher,):
        wait_for_epoch_rows(tmp_path / "results" / f"{LAUNCHED}.csv", 1, launcher)
        os.kill(worker_pid(launcher, 1), signal.SIGKILL)
        output = launcher.communicate(timeout=90)[0]
    assert launcher.returncode == 1
    assert "Error: worker 1 was killed by SIGKILL; its last output:" in output


def test_a_script_started_without_the_launcher_is_told_how(tmp_path):
    env = {key: value for key, value in ENV.items() if key != "TF_CONFIG"}
    result = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "1"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, pass cluster=<dict or JSON file>, or " \
           "start N workers on this machine with `cnnpar launch --workers N python your_script.py`" in \
           " ".join(result.stderr.split())
