"""What the benchmark scripts share: the machine line, 4 logical devices (2 replicas, a 2 x 2 mesh), the training
split, images/s.

Import it first, and Keras and TensorFlow from it: ``import keras_cnnpar`` must come before TensorFlow starts to turn
oneDNN on where TensorFlow leaves it off (AVX2-only CPUs), and the logical devices must be created before its runtime
starts. It prints the machine (CPU model and flags, oneDNN, GPUs) as the benchmark's first line.
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_cnnpar as cnnpar

cnnpar.devices.configure(4)
print(cnnpar.hardware.describe(), flush=True)

import keras  # noqa: E402, F401  (after keras_cnnpar: the scripts import these three from here)
import tensorflow as tf  # noqa: E402, F401
from epoch_timer import EpochTimer  # noqa: E402, F401


def training_split():
    """The 4,000-image training part of mnist-5k (stratified, seed 0)."""
    train, _ = cnnpar.data.split(cnnpar.data.load(), validation_fraction=0.2, seed=0)
    return train


def run_rounds(configs, rounds, measure):
    """Run ``measure(name)`` for every config, ``rounds`` times interleaved; return name -> median images/s."""
    rates = {name: [] for name in configs}
    for _ in range(rounds):
        for name in configs:
            rates[name] += measure(name)
    return {name: statistics.median(values) for name, values in rates.items()}


def parse_args(doc, *extra):
    """``--epochs`` (default 4; the first is not timed), ``--rounds`` (default 2), and the script's ``extra``
    options, each a ``(flag, keywords of add_argument)`` pair."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    for flag, keywords in extra:
        parser.add_argument(flag, **keywords)
    return parser.parse_args()
