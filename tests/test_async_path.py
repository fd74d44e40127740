"""AsyncPS's one path, seen from the user's process: the coordinator process trains near Single, never collapsing,
on every batch once, counting every step, listens on no port of this machine, keeps at most one pass of the data
in its folder, and hands back the trained optimizer state.

The coordinator is a process of its own whichever comes first, the model or the
strategy, so these fits run in the test process itself.
"""

import contextlib
import os
import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.cluster import network
from keras_cnnpar.strategies.async_ps import remote as async_remote
from keras_cnnpar.strategies.async_ps import run as async_run
from tests.helpers import build_small_cnn, listening_sockets

pytestmark = pytest.mark.slow  # parameter-server clusters in processes of their own

EPOCHS = 6


def listening_inodes(pid):
    """The socket inodes that listen on TCP in the network namespace of process ``pid``."""
    return {inode for _, inode in listening_sockets(f"/proc/{pid}/net")}


def socket_inodes(pid):
    """The inodes of the sockets process ``pid`` holds open."""
    links = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            links.append(os.readlink(entry))
    return {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}


def data_bytes(folder):
    """The bytes of the batches in a coordinator's folder (the epochs' and the validation's; not the model files)."""
    return sum(path.stat().st_size for data in [*folder.glob("train-*"), *folder.glob("validation")]
               for path in data.rglob("*") if path.is_file())


class Watcher:
    """Looks at the run each time the user's process hands the coordinator an epoch's batches (its ``train``
    message, when they are all written and the coordinator has joined its cluster): the coordinator process (its
    sockets), its temporary folder (size, epoch folders) and the user's working folder (anything written there)."""

    def __init__(self, temporary, working):
        self.temporary, self.working = temporary, working
        self.looks, self.largest, self.most_epoch_folders, self.sockets, self.written = 0, 0, 0, None, set()

    def look(self, coordinator):
        self.looks += 1
        self.written.update(path.name for path in self.working.iterdir())
        for folder in self.temporary.glob("cnnpar-async-*"):
            self.largest = max(self.largest, data_bytes(folder))
            self.most_epoch_folders = max(self.most_epoch_folders, len(list(folder.glob("train-*"))))
        own, here, held = listening_inodes(coordinator), listening_inodes(os.getpid()), socket_inodes(coordinator)
        if len(held & own) >= 4:  # 2 workers, 1 ps and the coordinator listen
            self.sockets = {"listening in its namespace": held & own, "listening here": held & here}


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """A 6-epoch AsyncPS(2) fit of a model built first, on 512 digits, without checkpoints, from an empty working
    folder, looked at as each epoch starts (``Watcher``) and after the run. The rate is a schedule (nearly
    constant): the coordinator used to be sent the epoch's rate to set, which Keras refuses."""
    temporary, working = tmp_path_factory.mktemp("temporary"), tmp_path_factory.mktemp("working")
    digits = cnnpar.data.load()
    x, y = digits.x[:512], digits.y[:512]
    validation = (digits.x[512:768], digits.y[512:768])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=10**6, decay_rate=0.5)
    model = build_small_cnn(seed=0, optimizer=keras.optimizers.SGD(schedule, momentum=0.9))
    handed_back = {}
    finalize = async_remote.CoordinatorProcessRun.finalize

    def keep_trained(run, user_model):
        handed_back["trained"] = run.trained
        finalize(run, user_model)

    watcher = Watcher(temporary, working)
    send = async_remote.CoordinatorProcessRun._send

    def look_then_send(run, message):
        if "train" in message:
            watcher.look(run.child.pid)
        send(run, message)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(temporary))
        patch.chdir(working)
        patch.setattr(async_remote.CoordinatorProcessRun, "finalize", keep_trained)
        patch.setattr(async_remote.CoordinatorProcessRun, "_send", look_then_send)
        model.fit(x, y, batch_size=64, epochs=EPOCHS, validation_data=validation,
                  strategy=cnnpar.AsyncPS(workers=2, ps=1, checkpoint_dir=None), results_dir=None, verbose=0)
    watcher.written.update(path.name for path in working.iterdir())
    one_pass = x.nbytes + y.nbytes + validation[0].nbytes + validation[1].nbytes
    return {"model": model, "trained": handed_back["trained"], "watcher": watcher, "one_pass": one_pass,
            "temporary": temporary}


def test_a_run_without_checkpoints_writes_nothing_in_the_working_folder(observed_run):
    """The coordinator created its strategy with ``strategies.create``, which reads None as "the default": with
    ``checkpoint_dir=None`` it wrote each epoch's checkpoint under ./checkpoints (and two such runs in one folder
    failed, one removing the other's)."""
    assert observed_run["watcher"].written == set()


