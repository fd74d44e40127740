"""One worker of a test cluster: ``TF_CONFIG=... python tests/multi_worker_job.py MODE[,MODE...] OUT``.

Runs each mode in turn on the cluster it joined once (each with a ``MultiWorker`` of
its own), writing under ``OUT-MODE``. Modes:

- ``step``: one SGD step of the small test CNN on 64 fixed digits under
  ``MultiWorker``; every worker saves its weights to ``OUT.<index>.npz``.
- ``accumulate``: the same 64 digits as 2 micro-batches of 32 under
  ``MultiWorker(accumulate=2)``: one update, one gradient sync.
- ``residual``: one SGD step of the resnet model in float64 (BatchNormalization,
  synchronized across the workers) on the same 64 digits.
- ``shards``: every worker writes the example indices its slices of the batches
  held, over two epochs of a shuffled pipeline, to ``OUT.<index>.json``.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import keras_cnnpar as cnnpar

SHARD_EXAMPLES, SHARD_BATCH, EPOCHS = 48, 8, 2


def one_step(strategy, out, batch_size=64, builder="build_small_cnn"):
    import helpers

    digits = cnnpar.data.load()
    model = getattr(helpers, builder)(seed=1)
    cnnpar.fit(model, digits.x[::78][:64], digits.y[::78][:64], strategy=strategy, batch_size=batch_size, epochs=1,
               shuffle=False, verbose=0, results_dir=None)
    np.savez(f"{out}.{strategy.task.index}.npz", *model.get_weights())


def shards(strategy, out):
    indices = np.arange(SHARD_EXAMPLES, dtype="float32")
    dataset = cnnpar.data.pipeline(indices, np.zeros(SHARD_EXAMPLES), SHARD_BATCH, shuffle=True,
                                   seed=strategy.shuffle_seed)
    batches = iter(strategy.distribute(dataset.repeat()))
    steps = SHARD_EXAMPLES // SHARD_BATCH
    seen = [[int(i) for _ in range(steps) for i in local_slice(strategy, next(batches))] for _ in range(EPOCHS)]
    with open(f"{out}.{strategy.task.index}.json", "w", encoding="utf-8") as file:
        json.dump(seen, file)


def local_slice(strategy, batch):
    x, _ = batch
    return strategy._tf_strategy().experimental_local_results(x)[0].numpy()


MODES = {"step": (1, one_step), "accumulate": (2, lambda strategy, out: one_step(strategy, out, batch_size=32)),
         "residual": (1, lambda strategy, out: one_step(strategy, out, builder="build_resnet_float64")),
         "shards": (1, shards)}


if __name__ == "__main__":
    modes, out = sys.argv[1].split(","), sys.argv[2]
    for mode in modes:
        accumulate, run = MODES[mode]
        # The first joins the cluster before TensorFlow starts; the others share its cluster.
        run(cnnpar.MultiWorker(checkpoint_dir=None, timeout=30, accumulate=accumulate), f"{out}-{mode}")
