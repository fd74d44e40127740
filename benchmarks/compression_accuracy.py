"""What compressed gradients cost in accuracy: validation accuracy after the same epochs as Single, seed by seed.

Two replicas of ``DataParallel`` on logical CPUs sum their gradients as two hosts of ``MultiWorker`` do (the same
``compression=`` code, on the same global batch), so the accuracy of a compression is measured here in one process;
its speed across hosts is ``benchmarks/cluster_links.py``'s. For each model and seed (the 4,000/1,000 split of
mnist-5k, global batch 64) it trains Single, then each compression, and prints the validation accuracy after the
last epoch and its difference from Single's; the last line counts the runs within ``--within`` points of Single.

Run: python benchmarks/compression_accuracy.py [--models 2+2,3+3] [--seeds 0,1,2] [--epochs 3]
[--compressions powersgd:4,bfloat16]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras_cnnpar as cnnpar

cnnpar.devices.configure(2)

import keras  # noqa: E402  (after the logical devices)


def strategy_of(name):
    """``single``, ``none`` (plain all-reduce), ``bfloat16`` or ``powersgd:RANK`` as a strategy."""
    if name == "single":
        return cnnpar.Single()
    kind, _, rank = name.partition(":")
    return cnnpar.DataParallel(2, compression=None if kind == "none" else kind,
                               powersgd_rank=int(rank) if rank else None)


def accuracy(model_kind, name, seed, epochs, split):
    train, val = split
    keras.utils.set_random_seed(seed)
    model = cnnpar.models.cnn(model_kind)
    start = time.perf_counter()
    history = model.fit(train.x, train.y, epochs=epochs, batch_size=64, validation_data=(val.x, val.y),
                        strategy=strategy_of(name), results_dir=None, verbose=0)
    return history.history["val_accuracy"][-1], time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="2+2,3+3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compressions", default="powersgd:4")
    parser.add_argument("--within", type=float, default=1.0, help="points of accuracy from Single's")
    args = parser.parse_args()
    print(cnnpar.hardware.describe(), flush=True)
    split = cnnpar.data.split(cnnpar.data.load(), validation_fraction=0.2, seed=0)
    held = total = 0
    print("model  seed  configuration   val_accuracy  vs single  seconds")
    for model_kind in args.models.split(","):
        for seed in map(int, args.seeds.split(",")):
            single, seconds = accuracy(model_kind, "single", seed, args.epochs, split)
            print(f"{model_kind:6s} {seed:4d}  {'single':14s} {single:12.4f} {'':>9s} {seconds:8.1f}", flush=True)
            for name in args.compressions.split(","):
                value, seconds = accuracy(model_kind, name, seed, args.epochs, split)
                points = 100 * (value - single)
                held, total = held + (abs(points) <= args.within or points > 0), total + 1
                print(f"{model_kind:6s} {seed:4d}  {name:14s} {value:12.4f} {points:+9.2f} {seconds:8.1f}",
                      flush=True)
    print(f"\n{held} of {total} compressed runs within {args.within} point of Single's validation accuracy (or above)")


if __name__ == "__main__":
    main()