def test_the_temporary_folder_holds_one_pass_of_the_data_and_is_removed(observed_run):
    watcher = observed_run["watcher"]
    assert watcher.looks == EPOCHS
    assert watcher.largest > observed_run["one_pass"] // 2  # the watcher saw the data
    # One epoch's batches and the validation batches at most, not 6 epochs' (the model files come beside them).
    assert watcher.largest <= 1.1 * observed_run["one_pass"], (watcher.largest, observed_run["one_pass"])
    assert watcher.most_epoch_folders == 1
    assert list(observed_run["temporary"].iterdir()) == []


@pytest.mark.skipif(not network.private_network_available(), reason="this machine allows no network namespace")
def test_no_port_of_a_local_run_listens_in_this_machines_network_namespace(observed_run):
    sockets = observed_run["watcher"].sockets
    assert sockets is not None, "the coordinator's servers were never seen listening"
    assert sockets["listening here"] == set()


def test_the_users_model_gets_the_coordinators_optimizer_state(observed_run):
    model, trained = observed_run["model"], observed_run["trained"]
    assert int(model.optimizer.iterations.numpy()) == int(trained.optimizer.iterations.numpy()) > 0
    mine = [v.numpy() for v in model.optimizer.variables]
    theirs = [v.numpy() for v in trained.optimizer.variables]
    assert len(mine) == len(theirs) > 2
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(mine, theirs)) == 0.0
    assert max(float(np.max(np.abs(slot))) for slot in mine[2:]) > 0.0  # momentum slots that trained


#: How far AsyncPS(2)'s 3+3 may end below Single's, in accuracy. The gap at a fixed seed varies from run to run
#: with which worker's update lands first: seed 1 ended 0.2-1.6 points behind in the 7 runs of the docstring
#: below (mean 0.9), seed 3 0.9 ahead to 0.1 behind; the widest spread of one seed's gap measured for the 3+3 with
#: 2 workers is 1.0 point (standard deviation; seed 1 of benchmarks/async_robustness.py, four runs in
#: docs/measurements/2026-12-05-avx2-asyncps.md). At 3 points seed 1 was 2.1 of those deviations from failing,
#: about 1 run in 60 (and it dipped under load in CI); at 5 points it is 4.1 deviations: about 2 in 100,000 runs
#: for seed 1 (normal tails). A collapse (0.34-0.61 before the fixes the docstring names) stays far below either.
#: The test runs seed 1, the closer of the two to its bound; seed 3 and the others are the robustness benchmark's
#: (benchmarks/async_robustness.py), which holds every seed within 3 points.
ASYNC_GAP = 0.05


@pytest.mark.parametrize("seed", [1])
def test_the_3_plus_3_cnn_under_async_ps_2_ends_within_5_points_of_single(seed):
    """The seed's 3+3 CNN (SGD 0.05, Nesterov momentum 0.9) collapsed in some seeds before the default warm-up
    and the division by (1 + staleness)^2 (docs/async.md). Without the division (staleness_aware=False),
    4 epochs, AMD Zen 5: seed 1 0.872, **0.336**, 0.703, 0.907 and seed 3 0.902, 0.810, **0.605**, 0.819 in one
    run (the collapse depends on which worker's update lands first). The warm-up's updates are Single's, one
    after another on the same batches with the same dropout masks, so the first epoch is Single's; before the
    coordinator took the Dropout's seed state from the user's model it drew its own, and a seed that started
    slowly there (0.355 after the first epoch) ended 4 points behind. With both, 3 epochs, 7 runs of each
    seed (6 of them two at a time): seed 1 0.945-0.959 against Single's 0.961, seed 3 0.957-0.967 against
    0.958."""
    train, validation = cnnpar.data.split(cnnpar.data.load(), validation_fraction=0.2, seed=0)
    histories = {}
    for name, strategy in [("single", cnnpar.Single()), ("async", cnnpar.AsyncPS(workers=2, checkpoint_dir=None))]:
        keras.utils.set_random_seed(seed)
        model = cnnpar.models.cnn("3+3")  # built first, as with fit(strategy="async-ps")
        histories[name] = model.fit(train.x, train.y, batch_size=64, epochs=3, strategy=strategy, verbose=0,
                                    validation_data=(validation.x, validation.y), results_dir=None).history
    single, asynchronous = histories["single"], histories["async"]
    assert asynchronous["loss"][0] == pytest.approx(single["loss"][0], rel=1e-5)  # the warm-up: Single's steps
    assert min(asynchronous["val_accuracy"]) >= 0.5, asynchronous["val_accuracy"]
    assert asynchronous["val_accuracy"][-1] >= single["val_accuracy"][-1] - ASYNC_GAP, (single, asynchronous)


