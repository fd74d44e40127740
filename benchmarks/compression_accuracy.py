"""What the remedies for slow links cost in accuracy: validation accuracy after the same epochs as Single, by seed.

Each configuration trains through ``cnnpar train`` on this machine (mnist-5k, its 4,000/1,000 split by the seed,
global batch 64), the speed across hosts being ``benchmarks/cluster_links.py``'s:

- ``single``;
- a compression, as ``bfloat16`` or ``powersgd:RANK``: two replicas of ``mirrored`` on logical CPUs, which sum
  their gradients as two hosts of ``multi-worker`` do (the same ``compression=`` code, on the same global batch);
- local steps, as ``local:H`` followed by any of ``:nesterov`` or ``:average`` (the outer optimizer),
  ``:bfloat16`` and ``:NAME=VALUE`` (another option, as ``outer_momentum=0.5``): two worker processes of
  ``local-steps`` (``--workers 2``).

It prints each run's validation accuracy after the last epoch and its difference from Single's of the same seed;
the last line counts the runs within ``--within`` points of Single (or above).

Run: python benchmarks/compression_accuracy.py [--models 2+2,3+3] [--seeds 0,1,2] [--epochs 3]
[--configurations powersgd:4,bfloat16,local:16,local:32:average]
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras_cnnpar as cnnpar

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def strategy_arguments(name):
    """``cnnpar train``'s strategy arguments for ``single``, ``bfloat16``, ``powersgd:RANK`` or ``local:H[:...]``.

    >>> strategy_arguments("powersgd:4")
    ['--strategy', 'mirrored', '--devices', '2', '--option', "compression='powersgd'", '--option', 'powersgd_rank=4']
    >>> strategy_arguments("local:32:average:bfloat16:outer_lr=0.8")[4:]
    ['--option', 'inner_steps=32', '--option', "outer='average'", '--option', "compression='bfloat16'", \
'--option', 'outer_lr=0.8']
    """
    kind, *rest = name.split(":")
    if kind == "single":
        return ["--strategy", "single"]
    if kind == "local":
        options = [f"inner_steps={rest[0]}", *(word if "=" in word else f"compression={word!r}" if word == "bfloat16"
                                               else f"outer={word!r}" for word in rest[1:])]
        return ["--strategy", "local-steps", "--workers", "2", *(a for o in options for a in ("--option", o))]
    options = [f"compression={kind!r}", *(f"powersgd_rank={rest[0]}" for _ in rest[:1])]
    return ["--strategy", "mirrored", "--devices", "2", *(a for o in options for a in ("--option", o))]


def accuracy(model_kind, name, seed, epochs):
    """The validation accuracy after ``epochs`` of ``name`` on ``model_kind`` with ``seed``, and the seconds."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "keras_cnnpar.cli", "train", "--model", model_kind, "--epochs",
                        str(epochs), "--seed", str(seed), "--batch-size", "64", "--verbose", "0", "--results",
                        folder, *strategy_arguments(name)], check=True, capture_output=True, env=ENV, cwd=folder)
        with (Path(folder) / "runs.csv").open(newline="") as file:
            (row,) = csv.DictReader(file)
        return float(row["val_accuracy"]), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="2+2,3+3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--configurations", default="powersgd:4,local:16")
    parser.add_argument("--within", type=float, default=1.0, help="points of accuracy from Single's")
    args = parser.parse_args()
    print(cnnpar.hardware.describe(), flush=True)
    held = total = 0
    print("model  seed  configuration          val_accuracy  vs single  seconds")
    for model_kind in args.models.split(","):
        for seed in map(int, args.seeds.split(",")):
            single, seconds = accuracy(model_kind, "single", seed, args.epochs)
            print(f"{model_kind:6s} {seed:4d}  {'single':22s} {single:12.4f} {'':>9s} {seconds:8.1f}", flush=True)
            for name in args.configurations.split(","):
                value, seconds = accuracy(model_kind, name, seed, args.epochs)
                points = 100 * (value - single)
                held, total = held + (abs(points) <= args.within or points > 0), total + 1
                print(f"{model_kind:6s} {seed:4d}  {name:22s} {value:12.4f} {points:+9.2f} {seconds:8.1f}",
                      flush=True)
    print(f"\n{held} of {total} runs within {args.within} point of Single's validation accuracy (or above)")


if __name__ == "__main__":
    main()
