"""Images/s of plain Keras ``fit``, cnnpar ``Single`` (float32 and mixed_bfloat16) and ``DataParallel(2)``.

All four train the 2+2 CNN on the same 4,000 mnist-5k digits at global batch 64,
in one process, in interleaved rounds so that machine noise hits them alike.
An epoch's images/s is 4,000 over its wall time; each figure is the median over
the epochs after the first (tracing) of every round. Targets on a 2-core CPU:
Single >= 1.3x plain Keras, DataParallel(2) >= 0.9x Single, Single in mixed_bfloat16
>= 1.6x float32 Single (on a CPU with AMX-BF16 or AVX512-BF16).

Run: python benchmarks/fit_throughput.py [--epochs 4] [--rounds 2]
"""

from timing import EpochTimer, cnnpar, keras, parse_args, run_rounds, training_split


def measure(name, train, epochs):
    keras.utils.set_random_seed(0)
    model = cnnpar.models.cnn("2+2")
    timer = EpochTimer(len(train))
    options = {"epochs": epochs, "batch_size": 64, "verbose": 0, "callbacks": [timer]}
    if name == "plain keras":
        keras.Model.fit(model, train.x, train.y, **options)
    else:
        strategy = cnnpar.DataParallel(2) if name == "cnnpar mirrored(2)" else cnnpar.Single()
        precision = "mixed_bfloat16" if name.endswith("bf16") else "float32"
        model.fit(train.x, train.y, strategy=strategy, results_dir=None, precision=precision, **options)
    return timer.rates[1:]


def main():
    args = parse_args(__doc__)
    train = training_split()
    names = ["plain keras", "cnnpar single", "cnnpar single bf16", "cnnpar mirrored(2)"]
    median = run_rounds(names, args.rounds, lambda name: measure(name, train, args.epochs))
    print(f"\n2+2 CNN, {len(train)} images, global batch 64, {args.rounds} rounds x {args.epochs - 1} timed epochs")
    for name in names:
        print(f"  {name:20s} {median[name]:8.0f} images/s")
    single_vs_keras = median["cnnpar single"] / median["plain keras"]
    mirrored_vs_single = median["cnnpar mirrored(2)"] / median["cnnpar single"]
    print(f"  single / plain keras      = {single_vs_keras:.2f}x  (target >= 1.30x)")
    print(f"  mirrored(2) / single      = {mirrored_vs_single:.2f}x  (target >= 0.90x)")
    bf16_vs_single = median["cnnpar single bf16"] / median["cnnpar single"]
    print(f"  single bf16 / single      = {bf16_vs_single:.2f}x  (target >= 1.60x)")


if __name__ == "__main__":
    main()