@pytest.mark.parametrize("steps_per_execution, batch_slices", [(1, 1), (8, 1), (8, 2)])
def test_every_batch_trains_once_and_counts_once_whichever_worker_runs_it(steps_per_execution, batch_slices):
    """With the learning rate at 0 the weights never move, so an epoch's loss and accuracy depend only on which
    batches it trained on: AsyncPS(4), one step per scheduled group, gives Single's, and the optimizer counts
    every step. (Before, each worker read the epoch from a random offset of its own, some batches twice and
    others never; Keras's metric and step counters, read and written back by 4 workers at once, lost counts.)
    So do groups of 8, which an epoch of 16 steps over 4 workers cuts to groups of 4 (``steps_per_group``), and
    each batch in 2 slices, every slice an update the optimizer counts."""
    digits = cnnpar.data.load()
    x, y = digits.x[:1000], digits.y[:1000]  # 15 batches of 64 and one of 40: the loss weighs them by size
    logs, iterations = {}, {}
    for name, strategy in [("single", cnnpar.Single()),
                           ("async", cnnpar.AsyncPS(workers=4, steps_per_execution=steps_per_execution,
                                                    batch_slices=batch_slices, warmup_steps=0, checkpoint_dir=None))]:
        model = build_small_cnn(seed=0, learning_rate=0.0)
        history = model.fit(x, y, batch_size=64, epochs=2, strategy=strategy, results_dir=None, verbose=0)
        logs[name] = {key: history.history[key] for key in ("loss", "accuracy")}
        iterations[name] = int(model.optimizer.iterations.numpy())
    assert logs["async"]["accuracy"] == logs["single"]["accuracy"], logs
    assert np.allclose(logs["async"]["loss"], logs["single"]["loss"], rtol=1e-6, atol=0), logs
    assert iterations == {"single": 32, "async": 32 * batch_slices}


def test_a_batch_is_never_cut_in_more_slices_than_it_has_examples_and_the_report_says_so(capsys):
    """batch_slices=3 on global batches of 2: 2 slices of one example each, the updates the optimizer counts."""
    digits = cnnpar.data.load()
    model = build_small_cnn(seed=0, learning_rate=0.0)
    model.fit(digits.x[::250], digits.y[::250], batch_size=2, epochs=1, verbose=1, results_dir=None,
              strategy=cnnpar.AsyncPS(workers=2, batch_slices=3, warmup_steps=0, checkpoint_dir=None))
    assert int(model.optimizer.iterations.numpy()) == 10 * 2  # 20 digits: 10 batches of 2 slices
    assert "each batch trained in 2 slices, each a step and an update weighted by its share of the batch " \
           "(batch_slices=2; 3 called for, more than a global batch of 2 examples holds)" in capsys.readouterr().out


def test_the_slices_of_a_batch_move_the_weights_as_the_whole_batch_does():
    """One worker (so nothing is stale), plain SGD: each batch trained in 4 slices, each slice's gradient weighted
    by its share, moves the weights as Keras's steps on whole batches do, up to the second-order term of the
    slices' running one after another: 0.28% apart here at a small rate, on a model without the kinks of ReLU
    (on the small CNN, ReLUs at exactly 0 on the digits' blank pixels turn on once the first slice has moved the
    biases: 10% apart, at any rate). Each slice applied whole would move the weights about 4 times as far."""
    digits = cnnpar.data.load()
    x, y = digits.x[:640], digits.y[:640]
    moved = {}
    for name, strategy in [("single", cnnpar.Single()),
                           ("async", cnnpar.AsyncPS(workers=1, batch_slices=4, ema_momentum=None,
                                                    checkpoint_dir=None))]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="sparse_categorical_crossentropy")
        start = model.get_weights()
        history = cnnpar.fit(model, x, y, batch_size=64, epochs=1, shuffle=False, strategy=strategy,
                             results_dir=None, verbose=0)
        moved[name] = [after - before for after, before in zip(model.get_weights(), start)]
    assert history.history["steps_applied"] == [40.0], history.history
    apart = max(float(np.max(np.abs(a - s))) for a, s in zip(moved["async"], moved["single"]))
    distance = max(float(np.max(np.abs(s))) for s in moved["single"])
    assert apart < 0.01 * distance, (apart, distance)


