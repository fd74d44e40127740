"""The zoo's model kinds and the name each has (its Keras name and the prefix of its result files), without
importing Keras, so the command line's choices stay instant.

>>> MODEL_NAMES["2+2"]
'cnn2d_2layer_fullconnected_2layer'
"""

#: Model kind -> the name the original project gave its result files (and the Keras model's name).
MODEL_NAMES = {
    "2+2": "cnn2d_2layer_fullconnected_2layer",
    "3+3": "cnn2d_3layer_fullconnected_3layer",
    "resnet": "cnn2d_resnet_3stage",
}
