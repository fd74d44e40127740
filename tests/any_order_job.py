"""One cell of the any-order matrix, written as a Keras user writes a script: ``python tests/any_order_job.py ALIAS``.

Builds the 2+2 CNN, trains it with Keras's own ``fit``, then fits it under the
strategy ALIAS on a finite, shuffled, batched ``tf.data`` pipeline of 8
batches with an ``EarlyStopping`` that stops after the second epoch (with
``resume=True`` where the strategy keeps checkpoints and the order allows it),
evaluates the user's model, and fits it again under "single". Prints ``ALIAS
EPOCHS STEPS KERAS STRATEGY FINAL UNCHANGED``: the validation accuracy after
Keras's fit, after the strategy's and after the last ``single`` fit, then
whether the strategy object's attributes are what they were before its ``fit``.
"""

import os
import sys

import keras
import tensorflow as tf

import keras_cnnpar as cnnpar


def main(alias):
    if "TF_CONFIG" not in os.environ:  # a launched worker joined its cluster at import, with one device
        cnnpar.devices.configure(4)
    digits = cnnpar.data.load()
    train, val = cnnpar.data.split(digits, validation_fraction=0.2, seed=0)
    x, y = train.x[:512], train.y[:512]
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("2+2")
    keras.Model.fit(model, x, y, batch_size=64, epochs=1, verbose=0)  # Keras's own fit, before any strategy
    keras_accuracy = model.evaluate(val.x, val.y, verbose=0)[1]
    user_data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=0).batch(64)  # 8 batches
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)  # stops after the 2nd epoch
    before = int(model.optimizer.iterations.numpy())
    strategy = cnnpar.strategies.resolve(alias)
    configuration = dict(vars(strategy))
    keeps = cnnpar.strategies.registry.entry(alias).keeps_checkpoints
    resume = {"resume": True} if keeps else {}  # none yet
    history = model.fit(user_data, epochs=4, strategy=strategy, results_dir=None, verbose=0, callbacks=[stop],
                        **resume)
    steps = int(model.optimizer.iterations.numpy()) - before
    accuracy = model.evaluate(val.x, val.y, verbose=0)[1]
    model.fit(x, y, batch_size=64, epochs=1, strategy="single", results_dir=None, verbose=0)
    final_accuracy = model.evaluate(val.x, val.y, verbose=0)[1]
    unchanged = vars(strategy) == configuration
    print(alias, len(history.history["loss"]), steps, keras_accuracy, accuracy, final_accuracy,
          unchanged)  # under cnnpar launch: the chief's output


if __name__ == "__main__":
    main(sys.argv[1])
