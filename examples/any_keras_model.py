"""Any compiled Keras model trains under a strategy, through cnnpar.parallel or cnnpar.fit.

Run: python examples/any_keras_model.py
"""

import keras

import keras_cnnpar as cnnpar

cnnpar.devices.configure(2)

model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(10, activation="softmax"),
], name="tiny_cnn")
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
train, val = cnnpar.data.split(cnnpar.data.load(), validation_fraction=0.2, seed=0)  # mnist-5k is class-ordered

model = cnnpar.parallel(model)  # now model.fit accepts strategy=
model.fit(train.x, train.y, epochs=2, batch_size=64, validation_data=(val.x, val.y), strategy="mirrored",
          results_dir="results")
history = cnnpar.fit(model, train.x, train.y, epochs=1, batch_size=64, strategy="single", results_dir="results")
print("loss, accuracy:", model.evaluate(val.x, val.y, verbose=0))
