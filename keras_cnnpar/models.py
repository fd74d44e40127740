"""The original digit-recognizer CNNs, the ``strategy=`` hook on ``fit``, and run-file names.

Example:

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> model.count_params()
246682
>>> digits = cnnpar.data.load()
>>> history = model.fit(digits.x[:256], digits.y[:256], epochs=1, batch_size=64,
...                     strategy="single", results_dir=None, verbose=0)
"""

import functools
from pathlib import Path

import keras
from keras import layers

FRAMEWORK = "keras_tensorflow"

#: Model kind -> the name the original project gave its result files.
MODEL_NAMES = {
    "2+2": "cnn2d_2layer_fullconnected_2layer",
    "3+3": "cnn2d_3layer_fullconnected_3layer",
}


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


def parallel(model):
    """Return ``model`` with a ``fit`` that also accepts ``strategy=`` (and ``results_dir=``).

    Without ``strategy`` the call is Keras's own ``fit``, unchanged. With it, the
    call is :func:`keras_cnnpar.fit`: the model is rebuilt for the strategy,
    trained, and the trained weights are copied back. The model stays an
    ordinary Keras model in every other way.

    >>> import keras, keras_cnnpar as cnnpar
    >>> model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
    ...                           keras.layers.Dense(10, activation="softmax")])
    >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    >>> model = parallel(model)
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[:128], digits.y[:128], batch_size=64, strategy="single",
    ...                     results_dir=None, verbose=0)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"parallel() takes a keras.Model. Received: model={type(model).__name__}")
    keras_fit = type(model).fit

    @functools.wraps(keras_fit)
    def fit(*args, strategy=None, **kwargs):
        if strategy is None:
            return keras_fit(model, *args, **kwargs)
        from keras_cnnpar import training

        return training.fit(model, *args, strategy=strategy, **kwargs)

    model.fit = fit
    return model


def run_file_name(model_name, strategy, devices, suffix=".csv"):
    """Name of a run configuration's file (its per-epoch CSV by default), in the original project's convention.

    >>> run_file_name("cnn2d_2layer_fullconnected_2layer", "mirrored", 2)
    'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_mirrored_2dev.csv'
    >>> run_file_name("cnn2d_2layer_fullconnected_2layer", "single", 1, ".weights.h5")
    'cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.weights.h5'
    """
    return f"{model_name}_{FRAMEWORK}_{strategy}_{devices}dev{suffix}"


def kind_of(file_name):
    """The model kind (``"2+2"`` or ``"3+3"``) whose run files start like ``file_name``, else None.

    >>> kind_of("cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.weights.h5")
    '3+3'
    """
    return next((kind for kind, name in MODEL_NAMES.items() if Path(file_name).name.startswith(name + "_")), None)
