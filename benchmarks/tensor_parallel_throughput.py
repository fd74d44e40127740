"""Tensor parallel on 2 CPU cores: the sharded convolution against ``tf.nn.conv2d``, and step time against Single.

1. The convolutions of the 2+2 CNN at batch 64, forward and backward, on one
   device: ``tf.nn.conv2d`` (oneDNN) against ``conv_as_matmul``, the im2col
   matmul with the hand-written (col2im) gradient that ``ChannelShardedConv2D``
   runs on each device's shard.
2. Epoch images/s of ``Single``, ``ChannelSharded(2)`` and ``Hybrid(2, 2)`` on
   the 2+2 CNN (4,000 mnist-5k digits, global batch 64), in interleaved rounds in
   one process; the step-time ratio to Single is Single's images/s over the
   strategy's. Target on 2 CPU cores: <= 1.5x.

Run: python benchmarks/tensor_parallel_throughput.py [--epochs 3] [--rounds 2]
"""

import statistics
import time

import keras
import tensorflow as tf
from timing import EpochTimer, cnnpar, parse_args, run_rounds, training_split

from keras_cnnpar.sharded.layers import conv_as_matmul

CONVS = {"conv 5x5 1->32 at 28x28": ((64, 32, 32, 1), (5, 5, 1, 32)),
         "conv 5x5 32->64 at 14x14": ((64, 18, 18, 32), (5, 5, 32, 64))}


def conv_milliseconds(conv, x, kernel, repeats=20):
    """Median ms of one forward + backward (input and kernel gradients) of ``conv``."""
    kernel = tf.Variable(kernel)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            total = tf.reduce_sum(tf.square(conv(x, kernel)))
        return tape.gradient(total, [x, kernel])

    step(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        [g.numpy() for g in step(x)]
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(name, train, epochs):
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("2+2")
    timer = EpochTimer(len(train))
    strategy = {"single": cnnpar.Single(), "channels(2)": cnnpar.ChannelSharded(2),
                "hybrid(2x2)": cnnpar.Hybrid(data=2, model=2)}[name]
    model.fit(train.x, train.y, strategy=strategy, results_dir=None, epochs=epochs, batch_size=64, verbose=0,
              callbacks=[timer])
    return timer.rates[1:]


def main():
    args = parse_args(__doc__)
    print("convolution, forward + backward, one device, batch 64")
    for label, (x_shape, k_shape) in CONVS.items():
        x, kernel = tf.random.normal(x_shape), tf.random.normal(k_shape)
        reference = conv_milliseconds(lambda x, k: tf.nn.conv2d(x, k, 1, "VALID"), x, kernel)
        sharded = conv_milliseconds(conv_as_matmul, x, kernel)
        print(f"  {label:26s} tf.nn.conv2d {reference:6.1f} ms   conv_as_matmul {sharded:6.1f} ms   "
              f"ratio {sharded / reference:.2f}x")
    train = training_split()
    names = ["single", "channels(2)", "hybrid(2x2)"]
    median = run_rounds(names, args.rounds, lambda name: measure(name, train, args.epochs))
    print(f"\n2+2 CNN, {len(train)} images, global batch 64, {args.rounds} rounds x {args.epochs - 1} timed epochs")
    for name in names:
        print(f"  {name:12s} {median[name]:7.0f} images/s   step time {median['single'] / median[name]:.2f}x single"
              + ("  (target <= 1.5x)" if name != "single" else ""))


if __name__ == "__main__":
    main()
