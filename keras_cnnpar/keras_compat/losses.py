"""A compiled model's loss as one function of ``(y_true, y_pred, sample_weight)``, as Keras's own trainer
computes it (for loops of our own that do not run ``Model.train_step``)."""

import numpy as np
from keras.src.trainers.compile_utils import get_loss


def weighted_loss(model):
    """The compiled loss of ``model`` (one output) as ``loss(y_true, y_pred, sample_weight=None)``, resolved, weighted
    and reduced as Keras's ``compile`` does (labels of shape ``(n,)`` against predictions of ``(n, 1)``, the
    ``"crossentropy"`` alias, the weighted losses summed over the batch size), times its ``loss_weights`` when given.

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(loss="mse", loss_weights=[0.5])
    >>> float(weighted_loss(model)(np.ones((2, 1)), np.zeros((2, 1)), sample_weight=np.array([1.0, 0.0])))
    0.25
    """
    weight = model.get_compile_config().get("loss_weights")
    (weight,) = [1.0] if weight is None else weight.values() if isinstance(weight, dict) else np.atleast_1d(weight)

    def weighted(y_true, y_pred, sample_weight=None):
        loss = get_loss(model.loss, y_true, y_pred)  # a function comes wrapped, the labels' rank matched
        return float(weight) * loss(y_true, y_pred, sample_weight=sample_weight)

    return weighted
