"""The accelerator check's measurements (run by ``benchmarks/gpu_check.sh``).

Splits the GPU (or, without one, the CPU) into 2 logical devices, checks one
SGD step of ``DataParallel(2)`` against ``Single`` (TF32 off, so float32 is
float32), then prints images/s of the 2+2 CNN: ``Single`` at global batch 64
and 1,024 in float32 and mixed_bfloat16, and ``DataParallel(2)`` at 1,024, each
the median of the epochs after the first (tracing).
"""

import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import keras_cnnpar as cnnpar

KIND = "GPU" if cnnpar.devices.accelerator_kind() == "GPU" else "CPU"
NAMES = cnnpar.devices.configure(2, kind=KIND)
print(cnnpar.hardware.describe(), flush=True)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from epoch_timer import EpochTimer  # noqa: E402
from helpers import balanced, build_small_cnn, max_weight_difference  # noqa: E402

tf.config.experimental.enable_tensor_float_32_execution(False)


def parity(digits):
    x, y = balanced(digits, 64)
    models = {name: build_small_cnn(seed=1) for name in ("single", "mirrored")}
    for name, model in models.items():
        strategy = "single" if name == "single" else cnnpar.DataParallel(NAMES)
        cnnpar.fit(model, x, y, strategy=strategy, batch_size=64, epochs=1, shuffle=False, verbose=0,
                   results_dir=None)
    difference = max_weight_difference(models["single"], models["mirrored"])
    print(f"parity: DataParallel({len(NAMES)}) vs Single, one SGD step: max |diff| {difference:.2e} "
          f"({'pass' if difference < 1e-5 else 'FAIL'}, tolerance 1e-5)")
    return difference < 1e-5


def throughput(train, strategy, batch, precision, epochs=4):
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("2+2")
    rates = EpochTimer(len(train))
    model.fit(train.x, train.y, epochs=epochs, batch_size=batch, verbose=0, callbacks=[rates], strategy=strategy,
              results_dir=None, precision=precision)
    return statistics.median(rates.rates[1:])


def main():
    print(f"devices: {NAMES} ({KIND})")
    digits = cnnpar.data.load()
    ok = parity(digits)
    train, _ = cnnpar.data.split(digits, validation_fraction=0.2, seed=0)
    runs = [("single", 64, "float32"), ("single", 64, "mixed_bfloat16"), ("single", 1024, "float32"),
            ("single", 1024, "mixed_bfloat16"), (cnnpar.DataParallel(NAMES), 1024, "float32")]
    for strategy, batch, precision in runs:
        rate = throughput(train, strategy, batch, precision)
        print(f"2+2 {strategy!s:40s} batch {batch:5d} {precision:15s} {rate:9.0f} images/s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