def test_a_staleness_bound_drops_every_step_staler_than_it_and_counts_it():
    """AsyncPS(4, max_staleness=0), one step per scheduled group and no warm-up: the four workers step at once, so
    some steps find another's update begun and not landed. Each of those is dropped and counted; every step is
    applied or dropped, none applied staler than the bound, and the optimizer counts only the applied."""
    digits = cnnpar.data.load()
    model = build_small_cnn(seed=0)
    history = model.fit(digits.x[:1024], digits.y[:1024], batch_size=64, epochs=1, verbose=0, results_dir=None,
                        strategy=cnnpar.AsyncPS(workers=4, steps_per_execution=1, warmup_steps=0, max_staleness=0,
                                                checkpoint_dir=None)).history
    applied, dropped = history["steps_applied"][0], history["steps_dropped"][0]
    assert applied + dropped == 16 and dropped >= 1 and applied >= 1, history
    assert history["staleness_max"] == [0.0], history  # of the steps applied
    assert int(model.optimizer.iterations.numpy()) == applied


class WeightsAfterEachStep(keras.callbacks.Callback):
    """The model's weights after every training step."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.get_weights())


def test_validation_and_the_trained_model_read_the_moving_average_of_the_weights_after_the_warm_up():
    """With one worker AsyncPS's updates are Keras's, one after another; the weights it validates and hands
    back are their moving average: the weights themselves through the warm-up (2 updates here), then each
    update moves the average by 1 - ema_momentum. Without the average the trained model held the last
    update's weights, 1.1e-3 away from it here (the average: 1.5e-11); ``ema_momentum=None`` hands those back."""
    digits = cnnpar.data.load()
    x, y, validation = digits.x[:384], digits.y[:384], (digits.x[384:512], digits.y[384:512])
    keras_fit = build_small_cnn(seed=0, learning_rate=0.05)
    steps = WeightsAfterEachStep()
    keras_fit.fit(x, y, batch_size=64, epochs=2, callbacks=[steps], shuffle=False, verbose=0)  # Keras's own
    average = steps.weights[1]
    for weights in steps.weights[2:]:
        average = [0.5 * a + 0.5 * w for a, w in zip(average, weights)]
    trained = {}
    for momentum in (0.5, None):
        model = build_small_cnn(seed=0, learning_rate=0.05)
        strategy = cnnpar.AsyncPS(workers=1, steps_per_execution=1, warmup_steps=2, ema_momentum=momentum,
                                  checkpoint_dir=None)
        history = model.fit(x, y, batch_size=64, epochs=2, validation_data=validation, shuffle=False,
                            strategy=strategy, results_dir=None, verbose=0)
        trained[momentum] = model.get_weights()
        assert history.history["val_loss"][-1] == pytest.approx(model.evaluate(*validation, verbose=0)[0], rel=1e-5)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(trained[0.5], average))
    last = max(float(np.max(np.abs(a - b))) for a, b in zip(trained[None], steps.weights[-1]))
    apart = max(float(np.max(np.abs(a - b))) for a, b in zip(steps.weights[-1], average))
    assert gap < 1e-6 and last < 1e-6 and apart > 5e-4, (gap, last, apart)


class MaxSeen(keras.metrics.Metric):
    """A metric that does not add to its variable: the largest prediction seen."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.largest = self.add_variable(shape=(), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(y_pred)))

    def result(self):
        return self.largest


def test_the_workers_metric_update_adds_keras_metrics_and_leaves_others_keras_update():
    """AsyncPS's metric update (in a worker's step, here eagerly) gives the results of Keras's own: Keras's
    metrics through an atomic add of what the batch adds, a metric of another module (a running maximum,
    which adding would turn into a sum of maxima) through its own update."""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 10, 8), rng.random((8, 10), dtype="float32")) for _ in range(3)]
    models = []
    for _ in range(2):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(10, activation="softmax")])
        metrics = ["accuracy", MaxSeen(name="max_seen"), keras.metrics.SparseTopKCategoricalAccuracy(3, name="top_3")]
        model.compile("sgd", "sparse_categorical_crossentropy", metrics=metrics)
        model.compute_metrics(None, *batches[0])  # builds the compiled metrics, as the coordinator's first step
        model.reset_metrics()
        models.append(model)
    for y, y_pred in batches:
        models[0].compute_metrics(None, y, y_pred)
        async_run._add_metrics(models[1], None, y, y_pred)
    keras_update, workers_update = (model.get_metrics_result() for model in models)
    assert set(workers_update) == {"accuracy", "max_seen", "top_3", "loss"}
    for name, value in keras_update.items():
        assert float(workers_update[name]) == pytest.approx(float(value), abs=1e-7), name
    assert float(keras_update["max_seen"]) < 1.0  # a maximum of softmax values, not a sum of three
