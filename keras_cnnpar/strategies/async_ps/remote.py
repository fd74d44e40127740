"""AsyncPS's one path: a coordinator process of its own trains, the user's process drives it.

A process joins a TensorFlow cluster only by restarting its runtime under the
cluster's device names, which leaves every model it built before unreadable.
So the user's process never joins: ``AsyncPS.prepare`` saves the prepared model
(weights, compile settings, optimizer state) into a temporary folder and starts
``python -m keras_cnnpar.strategies.async_ps.remote FOLDER PID``, a fresh process
that joins the cluster first (starting the local one), loads the model,
restores the run's checkpoint and answers with the report and the completed
epochs. Whichever was created first, the model or the strategy, training takes
this path. A local cluster's process runs in a private network namespace where
Linux allows one (``unshare --user --net``): its servers and its coordinator
listen on a loopback no other process or host can reach.

Per epoch the user's process writes that epoch's batches (``tf.data``'s
``save``, so a reshuffling pipeline gives the same batches it would have read)
and sends the learning rate; the coordinator trains and writes the weights and
one ``EPOCH`` line of logs; the user's process loads them into its copy, runs
the callbacks against it, removes the epoch's batches and answers whether to
stop. The folder holds at most one epoch's batches (and the validation
batches). At the end the trained model, optimizer state included, comes back
the same way. An error in the coordinator comes back as the same exception
type with its message (``PeerLost``, ``ValueError``, ...). The coordinator
removes the folder and exits when the user's process dies.
"""

import builtins
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cloudpickle
import keras
import tensorflow as tf

from keras_cnnpar.cluster import network
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.runtime import startup
from keras_cnnpar.runtime.subprocesses import library_command
from keras_cnnpar.strategies import loop, registry
from keras_cnnpar.strategies.base import PeerLost, Run, RunSettings
from keras_cnnpar.zoo import data

#: The prefixes of the coordinator's protocol lines on its standard output.
READY, EPOCH, DONE, ERROR = "CNNPAR-READY ", "CNNPAR-EPOCH ", "CNNPAR-DONE", "CNNPAR-ERROR "
#: How long the user's process lets a failed coordinator finish writing its traceback before ending it.
ERROR_EXIT_SECONDS = 10
#: The file of the folder that holds the trained model's random layer states (``rebuild.random_states``).
RANDOM_STATES = "random_states.json"
#: The file of the folder that holds the user's classes and functions the model names (``rebuild.custom_objects``).
CUSTOM_OBJECTS = "custom_objects.pickle"


class CoordinatorCheckpoint:
    """What the user's process knows of the run's checkpoint; the coordinator process restores, writes and
    removes it."""

    def __init__(self, directory, completed_epochs):
        self.directory, self.completed_epochs = directory, completed_epochs


