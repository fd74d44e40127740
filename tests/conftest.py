import keras
import numpy as np
import pytest

from keras_cnnpar import data, models


@pytest.fixture(scope="session")
def digits():
    return data.load("mnist-5k")


@pytest.fixture(scope="session")
def digits_split(digits):
    return data.split(digits, validation_fraction=0.2, seed=0)


def build_small_cnn(seed=0, learning_rate=0.1):
    """A CNN without dropout or batch statistics, so one step is deterministic, compiled with SGD."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="small_cnn")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return models.parallel(model)


@pytest.fixture
def small_cnn():
    return build_small_cnn


def max_weight_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights()))
