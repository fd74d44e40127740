"""``strategy="auto"`` against its plan: the chosen configuration, trained in a separate measured run, against
the fastest throughput the plan measured (target: within 10%).

For each model kind: ``keras_cnnpar.plan.planner.choose`` on 2 devices (a fresh plan: the cache goes to a temporary
folder), then the chosen strategy trains ``--epochs`` epochs of the 4,000-digit split at batch 64; its images/s
is the median of the epochs after the first.

Run: python benchmarks/auto_choice.py [--epochs 3] [--rounds 1]
"""

import os
import statistics
import tempfile
import time

from timing import EpochTimer, cnnpar, parse_args, training_split

from keras_cnnpar.plan import planner

TARGET = 0.9


def main():
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory(prefix="cnnpar-plan-cache-") as cache:
        os.environ["CNNPAR_CACHE"] = cache
        compare(args, training_split())


def compare(args, train):
    """Plan and train each model kind; print the plan and the separate run's ratio to it."""
    for kind in ("2+2", "3+3", "resnet"):
        started = time.perf_counter()
        strategy, plan = planner.choose(cnnpar.models.cnn(kind), train.x, train.y, batch_size=64, devices=2,
                                        log=lambda line: None)
        seconds = time.perf_counter() - started
        print(f"\n{kind}: plan on 2 devices in {seconds:.0f} s\n{plan.table()}")
        best = plan.best()
        rates = []
        for _ in range(args.rounds):
            timer = EpochTimer(len(train))
            cnnpar.models.cnn(kind).fit(train.x, train.y, strategy=strategy, batch_size=64, epochs=args.epochs,
                                        results_dir=None, verbose=0, callbacks=[timer])
            rates += timer.rates[1:]
        measured = statistics.median(rates)
        ratio = measured / best.images_per_second
        print(f"{kind}: auto chose {best.configuration}: plan {best.images_per_second:.0f} images/s, separate run "
              f"{measured:.0f} images/s = {ratio:.2f}x the plan's fastest (target >= {TARGET}: "
              f"{'met' if ratio >= TARGET else 'missed'})")


if __name__ == "__main__":
    main()
