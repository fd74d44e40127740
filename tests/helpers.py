"""What several test modules share: small models, class-balanced digits, the accuracy floors, CLI and process helpers.

Test modules import from here, never from each other or from ``conftest.py``.
"""

import contextlib
import csv
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from click.testing import CliRunner

from keras_cnnpar import api, cli
from keras_cnnpar.cluster import spec as cluster
from keras_cnnpar.engine import hold
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies import registry
from keras_cnnpar.zoo import models

#: Validation accuracy after 3 epochs at batch 64 on the default split (documented in README.md).
FLOORS = {"2+2": 0.93, "3+3": 0.92, "resnet": 0.92}  # resnet under Single: 0.939, 0.952, 0.956 (seeds 0-2)
#: Set by the root conftest.py for the whole session: every process the suite starts inherits it, so the
#: end-of-session check can find any left behind.
SUITE_MARK = "CNNPAR_TEST_SUITE"
#: Accuracy floors in bfloat16 run where the CPU computes it natively; elsewhere TensorFlow emulates bfloat16 at
#: a fifth of float32's speed (docs/precision.md). The bfloat16 parity tests run everywhere.
NATIVE_BFLOAT16 = pytest.mark.skipif(not hardware.native_bfloat16(),
                                     reason="this CPU emulates bfloat16 (no AVX512-BF16 or AMX-BF16)")
#: The registered strategies that train in the test's own process; the others (registry fact ``needs_cluster``)
#: are tested with processes of their own.
IN_PROCESS = registry.names(needs_cluster=False)
#: The environment of every subprocess the tests start.
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def balanced(digits, n, offset=0):
    """``(x, y)``: ``n`` digits spread evenly over the class-ordered data, so every class is in them.

    mnist-5k holds 500 digits per class in class order: ``digits.x[:n]`` with
    ``n <= 500`` is all zeros, and could not expose a strategy that pairs
    images with the wrong labels. ``offset`` (below ``len(digits) // n``)
    picks another, disjoint set.
    """
    step = len(digits.y) // n
    assert 0 <= offset < step, f"offset {offset} must be below {step}"
    index = offset + np.arange(n) * step
    x, y = digits.x[index], digits.y[index]
    assert len(np.unique(y)) == digits.num_classes
    return x, y


def two_inputs_two_outputs():
    """A functional CNN of an image and a vector of 4 features, with a digit's softmax and a regression head."""
    keras.utils.set_random_seed(0)
    image, features = keras.Input((28, 28, 1), name="image"), keras.Input((4,), name="features")
    hidden = keras.layers.Concatenate()([keras.layers.Flatten()(keras.layers.Conv2D(4, 3)(image)), features])
    outputs = [keras.layers.Dense(10, activation="softmax", name="digit")(hidden),
               keras.layers.Dense(1, name="parity")(hidden)]
    model = keras.Model([image, features], outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=["sparse_categorical_crossentropy", "mse"])
    return model


