"""One worker of a test cluster: ``TF_CONFIG=... python tests/multi_worker_job.py MODE[,MODE...] OUT``.

Runs each mode in turn on the cluster it joined once (each with a ``MultiWorker`` of
its own), writing under ``OUT-MODE``. Modes:

- ``step``: one SGD step of the small test CNN on 64 fixed digits under
  ``MultiWorker``; every worker saves its weights to ``OUT.<index>.npz``.
- ``accumulate``: the same 64 digits as 2 micro-batches of 32 under
  ``MultiWorker(accumulate=2)``: one update, one gradient sync.
- ``residual``: one SGD step of the resnet model in float64 (BatchNormalization,
  synchronized across the workers) on the same 64 digits.
- ``local-step``: ``step`` under ``LocalSteps(inner_steps=1, outer="average")``.
- ``local-steps``: the 64 digits as 4 batches of 16 under ``LocalSteps(inner_steps=3)``, DiLoCo's outer
  step (Nesterov, lr 0.7, momentum 0.9): 3 local steps, an exchange, a fourth, the epoch's exchange.
- ``shards``: every worker writes the example indices that ``cnnpar.fit`` handed
  its training steps, over two shuffled epochs, to ``OUT.<index>.json`` (a layer
  of the model records each step's input: the examples are their own indices).
"""

import itertools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_cnnpar as cnnpar

SHARD_EXAMPLES, SHARD_BATCH, EPOCHS = 48, 8, 2
#: The inputs of this worker's training steps, in order (``Recorded``), and how many had run at each epoch's end.
SEEN, EPOCH_ENDS = [], []


def one_step(strategy, out, batch_size=64, builder="build_small_cnn"):
    import helpers

    digits = cnnpar.data.load()
    model = getattr(helpers, builder)(seed=1)
    cnnpar.fit(model, digits.x[::78][:64], digits.y[::78][:64], strategy=strategy, batch_size=batch_size, epochs=1,
               shuffle=False, verbose=0, results_dir=None)
    np.savez(f"{out}.{strategy.task.index}.npz", *model.get_weights())


class Recorded(keras.layers.Layer):
    """Passes its input on; in training, appends it to ``SEEN`` first (in this process, as the step runs)."""

    def call(self, x, training=None):
        if not training:
            return x
        recorded = tf.py_function(lambda values: SEEN.append(values.numpy().ravel().tolist()) or values, [x], x.dtype)
        return tf.ensure_shape(recorded, x.shape)


class EpochEnds(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        EPOCH_ENDS.append(len(SEEN))


def shards(strategy, out):
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(Recorded()(inputs)))
    model.compile(keras.optimizers.SGD(0.0), "mse")
    indices = np.arange(SHARD_EXAMPLES, dtype="float32").reshape(-1, 1)
    cnnpar.fit(model, indices, np.zeros((SHARD_EXAMPLES, 1), "float32"), strategy=strategy, batch_size=SHARD_BATCH,
               epochs=EPOCHS, shuffle=True, verbose=0, results_dir=None, callbacks=[EpochEnds()])
    steps = [0, *EPOCH_ENDS]
    seen = [[int(i) for step in SEEN[start:end] for i in step] for start, end in itertools.pairwise(steps)]
    with open(f"{out}.{strategy.task.index}.json", "w", encoding="utf-8") as file:
        json.dump(seen, file)


def multi_worker(**options):
    return lambda: cnnpar.MultiWorker(checkpoint_dir=None, timeout=30, **options)


def local_steps(**options):
    return lambda: cnnpar.LocalSteps(checkpoint_dir=None, timeout=30, **options)


#: Each mode's strategy, and what it runs.
MODES = {"step": (multi_worker(), one_step),
         "accumulate": (multi_worker(accumulate=2), lambda strategy, out: one_step(strategy, out, batch_size=32)),
         "residual": (multi_worker(), lambda strategy, out: one_step(strategy, out, builder="build_resnet_float64")),
         "shards": (multi_worker(), shards),
         "packed": (multi_worker(pack_bytes=100_000), one_step),  # the dense kernel (295 kB) alone in its pack
         "local-step": (local_steps(inner_steps=1, outer="average"), one_step),
         "local-steps": (local_steps(inner_steps=3, outer_lr=0.7, outer_momentum=0.9),
                         lambda strategy, out: one_step(strategy, out, batch_size=16))}


if __name__ == "__main__":
    modes, out = sys.argv[1].split(","), sys.argv[2]
    for mode in modes:
        strategy, run = MODES[mode]
        # The first joins the cluster before TensorFlow starts; the others share its cluster.
        run(strategy(), f"{out}-{mode}")
