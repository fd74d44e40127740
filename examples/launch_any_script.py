"""Any Keras script under MultiWorker: ``cnnpar launch --workers 2 -- python examples/launch_any_script.py``.

Written as a Keras user writes a script: the model and the ``tf.data`` pipeline
first, then one ``fit`` call whose ``strategy=`` picks the parallelism.
``cnnpar launch`` gives each process its ``TF_CONFIG`` and makes
``import keras_cnnpar`` join the cluster; on several hosts, set ``TF_CONFIG``
and ``CNNPAR_MULTI_WORKER=1`` on each and run the same script. Only the chief
(worker 0) writes results.

Run: cnnpar launch --workers 2 -- python examples/launch_any_script.py [--epochs 2] [--examples 4000] \\
         [--keras-logs logs]
"""

import argparse

import keras
import tensorflow as tf

import keras_cnnpar as cnnpar

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--examples", type=int, default=4000, help="training digits to use (the rest validate)")
parser.add_argument("--results", default="results")
parser.add_argument("--keras-logs", help="a folder for Keras's own ModelCheckpoint, CSVLogger and TensorBoard "
                                         "(only the chief's files land there)")
args = parser.parse_args()

digits = cnnpar.data.load()
train, val = cnnpar.data.split(digits, validation_fraction=0.2, seed=0)
train_data = tf.data.Dataset.from_tensor_slices((train.x[:args.examples], train.y[:args.examples]))
train_data = train_data.shuffle(4000, seed=0).batch(64)
val_data = tf.data.Dataset.from_tensor_slices((val.x, val.y)).batch(64)

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(32, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
], name="launched_cnn")
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [] if args.keras_logs is None else [
    keras.callbacks.ModelCheckpoint(f"{args.keras_logs}/last.keras"),
    keras.callbacks.CSVLogger(f"{args.keras_logs}/epochs.csv"),
    keras.callbacks.TensorBoard(f"{args.keras_logs}/tensorboard"),
]
history = cnnpar.fit(model, train_data, validation_data=val_data, epochs=args.epochs, strategy="multi-worker",
                     results_dir=args.results, callbacks=callbacks, verbose=2)
print(f"final validation accuracy {history.history['val_accuracy'][-1]:.4f}")
