"""Memory per device before training: weights, gradients, optimizer slots and activations, for each strategy.

The parts come from the model itself: its weights' bytes, its optimizer's
slots (a copy of the optimizer built on the weights), and the activations of
one micro-batch, summed over every layer's outputs at the compute dtype (what
the backward pass keeps). Each strategy divides them as it places them:

====================  =======================================  ==========================================
strategy              weights, gradients, optimizer slots       activations
====================  =======================================  ==========================================
single                all                                       the global batch
mirrored, multi-worker all (one copy per replica)               the batch / replicas
layers                1/devices (layers spread over devices)    the batch / devices (each stage its layers)
channels              Conv2D/Dense kernels and biases / devices the batch / devices (channels sharded)
hybrid                as channels, over the "model" axis        the batch / devices
async-ps              weights and gradients (slots on the ps)   the batch / workers
====================  =======================================  ==========================================

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("2+2")
>>> parts = estimate(model, cnnpar.Single(), batch_size=64)
>>> parts["weights"] == parts["gradients"] == model.count_params() * 4, parts["optimizer"] / parts["weights"]  # Adam
(True, 2.0)
"""

import keras
import numpy as np

#: Layers whose weights the tensor-parallel strategies shard over the "model" axis.
SHARDED_LAYERS = (keras.layers.Conv2D, keras.layers.Dense)


def estimate(model, strategy, batch_size, precision="float32"):
    """Bytes per device of ``model`` trained under ``strategy`` at the global ``batch_size``, by part.

    Returns a dict: ``weights``, ``gradients``, ``optimizer``, ``activations`` and their ``total``.
    """
    alias, devices = strategy.alias, strategy.num_devices
    weights = _bytes(model.weights)
    trainable = _bytes(model.trainable_weights)
    slots = _slot_bytes(model)
    if alias in ("channels", "hybrid"):
        model_axis = devices // getattr(strategy, "data", 1)
        sharded = _bytes([w for layer in model._flatten_layers(include_self=False) if isinstance(layer, SHARDED_LAYERS)
                          for w in layer.weights])
        share = (weights - sharded * (1 - 1 / model_axis)) / weights if weights else 1.0
        parts = {"weights": weights * share, "gradients": trainable * share, "optimizer": slots * share}
    elif alias == "layers":
        parts = {"weights": weights / devices, "gradients": trainable / devices, "optimizer": slots / devices}
    elif alias == "async-ps":
        parts = {"weights": weights, "gradients": trainable, "optimizer": 0}
    else:
        parts = {"weights": weights, "gradients": trainable, "optimizer": slots}
    per_device_batch = batch_size / (1 if alias == "single" else devices)
    itemsize = 2 if precision.startswith("mixed") else 4
    parts["activations"] = activation_values(model) * per_device_batch * itemsize
    parts = {name: round(value) for name, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def activation_values(model):
    """Values per example that the layers of ``model`` output (inputs included), from their traced shapes."""
    total = 0
    for layer in model._flatten_layers(include_self=False):
        for node in getattr(layer, "_inbound_nodes", []):
            for tensor in node.output_tensors:
                total += int(np.prod(tensor.shape[1:]))
    return total


def _bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def _slot_bytes(model):
    """Bytes of the optimizer's slots (momentum, velocity, ...) for ``model``'s trainable weights, from a copy of
    its optimizer built on them (``iterations`` and the learning rate left out)."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if optimizer is None:
        return 0
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(model.trainable_weights)
    return sum(_bytes([v]) for v in copy.variables if len(v.shape) > 0)
