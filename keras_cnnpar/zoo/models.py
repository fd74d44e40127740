"""The model zoo: the original digit-recognizer CNNs and a small ResNet, whose ``fit`` accepts ``strategy=``.

Example:

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> model.count_params()
246682
>>> digits = cnnpar.data.load()
>>> history = model.fit(digits.x[::20], digits.y[::20], epochs=1, batch_size=64,
...                     strategy="single", results_dir=None, verbose=0)
"""

import importlib
import os
import sys
import warnings

import keras
from keras import layers

from keras_cnnpar.zoo.names import MODEL_NAMES, check_model_source

#: The model kinds :func:`cnn` builds.
KINDS = tuple(MODEL_NAMES)


def cnn(kind="2+2", *, input_shape=(28, 28, 1), num_classes=10):
    """Build and compile one of the zoo's CNNs (see :func:`build`); its ``fit`` accepts ``strategy=``.

    The training machinery is imported here, when a model is made to train,
    so that importing the zoo (to export or serve a model) never loads it.

    >>> cnn("resnet").count_params()
    78426
    """
    from keras_cnnpar.api import parallel  # the one use of training: the `fit` hook

    return parallel(build(kind, input_shape=input_shape, num_classes=num_classes))


def from_source(source, *, input_shape=(28, 28, 1), num_classes=10):
    """The compiled model that ``source`` names, its ``fit`` accepting ``strategy=``: a zoo kind (:func:`cnn`), a
    ``.keras`` file that ``keras.saving.load_model`` reads (its custom objects registered), or
    ``package.module:function`` (its module found from the current folder or the Python path), a function that
    takes no arguments and returns a compiled Keras model. It must take images of ``input_shape`` and give
    ``num_classes`` outputs; a ``ValueError`` says in one line what does not fit.

    >>> from_source("3+3").name
    'cnn2d_3layer_fullconnected_3layer'
    >>> from_source("keras_cnnpar.zoo.models:build", input_shape=(32, 32, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: keras_cnnpar.zoo.models:build takes inputs of shape (28, 28, 1), the data's are (32, 32, 3); ...
    """
    from keras_cnnpar.api import parallel

    check_model_source(source)
    if source in MODEL_NAMES:
        return cnn(source, input_shape=input_shape, num_classes=num_classes)
    model = _loaded(source) if source.endswith(".keras") else _built(source)
    _check_fits(model, source, tuple(input_shape), num_classes)
    return parallel(model)


def _loaded(path):
    try:
        with warnings.catch_warnings():  # a model saved untrained has no optimizer state: Keras warns, we build it
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            return keras.saving.load_model(path)
    except Exception as error:  # Keras raises many kinds for a file it cannot read
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: Keras could not load it as a model ({first}); for a model of custom layers, "
                         f"give --model package.module:function, a function of yours that imports them and returns "
                         f"keras.saving.load_model(...). Received: --model {path}") from None


def _built(source):
    module_name, _, function_name = source.partition(":")
    if os.getcwd() not in sys.path:  # the user's module in the current folder, as uvicorn and gunicorn find theirs
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{source}: {type(error).__name__}: {error}. Received: --model {source}") from None
    try:
        model = function()
    except Exception as error:  # the user's code: any kind
        raise ValueError(f"{source} raised {type(error).__name__}: {error}. Received: --model {source}") from None
    if not isinstance(model, keras.Model):
        raise ValueError(f"{source} must return a compiled keras.Model; it returned a {type(model).__name__}. "
                         f"Received: --model {source}")
    return model


def _check_fits(model, source, input_shape, num_classes):
    if not model.compiled:
        raise ValueError(f"{source} gives a model that was not compiled; compile it (optimizer, loss, metrics) "
                         f"before saving or returning it. Received: --model {source}")
    takes = tuple(model.input_shape[1:]) if isinstance(model.input_shape, tuple) else None
    if takes != input_shape:
        raise ValueError(f"{source} takes inputs of shape {takes}, the data's are {input_shape}; give data of its "
                         f"shape or a model of the data's. Received: --model {source}")
    gives = model.output_shape[-1] if isinstance(model.output_shape, tuple) else None
    if gives != num_classes:
        raise ValueError(f"{source} gives {gives} outputs, the data has {num_classes} classes. Received: "
                         f"--model {source}")


def build(kind="2+2", *, input_shape=(28, 28, 1), num_classes=10):
    """Build and compile one of the original CNNs, as a plain Keras model.

    - ``"2+2"``: conv5x5x32, pool, conv5x5x64, pool, fc1024, dropout 0.5, fc10; Adam 5e-4.
    - ``"3+3"``: pad+conv3x3x32, pad+conv3x3x48, pool, pad+conv3x3x32, pool, fc128,
      dropout 0.25, fc128, dropout 0.25, fc10; lecun_uniform dense layers; SGD 0.05
      with Nesterov momentum 0.9.

    - ``"resnet"`` (functional): a 3x3x16 stem with BatchNormalization, three
      residual stages of 16, 32 and 64 channels (two 3x3 convolutions with
      BatchNormalization each; the last two stages start with stride 2 and a
      1x1 projection shortcut), global average pooling, fc10; Adam 1e-3. The
      BatchNormalization momentum is 0.9, so that the moving statistics settle
      within a few short epochs.

    All are channels-last, end in a softmax, and use sparse categorical
    cross-entropy on integer labels with accuracy as the metric.

    >>> build("2+2").count_params()
    3274634

    Args:
        kind: ``"2+2"``, ``"3+3"`` or ``"resnet"``.
        input_shape: ``(height, width, channels)`` of one image.
        num_classes: number of output classes.
    """
    builders = {"2+2": _two_plus_two, "3+3": _three_plus_three, "resnet": _resnet}
    if kind not in builders:
        raise ValueError(f"model must be one of {sorted(builders)}. Received: model={kind!r}")
    model, optimizer = builders[kind](keras.Input(shape=tuple(input_shape)), num_classes, MODEL_NAMES[kind])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _two_plus_two(inputs, num_classes, name):
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
    return keras.Sequential([inputs, *body], name=name), keras.optimizers.Adam(5e-4)


def _three_plus_three(inputs, num_classes, name):
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
    return keras.Sequential([inputs, *body], name=name), keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)


def _resnet(inputs, num_classes, name):
    x = _conv_norm(inputs, 16, 1, "stem", activation=True)
    for stage, (channels, stride) in enumerate([(16, 1), (32, 2), (64, 2)], start=1):
        x = _residual_block(x, channels, stride, f"stage{stage}")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="classes")(x)
    return keras.Model(inputs, outputs, name=name), keras.optimizers.Adam(1e-3)


def _residual_block(x, channels, stride, name):
    """conv-norm-relu, conv-norm, plus the shortcut (a 1x1 projection where the shape changes), relu."""
    shortcut = x
    if stride != 1 or x.shape[-1] != channels:
        shortcut = _conv_norm(x, channels, stride, f"{name}_shortcut", kernel_size=1)
    y = _conv_norm(x, channels, stride, f"{name}_a", activation=True)
    y = _conv_norm(y, channels, 1, f"{name}_b")
    return layers.Activation("relu", name=f"{name}_relu")(layers.Add(name=f"{name}_add")([shortcut, y]))


def _conv_norm(x, channels, stride, name, kernel_size=3, activation=False):
    x = layers.Conv2D(channels, kernel_size, strides=stride, padding="same", use_bias=False, name=f"{name}_conv")(x)
    x = layers.BatchNormalization(momentum=0.9, name=f"{name}_norm")(x)
    return layers.Activation("relu", name=f"{name}_relu")(x) if activation else x
