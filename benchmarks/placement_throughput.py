"""Images/s of cnnpar ``LayerPlacement(2, microbatches=4)`` (and ``microbatches=1``) against ``Single``.

All train the 2+2 CNN on the same 4,000 mnist-5k digits at global batch 64, in one
process, in interleaved rounds. Each figure is the median images/s over the epochs
after the first. Target on a 2-core CPU: LayerPlacement(2, microbatches=4) >= 0.9x
Single. The script also prints the speedup that the measured per-stage times
predict for p separate accelerators, where GPipe takes (m + p - 1) slots of the
slowest stage per batch instead of m times the sum of the stages.

Run: python benchmarks/placement_throughput.py [--epochs 4] [--rounds 2]
"""

from timing import EpochTimer, cnnpar, keras, parse_args, run_rounds, training_split


def measure(strategy, train, epochs):
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("2+2")
    timer = EpochTimer(len(train))
    history = model.fit(train.x, train.y, epochs=epochs, batch_size=64, verbose=0, callbacks=[timer],
                        strategy=strategy, results_dir=None)
    stages = [history.history[k][-1] for k in sorted(history.history) if k.startswith("stage")]
    return timer.rates[1:], stages


def predicted_speedup(stage_seconds, microbatches):
    """GPipe on p devices vs all stages on one: m * sum(t) / ((m + p - 1) * max(t))."""
    p = len(stage_seconds)
    return microbatches * sum(stage_seconds) / ((microbatches + p - 1) * max(stage_seconds))


def main():
    args = parse_args(__doc__)
    train = training_split()
    configs = {"single": lambda: "single",
               "layers(2, m=1)": lambda: cnnpar.LayerPlacement(2, microbatches=1),
               "layers(2, m=4)": lambda: cnnpar.LayerPlacement(2, microbatches=4)}
    stages = {}

    def run(name):
        rates, stages[name] = measure(configs[name](), train, args.epochs)
        return rates

    median = run_rounds(configs, args.rounds, run)
    print(f"\n2+2 CNN, {len(train)} images, global batch 64, {args.rounds} rounds x {args.epochs - 1} timed epochs")
    for name in configs:
        print(f"  {name:16s} {median[name]:8.0f} images/s  ({median[name] / median['single']:.2f}x single)")
    seconds = stages["layers(2, m=4)"]
    print(f"  measured stage times per micro-batch of 16: {', '.join(f'{s * 1e3:.1f} ms' for s in seconds)}")
    print(f"  layers(2, m=4) / single = {median['layers(2, m=4)'] / median['single']:.2f}x  (target >= 0.90x)")
    print(f"  predicted speedup on {len(seconds)} separate accelerators with m=4: "
          f"{predicted_speedup(seconds, 4):.2f}x")


if __name__ == "__main__":
    main()
