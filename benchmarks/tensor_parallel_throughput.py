"""Tensor parallel on 2 CPU cores: the sharded convolutions against ``tf.nn.conv2d``, and step time against Single.

1. One device's shard of the row-mode convolutions of the CNNs at batch 64,
   forward and backward: ``tf.nn.conv2d`` (oneDNN; DTensor refuses it with a
   sharded kernel) against the two formulations ``ChannelShardedConv2D``
   chooses from: ``conv_as_matmul`` (im2col, hand-written col2im gradient) and
   ``conv_as_filter_gradient`` (``Conv2DBackpropFilter`` with the roles
   swapped). The row-mode rule of ``ChannelShardedConv2D.formulation`` comes
   from these; every convolution on ChannelSharded's 1-D mesh now runs in
   column mode, so it serves a ``ChannelShardedConv2D(mode="row")`` built directly.
   Then ``depthwise_conv`` (``ShardedDepthwiseConv2D``'s: TensorFlow's op with
   a gradient in ops DTensor has rules for) against ``tf.nn.depthwise_conv2d``
   and its own gradient ops, at shapes of MobileNetV2's blocks.
2. Epoch images/s of ``Single``, ``ChannelSharded(2)`` and ``Hybrid(2, 2)`` on
   the 2+2, the 3+3 and the resnet (4,000 mnist-5k digits, global batch 64),
   interleaved in rounds in one process; the step-time ratio to Single is
   Single's images/s over the strategy's. Targets on 2 CPU cores:
   ChannelSharded(2) <= 1.5x, Hybrid(2, 2) <= 2x.

Run: python benchmarks/tensor_parallel_throughput.py [--epochs 3] [--rounds 2]
"""

import statistics
import time

from timing import EpochTimer, cnnpar, keras, parse_args, run_rounds, tf, training_split

from keras_cnnpar.strategies.tensor_parallel.layers import conv_as_filter_gradient, conv_as_matmul, depthwise_conv

#: One of two shards of each row-mode convolution: (padded input, kernel) shapes at batch 64.
CONVS = {"2+2 5x5 16(of 32)->64 at 14x14": ((64, 18, 18, 16), (5, 5, 16, 64)),
         "3+3 3x3 16(of 32)->48 at 28x28": ((64, 30, 30, 16), (3, 3, 16, 48)),
         "resnet 3x3 8(of 16)->16 at 28x28": ((64, 30, 30, 8), (3, 3, 8, 16)),
         "resnet 3x3 16(of 32)->32 at 14x14": ((64, 16, 16, 16), (3, 3, 16, 32)),
         "resnet 3x3 32(of 64)->64 at 7x7": ((64, 9, 9, 32), (3, 3, 32, 64))}
#: Depthwise 3x3 convolutions with "same" padding at batch 64: input shape and strides.
DEPTHWISE = {"96 channels at 16x16": ((64, 16, 16, 96), 1), "96 channels at 16x16, stride 2": ((64, 16, 16, 96), 2),
             "192 channels at 8x8": ((64, 8, 8, 192), 1), "32 channels at 32x32": ((64, 32, 32, 32), 1)}
STRATEGIES = {"single": cnnpar.Single, "channels(2)": lambda: cnnpar.ChannelSharded(2),
              "hybrid(2x2)": lambda: cnnpar.Hybrid(data=2, model=2)}
TARGETS = {"channels(2)": 1.5, "hybrid(2x2)": 2.0}


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


def measure(config, train, epochs):
    kind, name = config
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn(kind)
    timer = EpochTimer(len(train))
    model.fit(train.x, train.y, strategy=STRATEGIES[name](), results_dir=None, epochs=epochs, batch_size=64,
              verbose=0, callbacks=[timer])
    return timer.rates[1:]


def main():
    args = parse_args(__doc__)
    print("one shard's row-mode convolution, forward + backward, one device, batch 64 (ms)")
    for label, (x_shape, k_shape) in CONVS.items():
        x, kernel = tf.random.normal(x_shape), tf.random.normal(k_shape)
        native = conv_milliseconds(lambda x, k: tf.nn.conv2d(x, k, 1, "VALID"), x, kernel)
        im2col = conv_milliseconds(conv_as_matmul, x, kernel)
        swapped = conv_milliseconds(conv_as_filter_gradient, x, kernel)
        print(f"  {label:36s} tf.nn.conv2d {native:6.1f}   im2col {im2col:6.1f}   filter gradient {swapped:6.1f}   "
              f"best/conv2d {min(im2col, swapped) / native:.2f}x")
    print("depthwise 3x3 convolution, forward + backward, one device, batch 64 (ms)")
    for label, (x_shape, stride) in DEPTHWISE.items():
        x, kernel = tf.random.normal(x_shape), tf.random.normal((3, 3, x_shape[-1], 1))
        native = conv_milliseconds(lambda x, k, s=stride: tf.nn.depthwise_conv2d(x, k, [1, s, s, 1], "SAME"), x,
                                   kernel)
        ours = conv_milliseconds(lambda x, k, s=stride: depthwise_conv(x, k, (s, s), "same"), x, kernel)
        print(f"  {label:36s} tf.nn.depthwise_conv2d {native:6.1f}   depthwise_conv {ours:6.1f}   "
              f"{ours / native:.2f}x")
    train = training_split()
    configs = [(kind, name) for kind in ("2+2", "3+3", "resnet") for name in STRATEGIES]
    median = run_rounds(configs, args.rounds, lambda config: measure(config, train, args.epochs))
    print(f"\n{len(train)} images, global batch 64, {args.rounds} rounds x {args.epochs - 1} timed epochs")
    for kind, name in configs:
        ratio = median[kind, "single"] / median[kind, name]
        target = f"  (target <= {TARGETS[name]}x: {'met' if ratio <= TARGETS[name] else 'missed'})" \
            if name in TARGETS else ""
        print(f"  {kind:7s} {name:12s} {median[kind, name]:7.0f} images/s   step time {ratio:.2f}x single{target}")


if __name__ == "__main__":
    main()
