"""The zoo's model kinds and the name each has (its Keras name and the prefix of its result files), and the forms
of a user's model's source, without importing Keras, so the command line's checks stay instant.

>>> MODEL_NAMES["2+2"]
'cnn2d_2layer_fullconnected_2layer'
"""

import os

#: Model kind -> the name the original project gave its result files (and the Keras model's name).
MODEL_NAMES = {
    "2+2": "cnn2d_2layer_fullconnected_2layer",
    "3+3": "cnn2d_3layer_fullconnected_3layer",
    "resnet": "cnn2d_resnet_3stage",
}


def check_model_source(source):
    """Raise a one-line ``ValueError`` unless ``source`` has the form of a model's source: a zoo kind, an
    existing ``.keras`` file, or ``package.module:function`` (what ``zoo.models.from_source`` builds from).

    >>> check_model_source("3+3"), check_model_source("keras_cnnpar.zoo.models:build")
    (None, None)
    >>> check_model_source("4+4")
    Traceback (most recent call last):
    ValueError: expected 2+2, 3+3, resnet, a .keras file or package.module:function. Received: --model 4+4
    """
    if source in MODEL_NAMES:
        return
    if source.endswith(".keras"):
        if not os.path.isfile(source):
            raise ValueError(f"{source}: no such file. Received: --model {source}")
        return
    module_name, colon, function_name = source.partition(":")
    if not (colon and module_name and function_name):
        raise ValueError(f"expected {', '.join(MODEL_NAMES)}, a .keras file or package.module:function. Received: "
                         f"--model {source}")