class CoordinatorProcessRun(Run):
    """An ``AsyncPS`` training seen from the user's process: the coordinator process, its folder and its report.

    ``fit`` trains through it; ``finalize`` copies the trained state into the
    user's model; ``close`` ends the process and removes the folder (also when
    the run ends in an error).
    """

    def __init__(self, strategy, settings, model):
        super().__init__(strategy, settings, model)
        self.folder = Path(tempfile.mkdtemp(prefix="cnnpar-async-"))
        self.child, self.trained = None, None
        try:
            model.save(self.folder / "model.keras")
            # What the saved model does not hold: the exclusions from weight decay, the random layers' states,
            # and the classes and functions of the user's own that it names (a script's by value), with the path
            # to their modules.
            (self.folder / "run.json").write_text(json.dumps({
                "options": strategy.options(), "settings": settings.as_dict(), "sys_path": sys.path,
                "weight_decay_exclusions": rebuild.weight_decay_exclusions(model),
                "random_states": _random_states(model)}))
            (self.folder / CUSTOM_OBJECTS).write_bytes(cloudpickle.dumps(rebuild.custom_objects(model)))
            self.child = _start_coordinator(self.folder, private_network=strategy.spec is None)
            ready = json.loads(self._expect(READY))
        except BaseException:
            self.close()
            raise
        self.coordinator_report = ready["report"]
        if ready["checkpoint"] is not None:
            self.checkpoint = CoordinatorCheckpoint(ready["checkpoint"], ready["completed_epochs"])

    def report(self):
        return self.coordinator_report

    def fit(self, train, *, epochs=1, validation_data=None, callbacks=None, initial_epoch=0, verbose=1,
            steps_per_epoch=None, validation_steps=None, validation_freq=1, **unsupported):
        steps = loop.epoch_steps(self.strategy, train, steps_per_epoch, unsupported)
        loop.validates_after(0, validation_freq)  # a bad value fails here, before the coordinator trains
        if validation_data is not None:
            validation_steps = validation_steps or loop.finite_steps(validation_data, "validation")
            validation_data.take(validation_steps).save(str(self.folder / "validation"))
        self._send({"epochs": epochs, "initial_epoch": initial_epoch, "steps_per_epoch": steps,
                    "validation_steps": validation_steps if validation_data is not None else None,
                    "validation_freq": validation_freq if isinstance(validation_freq, int) else list(validation_freq)})
        batches = iter(train.repeat())  # one iterator, epoch after epoch, as Keras's fit reads it
        validated = {}  # the coordinator's validation of the epoch, which the callbacks see between their test hooks

        def train_epoch(epoch, _):
            logs = self._train_epoch(epoch, batches, steps, train.element_spec)
            validated.clear()
            validated.update({name[len("val_"):]: logs.pop(name) for name in list(logs) if name.startswith("val_")})
            return logs

        try:
            history = loop.run_epochs(
                self.model, train_epoch, epochs=epochs, steps=steps, callbacks=callbacks, verbose=verbose,
                initial_epoch=initial_epoch, validate=(lambda _: dict(validated)) if validation_data is not None
                else None, validation_freq=validation_freq,
                after_epoch=lambda epoch: self._send({"stop": bool(self.model.stop_training)}))
            self._expect(DONE)
            if self.child.wait() != 0:
                raise RuntimeError(f"the AsyncPS coordinator process failed with exit code {self.child.returncode}")
            with keras.saving.custom_object_scope(rebuild.custom_objects(self.model)):
                self.trained = keras.saving.load_model(self.folder / "trained.keras", safe_mode=False)  # ours
            rebuild.set_random_states(self.trained, json.loads((self.folder / RANDOM_STATES).read_text()))
            return history
        finally:
            self.close()

    def finalize(self, model):
        """Copy the trained weights and optimizer state into ``model`` (the coordinator removed the checkpoint)."""
        rebuild.copy_state(self.trained, model)

    def close(self):
        """End the coordinator process, if it still runs, and remove the folder."""
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _train_epoch(self, epoch, batches, steps, element_spec):
        """Write the epoch's batches, let the coordinator train on them, load the weights; return the logs."""
        epoch_dataset = data.untuned(tf.data.Dataset.from_generator(lambda: itertools.islice(batches, steps),
                                                                    output_signature=element_spec))
        epoch_dataset.save(str(self.folder / f"train-{epoch}"))
        optimizer = self.model.optimizer  # its rate, as callbacks left it; a schedule is the coordinator's own copy
        rate = None if rebuild.learning_rate_schedule(optimizer) else float(keras.ops.convert_to_numpy(
            optimizer.learning_rate))
        self._send({"train": f"train-{epoch}", "learning_rate": rate})
        logs = json.loads(self._expect(EPOCH))
        shutil.rmtree(self.folder / f"train-{epoch}")
        self.model.load_weights(self.folder / "epoch.weights.h5")
        return logs

    def _send(self, message):
        self.child.stdin.write(json.dumps(message) + "\n")
        self.child.stdin.flush()

    def _expect(self, prefix):
        """The rest of the coordinator's next line that starts with ``prefix`` (other lines pass through);
        its error, raised here, when it sent one."""
        for line in self.child.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            if line.startswith(ERROR):  # the coordinator exits next: let its traceback reach stderr first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.child.wait(timeout=ERROR_EXIT_SECONDS)
                raise _exception(json.loads(line[len(ERROR):]))
            sys.stdout.write(line)
        raise RuntimeError(f"the AsyncPS coordinator process ended (exit code {self.child.wait()}) before it sent "
                           f"{prefix.strip()}; its errors are above")


