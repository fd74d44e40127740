"""Tensor parallel on Keras's own application CNNs: one SGD step under ChannelSharded(2) and Hybrid(2, 2) against
Single.

Models that no test of this project was written for: each CNN of ``keras.applications`` listed below, built
without pretrained weights for 10 classes at a small input (75x75 where Keras needs at least 71, else 32x32), is
copied in float64 with its Dropout rates at 0 (the mesh draws dropout masks of its own, so a step with dropout
cannot match Single's), and takes one SGD step (rate 0.01) on the same 4 random images under Single and under each
strategy. It prints, per model and strategy, the largest difference of any weight from Single's (moving statistics
included), the weight it is in, and that difference relative to the largest change of a weight in Single's step (at
a small input some of these models' first steps move weights by more than 1), or the error with which the strategy
refuses the model. Target: within 1e-9 of Single's step (float64; a deep graph sums in another order), or a refusal
that names the layer and what it supports.

Run: python benchmarks/applications_parity.py [--models MobileNetV2,ResNet50,...] [--strategies channels,hybrid]
"""

import argparse

import numpy as np
from timing import cnnpar, keras

from keras_cnnpar.keras_compat import rebuild

#: keras.applications name -> input size (Keras's smallest allowed, or 32).
MODELS = {"MobileNetV2": 32, "MobileNetV3Small": 32, "ResNet50": 32, "ResNet50V2": 32, "DenseNet121": 32,
          "EfficientNetB0": 32, "EfficientNetV2B0": 32, "VGG16": 32, "Xception": 75, "InceptionV3": 75,
          "NASNetMobile": 32, "ConvNeXtTiny": 32}
STRATEGIES = {"channels": lambda: cnnpar.ChannelSharded(2), "hybrid": lambda: cnnpar.Hybrid(data=2, model=2)}
TARGET = 1e-9


def application(name, size):
    keras.utils.set_random_seed(0)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=10,
                                             classifier_activation=None)


def in_float64_without_dropout(layer, config):
    """``rebuild.clone_with``'s hook: every layer computes in float64, and a Dropout drops nothing."""
    if isinstance(layer, keras.layers.Layer):
        config.update(dtype="float64")
    if isinstance(layer, keras.layers.Dropout):
        config.update(rate=0.0)


def after_one_step(original, strategy, x, y):
    """The weights of a float64 copy of ``original`` after one SGD step on ``x, y`` under ``strategy``."""
    model = rebuild.clone_with(original, in_float64_without_dropout)
    model.set_weights([w.astype("float64") for w in original.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cnnpar.fit(model, x, y, strategy=strategy, batch_size=len(x), shuffle=False, verbose=0, results_dir=None)
    return model


def largest_difference(model, expected):
    """``(largest absolute difference, the weight's path)`` between the weights of two models of one graph."""
    return max((float(np.max(np.abs(a.numpy() - b.numpy()))), a.path) for a, b in zip(model.weights,
                                                                                    expected.weights))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    print(f"one SGD step on 4 images in float64, dropout off; target: within {TARGET:g} of Single's step, or a "
          "refusal")
    for name in args.models.split(","):
        size = MODELS[name]
        original = application(name, size)
        rng = np.random.default_rng(0)
        x, y = rng.random((4, size, size, 3), dtype="float32").astype("float64"), rng.integers(0, 10, 4)
        expected = after_one_step(original, "single", x, y)
        step, _ = largest_difference(original, expected)
        for alias in args.strategies.split(","):
            try:
                model = after_one_step(original, STRATEGIES[alias](), x, y)
            except (ValueError, TypeError) as error:  # a refusal names the layer; anything else is a defect
                print(f"{name:17s} {alias:9s} {type(error).__name__}: {error}", flush=True)
                continue
            difference, path = largest_difference(model, expected)
            verdict = "ok" if difference <= TARGET * step else "DIFFERS"
            print(f"{name:17s} {alias:9s} {difference:.1e} ({path}), {difference / step:.1e} of the step's "
                  f"{step:.2g}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