def build_small_cnn(seed=0, learning_rate=0.1, optimizer=None, dtype=None):
    """A CNN without dropout or batch statistics, so one step is deterministic, compiled with SGD by default,
    its variables and arithmetic in ``dtype`` (by default, the global dtype policy's)."""
    keras.utils.set_random_seed(seed)
    with dtype_policy(dtype):
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ], name="small_cnn")
    model.compile(optimizer=optimizer or keras.optimizers.SGD(learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return api.parallel(model)


@contextlib.contextmanager
def dtype_policy(dtype):
    """Layers created inside keep their variables and compute in ``dtype`` (None: the global policy's)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype or previous)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


#: The gradient of BatchNormalization over a conv layer's 50,176 values per channel cancels heavily: Single's own
#: float32 gradient of a conv + BN model differed from its float64 gradient by 5.6e-4 here, as much as the
#: synchronized DataParallel gradient from Single's (5e-4); summed in another order, the same math rounds
#: differently. One step at learning rate 0.1 moved the weights 1.2e-4 apart; per-replica statistics, 1.1e-2.
SYNCHRONIZED_STEP_TOLERANCE = 5e-4


def build_residual_cnn(seed=0, learning_rate=0.1):
    """A functional CNN with BatchNormalization and a skip connection (``a`` to ``skip``), compiled with SGD."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((28, 28, 1))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="a")(inputs)
    b = keras.layers.Conv2D(8, 3, padding="same", name="b")(a)
    b = keras.layers.Activation("relu", name="b_relu")(keras.layers.BatchNormalization(name="b_norm")(b))
    c = keras.layers.Conv2D(8, 3, padding="same", name="c")(b)
    merged = keras.layers.Add(name="skip")([a, c])
    pooled = keras.layers.Flatten(name="flat")(keras.layers.MaxPooling2D(name="pool")(merged))
    outputs = keras.layers.Dense(10, activation="softmax", name="out")(pooled)
    model = keras.Model(inputs, outputs, name="residual_cnn")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def build_cnn_with_operations_on_tensors():
    """A functional CNN that calls operations on tensors where users do (a slice of the images, ``a + b``,
    ``keras.ops.relu``, ``mean`` and ``concatenate``): they are no layers, so not in ``model.layers``."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((28, 28, 1))
    a = keras.layers.Conv2D(4, 3, padding="same", name="a")(inputs[:, :, ::-1])
    b = keras.layers.Conv2D(4, 3, padding="same", name="b")(a)
    x = keras.ops.relu(a + b)
    x = keras.ops.concatenate([x, keras.ops.mean(x, axis=-1, keepdims=True)], axis=-1)
    x = keras.layers.Flatten(name="flat")(keras.layers.MaxPooling2D(name="pool")(x))
    model = keras.Model(inputs, keras.layers.Dense(10, name="out")(x))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return api.parallel(model)


def build_resnet(seed=0, learning_rate=0.1, dtype="float32"):
    """The ``"resnet"`` model kind with its variables and arithmetic in ``dtype``, compiled with plain SGD.

    Its parity tests build it in float64: in float32 its BatchNormalization gradients round too far for a
    1e-5 comparison (see ``SYNCHRONIZED_STEP_TOLERANCE``); in float64 every strategy's step is exact to 1e-9.
    """
    keras.utils.set_random_seed(seed)
    weights = models.cnn("resnet").get_weights()  # the float32 initial weights, whatever the dtype
    with dtype_policy(dtype):
        model = models.cnn("resnet")
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def build_resnet_float64(seed=0):
    """``build_resnet`` in float64 (a builder a worker process can name)."""
    return build_resnet(seed, dtype="float64")


def one_sgd_step(model, strategy, batch, **fit_kwargs):
    """``model`` after one unshuffled step on the whole of ``batch`` (``(x, y)``) under ``strategy``."""
    api.fit(model, *batch, strategy=strategy, batch_size=len(batch[0]), epochs=1, shuffle=False, verbose=0,
                 results_dir=None, **fit_kwargs)
    return model


def moving_statistics(model):
    """The moving means and variances of ``model``'s BatchNormalization layers, as numpy, in weight order."""
    return [w.numpy() for w in model.weights if "moving" in w.path]


def max_weight_difference(a, b):
    """The largest absolute difference between two models' weights (they must have the same, non-empty list)."""
    return max_difference(a.get_weights(), b.get_weights())


def max_difference(first, second):
    """The largest absolute difference between two equally long, non-empty lists of arrays."""
    assert len(first) == len(second) > 0, (len(first), len(second))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(first, second))


def assert_same_step(reference, candidate, tolerance, *, before, moved=1e-3, relative=False):
    """Assert that ``reference`` moved more than ``moved`` away from ``before`` (so the comparison means
    something) and that ``candidate`` is within ``tolerance`` of ``reference`` (``relative``: of how far it
    moved). Each is a model or a list of its weights; returns how far ``reference`` moved."""
    reference, candidate, before = (w.get_weights() if isinstance(w, keras.Model) else w
                                    for w in (reference, candidate, before))
    step = max_difference(reference, before)
    assert step > moved, f"the reference moved {step:.3g} from where it started, not more than {moved}"
    allowed = tolerance * step if relative else tolerance
    off = max_difference(candidate, reference)
    assert off < allowed, f"{off:.3g} away from the reference, not within {allowed:.3g} (it moved {step:.3g})"
    return step


def read_rows(path):
    """The rows of a CSV file as dicts."""
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def epoch_column(csv_path):
    return [int(row["epoch"]) for row in read_rows(csv_path)]


def documented_runs_columns():
    """The columns of ``runs.csv`` as docs/results.md lists them, in order."""
    text = " ".join((Path(__file__).parents[1] / "docs" / "results.md").read_text().split())
    listed = text.split("One row per finished run: `", 1)[1].split("`", 1)[0]
    return [column.strip() for column in listed.split(",")]


def run_cli(*args):
    """Invoke the ``cnnpar`` CLI in-process; return click's result."""
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def one_line_refusal(result, exit_code=2):
    """The one line a CLI ``result`` that exited with ``exit_code`` wrote on stderr: nothing else, no traceback."""
    assert result.exit_code == exit_code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    (line,) = result.stderr.splitlines()
    return line


def cnnpar_command(*args):
    """The command line of ``cnnpar ARGS...`` run by this Python (arguments made strings)."""
    return [sys.executable, "-m", "keras_cnnpar.cli", *map(str, args)]


def listening_sockets(net_folder):
    """``{(port, inode)}`` of the TCP sockets in LISTEN state in a ``/proc/.../net`` folder (one network
    namespace's view)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in (Path(net_folder) / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found.add((int(fields[1].rpartition(":")[2], 16), fields[9]))
    return found


def flock_waiters(path):
    """The pids of the processes waiting for the ``flock`` of ``path`` (the ``->`` lines of ``/proc/locks``)."""
    stat = os.stat(path)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    fields = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    return {int(f[5]) for f in fields if f[1:3] == ["->", "FLOCK"] and f[6] == device}


@contextlib.contextmanager
def processes(commands, cwd, envs):
    """Start one process per command, each in a session of its own; on leaving, kill every process of those
    sessions (workers and servers they started included)."""
    started = [subprocess.Popen(c, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True) for c, e in zip(commands, envs)]
    try:
        yield started
    finally:
        for process in started:
            kill_tree(process.pid)
            process.communicate()


@contextlib.contextmanager
def tmpfs(folder, size):
    """A tmpfs of ``size`` (as ``mount`` takes it: ``"1m"``) mounted on ``folder`` for the block, a small disk that
    fills; the test is skipped where it cannot be mounted (not root). It is unmounted lazily: a file a failed
    write left open (h5py's, held by the exception's traceback) keeps it until that file is closed."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs of {size} on {folder}: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fill(folder, leave):
    """Fill the disk of ``folder`` with a file until ``leave`` bytes are free."""
    (folder / "filler").write_bytes(bytes(os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize - leave))


def read_only(folder):
    """Make the tmpfs on ``folder`` (:func:`tmpfs`) read-only, its files kept: a disk where even root creates
    nothing (and where ``os.access`` tells root it can)."""
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)


