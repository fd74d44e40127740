"""The model zoo: the original digit-recognizer CNNs, whose ``fit`` accepts ``strategy=``.

Example:

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> model.count_params()
246682
>>> digits = cnnpar.data.load()
>>> history = model.fit(digits.x[::20], digits.y[::20], epochs=1, batch_size=64,
...                     strategy="single", results_dir=None, verbose=0)
"""

import keras
from keras import layers

from keras_cnnpar.runs import MODEL_NAMES
from keras_cnnpar.training import parallel

#: The model kinds :func:`cnn` builds.
KINDS = tuple(MODEL_NAMES)


def cnn(kind="2+2", *, input_shape=(28, 28, 1), num_classes=10):
    """Build and compile one of the original CNNs; its ``fit`` accepts ``strategy=``.

    - ``"2+2"``: conv5x5x32, pool, conv5x5x64, pool, fc1024, dropout 0.5, fc10; Adam 5e-4.
    - ``"3+3"``: pad+conv3x3x32, pad+conv3x3x48, pool, pad+conv3x3x32, pool, fc128,
      dropout 0.25, fc128, dropout 0.25, fc10; lecun_uniform dense layers; SGD 0.05
      with Nesterov momentum 0.9.

    Both are channels-last, end in a softmax, and use sparse categorical
    cross-entropy on integer labels with accuracy as the metric.

    Args:
        kind: ``"2+2"`` or ``"3+3"``.
        input_shape: ``(height, width, channels)`` of one image.
        num_classes: number of output classes.
    """
    builders = {"2+2": _two_plus_two, "3+3": _three_plus_three}
    if kind not in builders:
        raise ValueError(f"model must be one of {sorted(builders)}. Received: model={kind!r}")
    body, optimizer = builders[kind](num_classes)
    model = keras.Sequential([keras.Input(shape=tuple(input_shape)), *body], name=MODEL_NAMES[kind])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return parallel(model)


def _two_plus_two(num_classes):
    body = [
        layers.Conv2D(32, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Conv2D(64, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(1024, activation="relu"),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ]
    return body, keras.optimizers.Adam(5e-4)


def _three_plus_three(num_classes):
    def dense(units, activation):
        return layers.Dense(units, activation=activation, kernel_initializer="lecun_uniform")

    body = [
        layers.ZeroPadding2D(1), layers.Conv2D(32, 3, activation="relu"),
        layers.ZeroPadding2D(1), layers.Conv2D(48, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.ZeroPadding2D(1), layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        dense(128, "relu"), layers.Dropout(0.25),
        dense(128, "relu"), layers.Dropout(0.25),
        dense(num_classes, "softmax"),
    ]
    return body, keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
