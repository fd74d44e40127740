"""AsyncPS for a model built before the strategy: a coordinator process of its own trains it.

A process joins a TensorFlow cluster only by restarting its runtime under the
cluster's device names, which leaves every model it built before unreadable.
So when ``AsyncPS`` is created in a process that already runs TensorFlow (as
``fit(strategy="async-ps")`` always is), the user's process stays out of the
cluster: :func:`fit` saves the model (weights, compile settings, optimizer
state) and the batches of the run into a temporary folder and starts
``python -m keras_cnnpar.strategies.async_remote FOLDER``, a fresh process that
creates the same ``AsyncPS`` first, loads the model and trains it. After every
epoch the child writes the weights and one ``EPOCH`` line of logs; the parent
loads them into its copy, runs the callbacks against it, and answers with the
learning rate and whether to stop. At the end the trained model, optimizer
state included, comes back the same way. The parent's process is never
connected, so predict, export and other strategies keep working in it.

The batches of every epoch are saved up front (``tf.data.Dataset.save``), so a
reshuffling pipeline gives the child the same batches the user's process would
have read; the folder holds ``epochs`` passes of the data until the run ends.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import keras
import tensorflow as tf

from keras_cnnpar import rebuild
from keras_cnnpar.strategies import loop
from keras_cnnpar.strategies.base import RunSettings, create
from keras_cnnpar.subprocesses import dying_with_parent, python_command

#: The prefix of the child's protocol lines on its standard output.
EPOCH, DONE = "CNNPAR-EPOCH ", "CNNPAR-DONE"


def fit(run, train, *, epochs, steps, validation_data, validation_steps, callbacks, initial_epoch, verbose):
    """Train ``run.model`` under ``run.strategy`` in a coordinator process of its own; return the ``History``."""
    prepared, settings = run.model, run.settings
    with tempfile.TemporaryDirectory(prefix="cnnpar-async-") as folder:
        folder = Path(folder)
        prepared.save(folder / "model.keras")
        train.take(steps * (epochs - initial_epoch)).save(str(folder / "train"))
        if validation_data is not None:
            validation_steps = validation_steps or loop.finite_steps(validation_data, "validation")
            validation_data.take(validation_steps).save(str(folder / "validation"))
        (folder / "run.json").write_text(json.dumps({
            "options": run.strategy.options(),
            "settings": {"precision": settings.precision, "fused_optimizer": settings.fused_optimizer,
                         "record": dict(settings.record)},
            "fit": {"epochs": epochs, "initial_epoch": initial_epoch, "steps_per_epoch": steps,
                    "validation_steps": validation_steps if validation_data is not None else None}}))
        child = subprocess.Popen(  # dying with the user's process, it leaves none behind
            dying_with_parent(python_command("-m", "keras_cnnpar.strategies.async_remote", str(folder))),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            history = loop.run_epochs(
                prepared, lambda epoch, _: _next_epoch(child, folder, prepared), epochs=epochs, steps=steps,
                callbacks=callbacks, verbose=verbose, initial_epoch=initial_epoch,
                after_epoch=lambda epoch: _answer(child, prepared))
            _expect(child, DONE)
            if child.wait() != 0:
                raise RuntimeError(f"the AsyncPS coordinator process failed with exit code {child.returncode}")
            rebuild.copy_state(keras.saving.load_model(folder / "trained.keras"), prepared)
            return history
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def _next_epoch(child, folder, prepared):
    logs = json.loads(_expect(child, EPOCH))
    prepared.load_weights(folder / "epoch.weights.h5")
    return logs


def _expect(child, prefix):
    """The rest of the child's next line that starts with ``prefix`` (other lines pass through)."""
    for line in child.stdout:
        if line.startswith(prefix):
            return line[len(prefix):]
        sys.stdout.write(line)
    raise RuntimeError(f"the AsyncPS coordinator process ended (exit code {child.wait()}) before it sent "
                       f"{prefix.strip()}; its errors are above")


def _answer(child, prepared):
    """Tell the child the learning rate to go on with and whether to stop."""
    stop = bool(prepared.stop_training)
    rate = float(keras.ops.convert_to_numpy(prepared.optimizer.learning_rate))
    child.stdin.write(json.dumps({"stop": stop, "learning_rate": rate}) + "\n")
    child.stdin.flush()


class _Reporter(keras.callbacks.Callback):
    """In the coordinator process: after each epoch, write the weights and logs, then follow the parent's answer."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_epoch_end(self, epoch, logs=None):
        self.model.save_weights(self.folder / "epoch.weights.h5")
        print(EPOCH + json.dumps({name: float(value) for name, value in (logs or {}).items()}), flush=True)
        answer = json.loads(sys.stdin.readline() or '{"stop": true}')
        self.model.optimizer.learning_rate = answer["learning_rate"]
        self.model.stop_training = answer["stop"]


def main(folder):
    """The coordinator process: join the cluster first, then load the model and the batches, and train."""
    folder = Path(folder)
    run = json.loads((folder / "run.json").read_text())
    strategy = create("async-ps", **run["options"])  # first: this fresh process joins the cluster
    model = keras.saving.load_model(folder / "model.keras")
    train = tf.data.Dataset.load(str(folder / "train"))
    validation = tf.data.Dataset.load(str(folder / "validation")) if (folder / "validation").exists() else None
    training = strategy.prepare(model, RunSettings(**run["settings"]))
    training.fit(train, validation_data=validation, callbacks=[_Reporter(folder)], verbose=0, **run["fit"])
    training.finalize(model)
    model.save(folder / "trained.keras")
    print(DONE, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