def kill_tree(pid):
    """SIGKILL the process ``pid`` and every descendant of it that is still running."""
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def descendants(pid):
    """Every process below ``pid``, children first."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = Path(f"/proc/{parent}/task").iterdir()
            children = [int(c) for task in tasks for c in (task / "children").read_text().split()]
        except OSError:
            continue
        found += children
        queue += children
    return found


def suite_processes():
    """Pids of live processes started by this test session (they carry ``SUITE_MARK`` in their environment)."""
    mark = f"{SUITE_MARK}={os.environ[SUITE_MARK]}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pid):
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cpu_seconds(pid):
    """The CPU seconds process ``pid`` has used (user and system), from ``/proc``: how far a worker got."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime and stime, fields 14 and 15


def still_alive_after(pids, seconds=30):
    """The processes of ``pids`` still alive once all have ended or ``seconds`` have passed (``[]``: all gone)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(alive(pid) for pid in pids), f"the processes {pids} to end", seconds)
    return [pid for pid in pids if alive(pid)]


#: How often :func:`wait_until` looks again.
POLL_SECONDS = 0.1


def wait_until(condition, what, timeout=120, process=None, poll=POLL_SECONDS):
    """Poll ``condition()`` every ``poll`` seconds until it returns something true, and return that: the one way
    the tests wait.

    Fails with a message naming ``what`` (what was awaited) once ``timeout``
    seconds have passed, or as soon as ``process`` (a ``Popen``), when given,
    ended first. The timeout only ends a wait that went wrong; no verdict
    depends on how long the wait took.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if process is not None and process.poll() is not None:
            output = process.communicate()[0] if process.stdout else None
            raise AssertionError(f"{what}: process {process.pid} ended first (exit code {process.returncode})"
                                 + (f"; its last output:\n{output[-3000:]}" if output else ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(poll)
    return value


#: The suite's servers listen on ports from ``PORTS_FIRST`` on, below the kernel's ephemeral range (32768-60999 by
#: default), so no outgoing connection and no ``bind`` to port 0 of any process takes one; each pytest-xdist worker
#: has a block of ``PORTS_PER_WORKER`` of its own.
PORTS_FIRST, PORTS_PER_WORKER = 20000, 1000
_claimed_ports = []  # the open lock files of the ports this process claimed: they stay its own until it exits


def reserve_ports(count):
    """``count`` TCP ports that no other test process is given, and that nothing listens on now.

    The block comes from the pytest-xdist worker's name (``gw0``: 20000-20999, ``gw1``: 21000-21999, ...; without
    xdist: 31000-31999). A port is claimed by an exclusive ``flock`` on ``$TMPDIR/cnnpar-test-ports/PORT``, held
    until this process exits, so neither a later call here nor another test session on this machine (whose
    worker may have the same name) is given it again.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    first = PORTS_FIRST + PORTS_PER_WORKER * (int(worker[2:]) % 11 if worker[2:].isdigit() else 11)
    folder = Path(tempfile.gettempdir()) / "cnnpar-test-ports"
    folder.mkdir(exist_ok=True)
    ports = []
    for port in range(first, first + PORTS_PER_WORKER):
        if len(ports) == count:
            break
        lock = open(folder / str(port), "a")  # noqa: SIM115 (held open until this process exits)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as probe:
                probe.bind(("", port))  # nothing listens there (nor lingers, without SO_REUSEADDR)
        except OSError:
            lock.close()
            continue
        _claimed_ports.append(lock)
        ports.append(port)
    assert len(ports) == count, f"only {len(ports)} of {count} ports left in {first}-{first + PORTS_PER_WORKER - 1}"
    return ports


def worker_envs(workers=2, env=ENV):
    """The environments of ``workers`` MultiWorker processes on loopback (``env`` and a ``TF_CONFIG`` each), their
    ports reserved (:func:`reserve_ports`)."""
    spec = cluster.local_spec(workers, ports=reserve_ports(workers))
    return [{**env, "TF_CONFIG": json.dumps(cluster.Task(spec, "worker", i).tf_config())} for i in range(workers)]


def held(folder, *epochs, env=ENV):
    """``env`` for a run that waits after each of ``epochs`` until :func:`release` (``CNNPAR_HOLD_DIR``,
    ``keras_cnnpar/engine/hold.py``): a run still training when the test acts on it, however fast the machine."""
    folder.mkdir(parents=True, exist_ok=True)
    for epoch in epochs:
        (folder / str(epoch)).touch()
    return {**env, hold.ENVIRONMENT: str(folder)}


def release(folder):
    """Let a run started with :func:`held` go on past every epoch it was to wait after."""
    for file in folder.iterdir():
        file.unlink()


def wait_for_epoch_rows(csv_path, rows, process, timeout=180):
    """Wait until the epoch CSV holds ``rows`` rows (the run provably finished that many epochs)."""
    wait_until(lambda: csv_path.exists() and len(csv_path.read_text().splitlines()) > rows,
               f"epoch row {rows} in {csv_path}", timeout, process)


def wait_for_file(path, process, timeout=120):
    wait_until(path.exists, f"the file {path}", timeout, process)


def loads_tensorflow(pid):
    """Whether process ``pid`` has TensorFlow's library mapped (it imported TensorFlow)."""
    with contextlib.suppress(OSError):
        return "_pywrap_tensorflow_internal" in Path(f"/proc/{pid}/maps").read_text()
    return False


def worker_pid(launcher, index):
    """The pid of local worker ``index`` started by the launcher process (directly or through its namespace)."""
    def found():
        for pid in descendants(launcher.pid):
            with contextlib.suppress(OSError):
                if f'"index": {index}}}' in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
                    return pid
        return None

    return wait_until(found, f"worker {index} below the launcher {launcher.pid}", 30)


# Kaggle CSV test data, for the data loader's and the CLI's tests.

HEADER = "label," + ",".join(f"pixel{i}" for i in range(784))


def row(label="3", pixel="0", at=None, value=None, count=784):
    pixels = [pixel] * count
    if at is not None:
        pixels[at] = value
    return ",".join([label, *pixels])


BAD_TRAIN_FILES = {
    "wrong column count": (
        [HEADER, row(), row(count=783)],
        "{path}, line 3: expected 785 comma-separated values (label,pixel0..pixel783). Received: 784 values"),
    "a value too many": (
        [HEADER, row(), row(), row(count=785)],
        "{path}, line 4: expected 785 comma-separated values (label,pixel0..pixel783). Received: 786 values"),
    "non-numeric value": (
        [HEADER, row(at=12, value="abc")],
        "{path}, line 2, column pixel12: expected a number. Received: 'abc'"),
    "NaN": (
        [HEADER, row(), row(), row(at=5, value="nan")],
        "{path}, line 4, column pixel5: expected a finite number. Received: nan"),
    "infinity": (
        [HEADER, row(at=0, value="inf")],
        "{path}, line 2, column pixel0: expected a finite number. Received: inf"),
    "pixel above 255": (
        [HEADER, row(at=783, value="256")],
        "{path}, line 2, column pixel783: expected an integer pixel value in 0..255. Received: 256"),
    "negative pixel": (
        [HEADER, row(), row(at=1, value="-1")],
        "{path}, line 3, column pixel1: expected an integer pixel value in 0..255. Received: -1"),
    "label above 9": (
        [HEADER, row(label="10")],
        "{path}, line 2, column label: expected an integer label in 0..9. Received: 10"),
    "fractional label": (
        [HEADER, row(label="2.5")],
        "{path}, line 2, column label: expected an integer label in 0..9. Received: 2.5"),
    "wrong header": (
        ["id,pixel0", row()],
        "{path}, line 1: expected the header label,pixel0..pixel783. Received: 'id,pixel0'"),
    "fractional pixel": (
        [HEADER, row(at=3, value="12.7")],
        "{path}, line 2, column pixel3: expected an integer pixel value in 0..255. Received: 12.7"),
    "exponent spelling": (
        [HEADER, row(), row(at=9, value="1e2")],
        "{path}, line 3, column pixel9: expected a number. Received: '1e2'"),
    "underscore spelling": (
        [HEADER, row(at=0, value="1_0")],
        "{path}, line 2, column pixel0: expected a number. Received: '1_0'"),
    "empty file": (
        [],
        "{path}: the file is empty; expected a header line and rows of 785 comma-separated values "
        "(label,pixel0..pixel783). Received: 0 lines"),
    "header only": (
        [HEADER],
        "{path}: the file has a header but no rows; expected rows of 785 comma-separated values "
        "(label,pixel0..pixel783). Received: 0 rows"),
}


def write_lines(path, lines):
    """Write ``lines``, each ending in a newline (no lines: an empty file)."""
    path.write_text("".join(line + "\n" for line in lines))
    return path


def kaggle_head(train_csv, digits, path):
    """Write the header and the first ``digits`` rows of the Kaggle ``train_csv`` to ``path``; return ``path``."""
    return write_lines(path, Path(train_csv).read_text().splitlines()[:digits + 1])