def _start_coordinator(folder, private_network):
    """Start the coordinator process for ``folder``; in a private network namespace for a local cluster, where
    Linux allows one."""
    command = library_command("keras_cnnpar.strategies.async_ps.remote", str(folder), str(os.getpid()))
    if private_network and network.private_network_available():
        command = ["unshare", "--user", "--map-root-user", "--net", "--", *command, "--private-network"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _exception(error):
    """The exception the coordinator process reported: its own type where it is ``PeerLost`` or a built-in."""
    kind = PeerLost if error["type"] == "PeerLost" else getattr(builtins, error["type"], None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        return RuntimeError(f"the AsyncPS coordinator process failed: {error['type']}: {error['message']}")
    return kind(error["message"])


class _Reporter(keras.callbacks.Callback):
    """In the coordinator process: after each epoch, write the weights and logs, then follow the answer."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_epoch_end(self, epoch, logs=None):
        self.model.save_weights(self.folder / "epoch.weights.h5")
        print(EPOCH + json.dumps({name: float(value) for name, value in (logs or {}).items()}), flush=True)
        self.model.stop_training = _receive()["stop"]


class _UserProcessGone(Exception):
    """The user's process closed the pipe: it is gone (it ends this process before it closes it)."""


def _receive():
    """The user's process's next message; raises ``_UserProcessGone`` at the end of input."""
    line = sys.stdin.readline()
    if not line:
        raise _UserProcessGone
    return json.loads(line)


def _remove_when_orphaned(folder, parent):
    """Watch the user's process ``parent``: once it is gone, remove ``folder`` and end this process."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="orphan-watch").start()


def main(folder, parent, private_network=False):
    """The coordinator process: join the cluster first, then load the model, restore the checkpoint, and
    train on the epochs' batches as they come."""
    folder = Path(folder)
    _remove_when_orphaned(folder, parent)
    try:
        if private_network:
            network.loopback_up()
        run = json.loads((folder / "run.json").read_text())
        sys.path.extend(entry for entry in run["sys_path"] if entry not in sys.path)  # the user's modules
        with keras.saving.custom_object_scope(cloudpickle.loads((folder / CUSTOM_OBJECTS).read_bytes())):
            _coordinate(folder, run, private_network)
    except _UserProcessGone:  # before the orphan watch sees it: nobody else removes the folder
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)
    except Exception as error:
        print(ERROR + json.dumps({"type": type(error).__name__, "message": str(error)}), flush=True)
        raise
    print(DONE, flush=True)


def _coordinate(folder, run, private_network):
    """Join the cluster, load the model, answer with the report, train, and save the trained model."""
    # Every option as the user gave it: ``strategies.create`` reads None as "the default", and a run with
    # checkpoint_dir=None wrote its checkpoints under ./checkpoints (two such runs in one folder collided).
    strategy = registry.entry("async-ps").load()(**run["options"])
    strategy.join(private_network=private_network)  # first: a fresh process joins the cluster
    model = keras.saving.load_model(folder / "model.keras", safe_mode=False)  # the user's process wrote it
    rebuild.exclude_from_weight_decay(model, run["weight_decay_exclusions"])
    rebuild.set_random_states(model, run["random_states"])
    training = strategy.prepare(model, RunSettings(**run["settings"]))
    checkpoint = training.checkpoint
    print(READY + json.dumps({
        "report": training.report(), "checkpoint": str(checkpoint.directory) if checkpoint else None,
        "completed_epochs": checkpoint.completed_epochs if checkpoint else 0}), flush=True)
    request = _receive()
    validation = None
    if request["validation_steps"]:
        validation = data.untuned(tf.data.Dataset.load(str(folder / "validation")))

    def epoch_batches(epoch):
        message = _receive()
        if message["learning_rate"] is not None:
            training.model.optimizer.learning_rate = message["learning_rate"]
        return data.untuned(tf.data.Dataset.load(str(folder / message["train"])))

    training.fit(epoch_batches, validation_data=validation, callbacks=[_Reporter(folder)], verbose=0, **request)
    training.finalize(model)
    model.save(folder / "trained.keras")
    (folder / RANDOM_STATES).write_text(json.dumps(_random_states(model)))


def _random_states(model):
    """``model``'s random layer states as JSON lists (``rebuild.random_states``)."""
    return [state.numpy().tolist() for state in rebuild.random_states(model)]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), private_network="--private-network" in sys.argv[3:])
    startup.exit_now(0)
