"""The memory estimate per device (``keras_cnnpar.strategies.memory``) against figures computed by hand from the
layer shapes of a small CNN, under each in-process strategy and AsyncPS (MultiWorker divides as DataParallel)."""

import keras
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.strategies import memory


def tiny_cnn(optimizer="adam"):
    """8x8 images, a 3x3 ReLU convolution of 4 channels ("same"), a 2x2 max pooling and a softmax Dense of 10."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv"),
                              keras.layers.MaxPooling2D(2, name="pool"), keras.layers.Flatten(name="flat"),
                              keras.layers.Dense(10, activation="softmax", name="out")])
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


#: The convolution's 3*3*1*4 + 4 = 40 parameters and the Dense's (4*4*4)*10 + 10 = 650: 690 float32, 2,760 bytes.
PARAMETER_BYTES = (40 + 650) * 4
#: Values per example that the backward pass keeps: the images, 8*8*1 = 64 (the convolution reads them for its
#: kernel's gradient), the convolution's ReLU output 8*8*4 = 256, the max pooling's output 4*4*4 = 64 and the 10
#: probabilities (the loss reads them); the Flatten is a view of the pooling's output.
KEPT = 64 + 256 + 64 + 10
#: The largest layer output, the convolution's: twice it is added (the gradient flowing back and the one computed).
LARGEST = 256
#: At a global batch of 16: ``(strategy, share of the parameters, their gradients and slots on one device, whether
#: the optimizer's slots are on the devices, values kept per example on one device, largest output on one device,
#: examples on one device)``.
HAND = {
    "single": (cnnpar.Single(), 1, True, KEPT, LARGEST, 16),
    "mirrored": (cnnpar.DataParallel(2), 1, True, KEPT, LARGEST, 8),  # a whole replica on half the batch
    "layers": (cnnpar.LayerPlacement(2), 1 / 2, True, KEPT, LARGEST, 8),  # a stage's share; the batch / devices
    "async-ps": (cnnpar.AsyncPS(2), 1, False, KEPT, LARGEST, 16),  # whole batches; the slots on the server
    "async-ps, 8 workers": (cnnpar.AsyncPS(8), 1, False, KEPT, LARGEST, 8),  # each batch in 2 slices
    # Every kernel and bias halved. The convolution runs on a split batch: a device holds half of its output and of
    # the pooling's (256/2, 64/2) and keeps its input padded to 10x10 for its half of the batch (100/2); the
    # images and the 10 probabilities are whole.
    "channels": (cnnpar.ChannelSharded(2), 1 / 2, True, 64 + 256 / 2 + 64 / 2 + 10 + 100 / 2, 256 / 2, 16),
    # The convolution's channels sharded over the "model" axis halve its output and the pooling's; it pads
    # inside the op ("same"), so it keeps no copy of its input; the "data" axis halves the batch.
    "hybrid": (cnnpar.Hybrid(data=2, model=2), 1 / 2, True, 64 + 256 / 2 + 64 / 2 + 10, 256 / 2, 8),
}


@pytest.mark.parametrize("precision, itemsize", [("float32", 4), ("mixed_bfloat16", 2)])
@pytest.mark.parametrize("alias", sorted(HAND))
def test_the_estimate_per_device_is_the_figure_computed_by_hand(alias, precision, itemsize):
    strategy, share, slots_here, kept, largest, examples = HAND[alias]
    adam_slots = 2 * PARAMETER_BYTES  # a momentum and a velocity per parameter
    expected = {"weights": PARAMETER_BYTES * share, "gradients": PARAMETER_BYTES * share,
                "optimizer": adam_slots * share if slots_here else 0,
                "activations": (kept + 2 * largest) * examples * itemsize}  # the weights stay float32 when mixed
    expected["total"] = sum(expected.values())
    assert memory.estimate(tiny_cnn(), strategy, 16, precision) == expected


@pytest.mark.parametrize("optimizer, slots_per_parameter", [
    (keras.optimizers.SGD(0.1), 0), (keras.optimizers.SGD(0.1, momentum=0.9), 1), (keras.optimizers.Adam(), 2),
    (keras.optimizers.Adam(amsgrad=True), 3)], ids=["sgd", "momentum", "adam", "amsgrad"])
def test_the_optimizer_part_counts_each_slot_of_every_parameter(optimizer, slots_per_parameter):
    parts = memory.estimate(tiny_cnn(optimizer), cnnpar.Single(), 16)
    assert parts["optimizer"] == slots_per_parameter * PARAMETER_BYTES
